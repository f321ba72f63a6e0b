// A float vector of the build's widest ISA for the native CPU kernels.
//
// Built with -mavx512f/bw/vl/dq, `VF` is one zmm register (16 lanes); built with -mavx2 -mfma
// -mf16c it is one ymm register (8 lanes). Kernels are written once against `kLanes`:
//   load(p)         fp32 / bf16 / fp16 / int8 / fp8-e4m3fn memory -> fp32 lanes (bf16 is the
//                   high half of an fp32: widen and shift left 16; fp16 through the hardware
//                   converter; int8 sign-extended; e4m3fn through fp16: see fp8_to_half)
//   fma(a, b, c)    a * b + c               bcast(x)  all lanes = x
//   add/sub/mul/div lane-wise IEEE ops      neg_abs(x)  -|x|
//   if_neg(x, a, b) a where x < 0, else b   keep_nan(x, r)  x where x is NaN, else r
//   reduce_add/max  horizontal sum / max    exp(x)    Cody-Waite + degree-6 polynomial
//                                                     (rel. error ~2e-7; -inf -> 0)
//   first_n(x, n)   lanes >= n set to -inf  transpose(rows[kLanes])  in registers
//   lanes_in(x, a, b) lanes outside [a, b) set to -inf
//   activate<Silu>(x) silu / sigmoid lanes   silu_lanes(p, n)  silu of n floats in place
//   load_first(p, n) / store_first(p, v, n)  the first n < kLanes elements only (the other
//                   lanes load as 0; nothing past p + n is read or written)
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace pagedhybrid {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

// float8 e4m3fn (bias 7, 3 mantissa bits, no inf, S.1111.111 = NaN) as fp16 bits: the 7 value
// bits shifted into fp16's exponent/mantissa field give the value times 2^-8 exactly, normal and
// subnormal alike (fp16's bias is 15 = 7 + 8; fp16 subnormals are exact under the hardware
// converter), so value = half(bits) * 256. NaN codes are patched to a quiet fp16 NaN.
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }

#if defined(__AVX512F__)

constexpr int kLanes = 16;
using VF = __m512;

inline VF load(const float* p) { return _mm512_loadu_ps(p); }
inline VF load(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline VF load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VF load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VF load(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7),
                              _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), nan);
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF bcast(float x) { return _mm512_set1_ps(x); }
inline VF zero() { return _mm512_setzero_ps(); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF div(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF neg_abs(VF x) { return _mm512_or_ps(x, _mm512_set1_ps(-0.f)); }
inline VF if_neg(VF x, VF a, VF b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
inline VF keep_nan(VF x, VF r) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
}
inline float reduce_add(VF v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(VF v) { return _mm512_reduce_max_ps(v); }
inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
// the first lane of x equal to want (-1: none)
inline int first_equal(VF x, VF want) {
  const unsigned k = _mm512_cmp_ps_mask(x, want, _CMP_EQ_OQ);
  return k ? __builtin_ctz(k) : -1;
}
inline VF first_n(VF x, int n) {
  const __mmask16 keep = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-__builtin_inff()), x);
}
inline VF lanes_in(VF x, int first, int end) {  // lanes outside [first, end) set to -inf
  const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 keep = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(end)) &
                         _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(first));
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-__builtin_inff()), x);
}
inline VF exp(VF x) {
  const VF lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.3f));
  VF n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  VF p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, n));
}
inline void transpose(VF (&m)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(m[i], m[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    m[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    m[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    m[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    m[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(m[i], m[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(m[i], m[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(m[i + 8], m[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(m[i + 8], m[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    m[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    m[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    m[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    m[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

#else  // AVX2 + FMA + F16C

constexpr int kLanes = 8;
using VF = __m256;

inline VF load(const float* p) { return _mm256_loadu_ps(p); }
inline VF load(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline VF load(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VF load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VF load(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
  __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                           _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), nan);
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
inline void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF bcast(float x) { return _mm256_set1_ps(x); }
inline VF zero() { return _mm256_setzero_ps(); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF div(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF neg_abs(VF x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.f)); }
inline VF if_neg(VF x, VF a, VF b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline VF keep_nan(VF x, VF r) { return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
inline int first_equal(VF x, VF want) {
  const unsigned k = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, want, _CMP_EQ_OQ)));
  return k ? __builtin_ctz(k) : -1;
}
inline float reduce_add(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(VF v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline VF first_n(VF x, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
  return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, keep);
}
inline VF lanes_in(VF x, int first, int end) {  // lanes outside [first, end) set to -inf
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(first), idx),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(end), idx));
  return _mm256_blendv_ps(_mm256_set1_ps(-__builtin_inff()), x, _mm256_castsi256_ps(keep));
}
inline VF exp(VF x) {
  const VF lo = _mm256_set1_ps(-87.3f);
  const VF under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
  VF n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  VF p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
inline void transpose(VF (&m)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(m[i], m[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(m[i], m[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    m[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    m[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

#endif

template <typename T>
inline VF load_first(const T* p, int n) {
  alignas(64) float tmp[kLanes] = {};
  for (int i = 0; i < n; ++i) tmp[i] = to_float(p[i]);
  return load(tmp);
}
inline void store_first(float* p, VF v, int n) {
  alignas(64) float tmp[kLanes];
  store(tmp, v);
  for (int i = 0; i < n; ++i) p[i] = tmp[i];
}

// silu (Silu) or sigmoid of every lane, NaN in, NaN out: e = exp(-|x|) (never overflows),
// silu(x) = (x < 0 ? x e : x) / (1 + e), sigmoid(x) = (x < 0 ? e : 1) / (1 + e).
template <bool Silu>
inline VF activate(VF x) {
  const VF e = exp(neg_abs(x));  // (0, 1]
  const VF num = Silu ? if_neg(x, mul(x, e), x) : if_neg(x, e, bcast(1.f));
  return keep_nan(x, div(num, add(bcast(1.f), e)));
}

// silu of the n <= kLanes floats at p, in place (every lane by the same code)
inline void silu_lanes(float* p, int n) {
  if (n == kLanes) {
    store(p, activate<true>(load(p)));
  } else {
    store_first(p, activate<true>(load_first(p, n)), n);
  }
}

}  // namespace pagedhybrid
