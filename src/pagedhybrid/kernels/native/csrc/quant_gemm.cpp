// The int8 / int4 kernels of quant.cpp's ops (the format, the activations' quantisation and
// the arithmetic: quant.cpp's opening comment): the dot products of a weight row's codes by
// rows of quantised activations -- the row layout (dot_rows8, dot_rows4, dot_quads) and the
// groups of 16 rows (group_rows) -- and `product`, one parallel step over the weights of a call.
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "quant.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int64_t kRowsPerTask = 64;  // rows of x per task
constexpr int64_t kColsPerTask = 16;  // weight rows per task
constexpr int kRowBlock = 4;          // rows sharing one weight load
// at one task of rows (decode) a task takes at least kTaskBytes of codes: 16 weight rows of a
// 1024-wide int4 weight are 8 KiB, and claiming 2000 such tasks for a [32000, 1024] LM head
// (the claims' shared counter, short streams) read it at 12-13 GB/s from memory against 18-22
// GB/s with 32 KiB tasks; tg128 of the 141M benchmark model in int4 128 -> 175 tok/s
constexpr int64_t kTaskBytes = 32768;

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The int32 lanes of one sub-block's dot product (weight codes w as loaded, activation codes a).
template <int BITS>
inline __m256i dot32(__m256i w, __m256i a) {
  if constexpr (BITS == 8) {  // signed codes c - 128: |w| times a with w's sign
    a = _mm256_sign_epi8(a, w);
    w = _mm256_abs_epi8(w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

// One sub-block of weight codes as 32 bytes (4-bit: [low | high] nibbles; 8-bit: c - 128).
template <int BITS>
inline __m256i load_codes(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
  } else {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
}

// sum_b scale_b * zero_b * xsum_b over the nb blocks of one weight row and one activation row
// (zero_b as the kernel multiplies it: the stored zero point, minus 128 for 8-bit codes):
// 8 blocks at a time, then the fixed horizontal sum and the tail in order.
template <int BITS>
inline float zero_correction(const c10::Half* scales, const uint8_t* zeros, const float* xsum,
                             int64_t nb) {
  constexpr int kImplied = BITS == 8 ? 0 : 1 << (BITS - 1);  // symmetric, after the - 128
  if (!zeros && kImplied == 0) return 0.0f;
  const __m256 shift = _mm256_set1_ps(BITS == 8 ? 128.0f : 0.0f);
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
    const __m256 xs = _mm256_loadu_ps(xsum + b);
    const __m256 z = zeros ? _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + b)))),
                             shift)
                           : _mm256_set1_ps(static_cast<float>(kImplied));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(ws, z), xs, acc);
  }
  float total = hsum(acc);
  for (; b < nb; ++b) {
    const float z = zeros ? static_cast<float>(zeros[b]) - (BITS == 8 ? 128.0f : 0.0f)
                          : static_cast<float>(kImplied);
    total += _cvtsh_ss(scales[b].x) * z * xsum[b];
  }
  return total;
}

// 8-bit weights, R rows (from `r0`) of the activations against one weight row: out[r * ldo].
// Two fp32 accumulators per row take alternate sub-blocks (two independent FMA chains), summed
// at the end.
template <class PF, int R, typename TO>
inline void dot_rows8(const Rows& x, int64_t r0, const uint8_t* codes, const c10::Half* scales,
                      const uint8_t* zeros, int64_t block, TO* out, int64_t ldo) {
  constexpr int BITS = 8, kBytes = kAct;
  const int64_t subs = block / kAct;
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  const int8_t* q[R];
  const float* d[R];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (r0 + r) * x.width;
    d[r] = x.d + (r0 + r) * x.subs;
  }
  // the sub-blocks in order; ws is the current block's scale (F16C: c10's conversion is bit
  // arithmetic), `left` the sub-blocks left in that block
  int64_t b = 0, left = subs;
  float ws = _cvtsh_ss(scales[0].x);
  const auto step = [&](int64_t s, __m256 (&into)[R]) {
    const __m256i w = load_codes<BITS>(codes + s * kBytes);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + s * kAct));
      into[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<BITS>(w, a)),
                                _mm256_set1_ps(ws * d[r][s]), into[r]);
    }
    if (--left == 0 && ++b < x.blocks) {
      left = subs;
      ws = _cvtsh_ss(scales[b].x);
    }
  };
  const int64_t total = x.subs;
  int64_t s = 0;
  for (; s + 2 <= total; s += 2) {
    PF::at(codes + s * kBytes);  // (two sub-blocks: one line)
    step(s, acc[0]);
    step(s + 1, acc[1]);
  }
  if (s < total) step(s, acc[0]);
  for (int r = 0; r < R; ++r) {
    const float corr = zero_correction<BITS>(scales, zeros, x.xsum + (r0 + r) * x.blocks,
                                             x.blocks);
    out[r * ldo] = from_float<TO>(hsum(_mm256_add_ps(acc[0][r], acc[1][r])) - corr);
  }
}

// One pair of 4-bit sub-blocks (s, s + 1: 32 bytes of codes, unpacking into [evens s | evens
// s+1] and [odds s | odds s+1]) against R rows in the pair layout: into[r] += their int32 dot
// products (lanes 0-3: s, 4-7: s + 1) scaled by ws [scale_s x 4 | scale_s+1 x 4] times the rows'
// [d_s x 4 | d_s+1 x 4] (`dp`, each row's pair scales).
template <int R>
inline void pair4(const uint8_t* codes, int64_t s, __m256 ws, const int8_t* const (&q)[R],
                  const float* const (&dp)[R], __m256 (&into)[R]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + s * 16));
  const __m256i lo = _mm256_and_si256(v, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  for (int r = 0; r < R; ++r) {
    const __m256i* a = reinterpret_cast<const __m256i*>(q[r] + s * kAct);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i dot = _mm256_dpbusd_epi32(
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256(a)), hi,
        _mm256_loadu_si256(a + 1));
#else  // int16 pairs <= 2 * 15 * 127, the two halves' sum <= 7620: no saturation
    const __m256i dot = _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(a)),
                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256(a + 1))),
        _mm256_set1_epi16(1));
#endif
    into[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                              _mm256_mul_ps(ws, _mm256_loadu_ps(dp[r] + 4 * s)), into[r]);
  }
}

// A last, unpaired 4-bit sub-block s ([evens | odds]) with its weight scale ws against R rows
// (from `r0`): into[r] += its int32 dot product scaled by ws * d_s.
template <int R>
inline void single4(const Rows& x, int64_t r0, const uint8_t* codes, int64_t s, float ws,
                    const int8_t* const (&q)[R], __m256 (&into)[R]) {
  const __m256i w = load_codes<4>(codes + s * 16);
  for (int r = 0; r < R; ++r) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + s * kAct));
    const float ds = x.d[(r0 + r) * x.subs + s];
    into[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<4>(w, a)), _mm256_set1_ps(ws * ds),
                              into[r]);
  }
}

#if defined(__AVX512BW__)
// 4-bit weights in blocks of 32 on AVX-512, R rows (from `r0`) against one weight row: 64 bytes
// of codes (a quad of sub-blocks, one scale each) unpack into [evens s .. s + 3] and
// [odds s .. s + 3], the quad layout quantize_row stored the activations in; int32 lanes
// 4j .. 4j + 3 hold sub-block s + j's dot product, scaled by [scale_s+j d_s+j x 4]. Sixteen
// scales are converted at a time; even quads go to one accumulator, odd ones to the other. The
// zero points' correction (zero_correction) is accumulated in the same loop, from the scales it
// has loaded: sum_b scale_b * zero_b * xsum_b, 16 blocks to a lane set. What is left past the
// whole quads -- a pair, a last sub-block -- and the blocks past the 16-block groups take the
// 256-bit steps and the scalar sum, in a fixed order: a row's bits do not depend on R.
// Against dot_rows4's 256-bit pairs: half the instructions per code byte (decode products
// compute-bound at ~22 GB/s of codes per core from L2).
template <class PF, int R, typename TO>
inline void dot_quads(const Rows& x, int64_t r0, const uint8_t* codes, const c10::Half* scales,
                      const uint8_t* zeros, TO* out, int64_t ldo) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512 implied = _mm512_set1_ps(8.0f);
  __m512 acc[2][R], corr[R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = corr[r] = _mm512_setzero_ps();
  const int8_t* q[R];
  const float* dp[R];
  const float* xs[R];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (r0 + r) * x.width;
    dp[r] = x.pairs + (r0 + r) * (x.subs / 2) * 8;
    xs[r] = x.xsum + (r0 + r) * x.blocks;
  }
  const auto quad = [&](int64_t g, __m512 ws, __m512 (&into)[R]) {
    const __m512i v = _mm512_loadu_si512(codes + g * 64);
    const __m512i lo = _mm512_and_si512(v, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    for (int r = 0; r < R; ++r) {
      const int8_t* a = q[r] + g * 128;
#if defined(__AVX512VNNI__)
      const __m512i dot = _mm512_dpbusd_epi32(
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a)), hi,
          _mm512_loadu_si512(a + 64));
#else  // int16 pairs <= 2 * 15 * 127, the two halves' sum <= 7620: no saturation
      const __m512i dot = _mm512_madd_epi16(
          _mm512_add_epi16(_mm512_maddubs_epi16(lo, _mm512_loadu_si512(a)),
                           _mm512_maddubs_epi16(hi, _mm512_loadu_si512(a + 64))),
          _mm512_set1_epi16(1));
#endif
      into[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                _mm512_mul_ps(ws, _mm512_loadu_ps(dp[r] + 16 * g)), into[r]);
    }
  };
  const auto spread = [](int j) {  // lanes 4i .. 4i + 3 <- scale 4j + i
    return _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                             4 * j + 1, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 3,
                             4 * j + 3, 4 * j + 3, 4 * j + 3);
  };
  const int64_t quads = x.subs / 4;
  int64_t g = 0;
  for (; g + 4 <= quads; g += 4) {  // 16 sub-blocks: 16 blocks, 256 bytes of codes
    for (int l = 0; l < 4; ++l) PF::at(codes + g * 64 + 64 * l);
    const __m512 w16 = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 4 * g)));
    const __m512 wz = zeros ? _mm512_mul_ps(w16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + 4 * g)))))
                            : _mm512_mul_ps(w16, implied);
    for (int r = 0; r < R; ++r) corr[r] = _mm512_fmadd_ps(wz, _mm512_loadu_ps(xs[r] + 4 * g),
                                                          corr[r]);
    for (int j = 0; j < 4; ++j)
      quad(g + j, _mm512_permutexvar_ps(spread(j), w16), acc[j & 1]);
  }
  const int64_t grouped = 4 * g;  // blocks whose correction is in corr
  for (; g < quads; ++g) {  // quads past the groups: their four scales
    PF::at(codes + g * 64);
    int64_t four;
    std::memcpy(&four, scales + 4 * g, 8);
    const __m512 w4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(four)));
    quad(g, _mm512_permutexvar_ps(spread(0), w4), acc[g & 1]);
  }
  // a pair and a last sub-block past the quads, in the pair layout (dot_rows4's steps)
  __m256 rest[R];
  for (int r = 0; r < R; ++r) rest[r] = _mm256_setzero_ps();
  const int64_t s = 4 * quads;
  if (s + 1 < x.subs)
    pair4<R>(codes, s, _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(scales[s + 1].x)),
                                       _mm_set1_ps(_cvtsh_ss(scales[s].x))), q, dp, rest);
  if (x.subs % 2) single4<R>(x, r0, codes, x.subs - 1, _cvtsh_ss(scales[x.subs - 1].x), q, rest);
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_add_ps(acc[0][r], acc[1][r]);
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(corr[r]),
                                    _mm512_extractf32x8_ps(corr[r], 1));
    float c = hsum(c8);
    for (int64_t b = grouped; b < x.blocks; ++b)
      c += _cvtsh_ss(scales[b].x) * (zeros ? static_cast<float>(zeros[b]) : 8.0f) * xs[r][b];
    out[r * ldo] = from_float<TO>(hsum(_mm256_add_ps(a8, rest[r])) - c);
  }
}
#endif

// 4-bit weights, R rows (from `r0`) against one weight row: 32 bytes of codes (two sub-blocks)
// unpack into [low nibbles | high nibbles] = [evens s | evens s+1] and [odds s | odds s+1], the
// pair layout quantize_row stored the activations in; int32 lanes 0-3 hold sub-block s's dot
// product, 4-7 s + 1's, scaled by [scale_s d_s x 4 | scale_s+1 d_s+1 x 4]. Even pairs go to one
// accumulator, odd ones to the other (two FMA chains), a last unpaired sub-block to the first.
template <class PF, int R, typename TO>
inline void dot_rows4(const Rows& x, int64_t r0, const uint8_t* codes, const c10::Half* scales,
                      const uint8_t* zeros, int64_t block, TO* out, int64_t ldo) {
  const int64_t subs = block / kAct;  // sub-blocks per weight block
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  const int8_t* q[R];
  const float* dp[R];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (r0 + r) * x.width;
    dp[r] = x.pairs + (r0 + r) * (x.subs / 2) * 8;
  }
  // pair i's scales as [scale_s x 4 | scale_s+1 x 4] (`ws`), its codes against R rows
  const auto pair = [&](int64_t i, __m256 ws, __m256 (&into)[R]) {
    pair4<R>(codes, 2 * i, ws, q, dp, into);
  };
  const int64_t npairs = x.subs / 2;
  int64_t i = 0;
  if (subs == 1) {  // block 32: a pair spans two blocks; 8 scales converted at a time
    for (; i + 4 <= npairs; i += 4) {
      PF::at(codes + 2 * i * 16);  // (four pairs: two lines)
      PF::at(codes + 2 * i * 16 + 64);
      const __m256 w8 = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 2 * i)));
      for (int j = 0; j < 4; ++j)
        pair(i + j, _mm256_permutevar8x32_ps(w8, _mm256_add_epi32(spread, _mm256_set1_epi32(2 * j))),
             acc[j & 1]);
    }
    for (; i < npairs; ++i) {  // (i is even here: the tail starts at a multiple of 4)
      int32_t two;
      std::memcpy(&two, scales + 2 * i, 4);
      const __m256 ws = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two))), spread);
      if (i & 1) {
        pair(i, ws, acc[1]);
      } else {
        pair(i, ws, acc[0]);
      }
    }
  } else {  // a block's sub-blocks come in pairs: one scale per pair (the block's)
    const int shift = x.blocks == 1 ? 0 : __builtin_ctzll(static_cast<uint64_t>(subs));
    const auto ws = [&](int64_t k) {
      return _mm256_set1_ps(_cvtsh_ss(scales[x.blocks == 1 ? 0 : (2 * k) >> shift].x));
    };
    for (; i + 2 <= npairs; i += 2) {
      PF::at(codes + 2 * i * 16);  // (two pairs: one line)
      pair(i, ws(i), acc[0]);
      pair(i + 1, ws(i + 1), acc[1]);
    }
    if (i < npairs) pair(i, ws(i), acc[0]);
  }
  if (x.subs % 2)  // the last sub-block alone, with the last block's scale
    single4<R>(x, r0, codes, x.subs - 1, _cvtsh_ss(scales[x.blocks - 1].x), q, acc[0]);
  for (int r = 0; r < R; ++r) {
    const float corr = zero_correction<4>(scales, zeros, x.xsum + (r0 + r) * x.blocks,
                                          x.blocks);
    out[r * ldo] = from_float<TO>(hsum(_mm256_add_ps(acc[0][r], acc[1][r])) - corr);
  }
}

// R rows against one weight row in the form for BITS.
template <class PF, int BITS, int R, typename TO>
inline void rows_dot(const Rows& x, int64_t r0, const uint8_t* codes, const c10::Half* scales,
                     const uint8_t* zeros, int64_t block, TO* out, int64_t ldo) {
  if constexpr (BITS == 4) {
#if defined(__AVX512BW__)
    if (block == kAct) return dot_quads<PF, R>(x, r0, codes, scales, zeros, out, ldo);
#endif
    dot_rows4<PF, R>(x, r0, codes, scales, zeros, block, out, ldo);
  } else {
    dot_rows8<PF, R>(x, r0, codes, scales, zeros, block, out, ldo);
  }
}

// Weights in the engine's groups of kGroup = 16 rows (weightquant.group_rows; N a multiple of
// 16): codes [N / 16, nb, L, 64], each 64-byte line the group's 16 rows' four bytes (row i at
// bytes 4i ..) -- 8-bit: line j of a block its elements 4j .. 4j + 3 (L = block / 4); 4-bit:
// line j its elements 8j .. 8j + 7, byte t element 8j + t in the low nibble and 8j + 4 + t in
// the high one (L = block / 8) -- and scales / zeros [N / 16, nb, 16]. A sub-block of one row of
// x (the activation codes in their natural order) against a group: each of the row's activation
// quads broadcast against 16 rows' four codes -- with AVX512-VNNI by vpdpbusd, the codes as
// unsigned, 16 rows to a register; without, 8 rows to a register by vpmaddubsw (8-bit codes as
// signed c - 128 by the activation codes with their sign: pairs <= 2 * 128 * 127; 4-bit codes
// unsigned: pairs <= 2 * 15 * 127) -- started from the zero point's part, -z * sum(q) (-(z - 128)
// * sum(q) for the signed 8-bit codes): the exact int32 sum of (c - z) * q per row. Then
// f[s & 1] += float(D_s) * (scale_b * d_s) (two FMA chains) and out = f0 + f1, rounded once:
// each element is computed the same way on every form, whatever M is and wherever its row sits.
// Against the row layout's per-row sub-blocks (several integer ops, a conversion and an FMA per
// 32 bytes of codes and row of x): a load and one vpdpbusd per 64 bytes of 8-bit codes (two and
// an unpacking for 4-bit ones), a conversion and an FMA per sub-block of 16 rows. The 141M
// benchmark model's int8 decode products, codes in huge pages: 16.8 -> 25 GB/s on the 2-core
// Xeon (AMX, AVX512-BF16), where the row form was bound by its instructions.
// at one task of rows (decode) a task takes this many bytes of codes in whole groups (16 rows of
// a 1024-wide int8 weight are 16 KiB): 4 -> 16 groups of the benchmark model 22.9 -> 25.0 GB/s
constexpr int64_t kGroupTaskBytes = 131072;

template <class PF, int BITS, int R, typename TO>
inline void group_rows(const Rows& x, int64_t r0, const uint8_t* codes, const c10::Half* scales,
                       const uint8_t* zeros, int64_t block, TO* out, int64_t ldo) {
  constexpr int kLines = BITS == 8 ? 8 : 4;  // 64-byte lines of codes per sub-block
  constexpr int32_t kZero = 1 << (BITS - 1);  // a symmetric format's zero point
  const int64_t spb = block / kAct;           // sub-blocks per block
  const int32_t* a[R];                        // each row's codes, four to an int32
  const float* d[R];
  const int32_t* is[R];
  for (int r = 0; r < R; ++r) {
    a[r] = reinterpret_cast<const int32_t*>(x.natural + (r0 + r) * x.width);
    d[r] = x.d + (r0 + r) * x.subs;
    is[r] = x.isum + (r0 + r) * x.subs;
  }
  float res[R][kGroup];
#if defined(__AVX512VNNI__)
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 f[2][R], sc = _mm512_setzero_ps();
  __m512i z = _mm512_set1_epi32(kZero);
  for (int r = 0; r < R; ++r) f[0][r] = f[1][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < x.subs; ++s) {
    if (s % spb == 0) {  // a new block: its 16 rows' scales and zero points
      const int64_t b = s / spb;
      sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 16 * b)));
      if (zeros)
        z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + 16 * b)));
    }
    const uint8_t* w = codes + s * kLines * 64;
    __m512i acc[2][R];
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_mullo_epi32(z, _mm512_set1_epi32(-is[r][s]));
      acc[1][r] = _mm512_setzero_si512();
    }
    for (int j = 0; j < kLines; ++j) {
      PF::at(w + 64 * j);
      const __m512i v = _mm512_loadu_si512(w + 64 * j);
      if constexpr (BITS == 8) {
        for (int r = 0; r < R; ++r)
          acc[j & 1][r] = _mm512_dpbusd_epi32(acc[j & 1][r], v, _mm512_set1_epi32(a[r][8 * s + j]));
      } else {
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], lo, _mm512_set1_epi32(a[r][8 * s + 2 * j]));
          acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], hi,
                                          _mm512_set1_epi32(a[r][8 * s + 2 * j + 1]));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      f[s & 1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][r], acc[1][r])),
                                    _mm512_mul_ps(sc, _mm512_set1_ps(d[r][s])), f[s & 1][r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(res[r], _mm512_add_ps(f[0][r], f[1][r]));
#else
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t h = 0; h < kGroup; h += 8) {  // 8 rows of the group at a time
    __m256 f[2][R], sc = _mm256_setzero_ps();
    __m256i z = _mm256_set1_epi32(kZero);
    for (int r = 0; r < R; ++r) f[0][r] = f[1][r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < x.subs; ++s) {
      if (s % spb == 0) {
        const int64_t b = s / spb;
        sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * b + h)));
        if (zeros)
          z = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + 16 * b + h)));
      }
      // (8-bit codes enter signed, c - 128: their zero point's part is -(z - 128) * sum(q))
      const __m256i zs = BITS == 8 ? _mm256_sub_epi32(z, _mm256_set1_epi32(128)) : z;
      const uint8_t* w = codes + s * kLines * 64 + 4 * h;
      __m256i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_mullo_epi32(zs, _mm256_set1_epi32(-is[r][s]));
      for (int j = 0; j < kLines; ++j) {
        PF::at(w + 64 * j);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j));
        if constexpr (BITS == 8) {
          const __m256i c = _mm256_xor_si256(v, flip), mag = _mm256_abs_epi8(c);
          for (int r = 0; r < R; ++r) {
            const __m256i q = _mm256_sign_epi8(_mm256_set1_epi32(a[r][8 * s + j]), c);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, q), ones));
          }
        } else {
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a[r][8 * s + 2 * j])),
                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a[r][8 * s + 2 * j + 1])));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        f[s & 1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                                      _mm256_mul_ps(sc, _mm256_set1_ps(d[r][s])), f[s & 1][r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(res[r] + h, _mm256_add_ps(f[0][r], f[1][r]));
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kGroup; ++i) out[r * ldo + i] = from_float<TO>(res[r][i]);
}

// R rows of x from r0 against the groups of rows [c0, c1) of a grouped weight w.
template <class PF, int BITS, int R, typename TO>
inline void groups(const Rows& x, int64_t r0, const Weight& w, int64_t block, int64_t c0,
                   int64_t c1) {
  TO* out = static_cast<TO*>(w.out) + r0 * w.n;
  for (int64_t c = c0; c < c1; c += kGroup)
    group_rows<PF, BITS, R>(x, r0, w.codes + c * (x.width * BITS / 8), w.scales + c * x.blocks,
                            w.zeros ? w.zeros + c * x.blocks : nullptr, block, out + c, w.n);
}

}  // namespace

// out_j = x . w_j^T for every weight j (all with the activations' layout): one parallel step,
// tasks of up to kRowsPerTask rows x kColsPerTask rows of one weight (a grouped weight: whole
// groups, kGroupTaskBytes of codes at one task of rows).
template <class PF, int BITS, typename TO>
void product(const Rows& x, int64_t m, const std::vector<Weight>& ws, int64_t block) {
  const int64_t row_bytes = x.width * BITS / 8;
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t cols = row_tasks > 1 ? kColsPerTask  // a task's weight rows
                                     : std::max<int64_t>(kColsPerTask, kTaskBytes / row_bytes);
  const int64_t group_cols = kGroup * (row_tasks > 1 ? 1 : std::max<int64_t>(
                                           1, kGroupTaskBytes / (kGroup * row_bytes)));
  std::vector<int64_t> first(ws.size() + 1, 0);  // each weight's first task
  int64_t total_n = 0;
  for (size_t j = 0; j < ws.size(); ++j) {
    const int64_t unit = ws[j].grouped ? group_cols : cols;
    first[j + 1] = first[j] + row_tasks * ((ws[j].n + unit - 1) / unit);
    total_n += ws[j].n;
  }
  parallel_items(first.back(), 1, m * total_n * x.width, [&](int64_t item) {
    const size_t j = std::upper_bound(first.begin(), first.end(), item) - first.begin() - 1;
    const Weight& w = ws[j];
    const int64_t task = item - first[j], n = w.n, unit = w.grouped ? group_cols : cols;
    const int64_t c0 = (task / row_tasks) * unit, r0 = (task % row_tasks) * kRowsPerTask;
    const int64_t c1 = std::min(n, c0 + unit), r1 = std::min(m, r0 + kRowsPerTask);
    if (w.grouped) {
      int64_t r = r0;
      for (; r + kRowBlock <= r1; r += kRowBlock)
        groups<PF, BITS, kRowBlock, TO>(x, r, w, block, c0, c1);
      switch (r1 - r) {
        case 3: groups<PF, BITS, 3, TO>(x, r, w, block, c0, c1); break;
        case 2: groups<PF, BITS, 2, TO>(x, r, w, block, c0, c1); break;
        case 1: groups<PF, BITS, 1, TO>(x, r, w, block, c0, c1); break;
        default: break;
      }
      return;
    }
    TO* out = static_cast<TO*>(w.out);
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t* wc = w.codes + c * row_bytes;
      const c10::Half* sc = w.scales + c * x.blocks;
      const uint8_t* zc = w.zeros ? w.zeros + c * x.blocks : nullptr;
      int64_t r = r0;
      for (; r + kRowBlock <= r1; r += kRowBlock)
        rows_dot<PF, BITS, kRowBlock>(x, r, wc, sc, zc, block, out + r * n + c, n);
      switch (r1 - r) {
        case 3: rows_dot<PF, BITS, 3>(x, r, wc, sc, zc, block, out + r * n + c, n); break;
        case 2: rows_dot<PF, BITS, 2>(x, r, wc, sc, zc, block, out + r * n + c, n); break;
        case 1: rows_dot<PF, BITS, 1>(x, r, wc, sc, zc, block, out + r * n + c, n); break;
        default: break;
      }
    }
  });
}

// product's forms (quant.h)
#define PH_PRODUCT(PF, BITS)                                                                    \
  template void product<PF, BITS, float>(const Rows&, int64_t, const std::vector<Weight>&,      \
                                         int64_t);                                              \
  template void product<PF, BITS, c10::BFloat16>(const Rows&, int64_t,                          \
                                                 const std::vector<Weight>&, int64_t);          \
  template void product<PF, BITS, c10::Half>(const Rows&, int64_t, const std::vector<Weight>&,  \
                                             int64_t);
PH_PRODUCT(NtaAhead, 4)
PH_PRODUCT(NtaAhead, 8)
PH_PRODUCT(T0Ahead, 4)
PH_PRODUCT(T0Ahead, 8)
#undef PH_PRODUCT

}  // namespace pagedhybrid
