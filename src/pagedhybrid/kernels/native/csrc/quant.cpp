// Products of int8 / int4 projection weights: out [M, N] = x [M, K] . dequant(w)^T.
//
// Weights (checked here) are weightquant.py's QuantizedWeight, com.microsoft.MatMulNBits' layout:
// codes uint8 [N, nb, block * bits / 8] (K zero-padded to nb * block; 4-bit codes two to a byte,
// element 2j in the low nibble), scales float16 [N, nb], zeros uint8 [N, nb] or none (symmetric:
// 2^(bits-1)); value = (code - zero) * scale. They are read in place: no dequantised copy.
//
// Activations are quantised per row on the fly into int8 codes with one float scale per
// kAct = 32 elements (llama.cpp's q8 path): d = max|x| / 127, q = round(x * (1 / d)) (ties to
// even, 0 where d = 0) -- weightquant.quantize_rows, bit for bit. A 4-bit weight's 32 elements of
// a sub-block arrive as [low nibbles | high nibbles] = [even | odd] elements, so each activation
// sub-block is stored in that order too (once per row, not once per weight row). Per sub-block
// the integer dot product is exact: 4-bit codes (unsigned, 0..15) times the activation codes by
// vpmaddubsw (pairs <= 2 * 15 * 127, no int16 saturation); 8-bit codes as signed c - 128 with the
// sign moved onto the activation (|c - 128| <= 128, pairs <= 2 * 128 * 127 < 32767); then pairs
// summed into int32 lanes (vpmaddwd) -- or, where the CPU has AVX512-VNNI (vpdpbusd), in one
// instruction with the same integer result. Each sub-block's int32 lanes are scaled by
// d * scale in fp32 and accumulated in two sets of 8 fp32 lanes (alternate sub-blocks: two
// independent FMA chains); the zero points enter as one more pass over the row's blocks,
// sum_b zero_b * scale_b * sum_sub(d * sum(q)) (the activation sums are taken while quantising).
// Out is the fixed horizontal sum minus that correction, rounded once to x's dtype.
//
// Every output element is computed the same way whatever M is and wherever its row sits (rows are
// register-blocked up to 4 to share the weight loads, nothing else), so the one kernel is also
// the batch-invariant form. Work: tasks of up to kRowsPerTask rows x kColsPerTask weight rows
// (the weight rows stay in L1 while the rows stream past them).
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int kAct = 32;              // activation sub-block (elements per activation scale)
constexpr int64_t kRowsPerTask = 64;  // rows of x per task
constexpr int64_t kColsPerTask = 16;  // weight rows per task
constexpr int kRowBlock = 4;          // rows sharing one weight load
// Weight codes are prefetched ahead of the loads, with a hint chosen by the CPU's vendor at load
// (code_prefetch(); one instantiation of the kernels per policy, chosen once per call):
// * AMD (`NtaAhead`): 2 KiB ahead, non-temporally. The rows of a task are contiguous, so this
//   runs into the next rows, which the hardware prefetcher (a new stream every 512-byte row of a
//   1024-wide int4 weight) fetches late; kept out of the outer caches, they also leave the step's
//   other data there. On the 2-core EPYC: int4 decode products (an LM head and a layer's
//   projections, M = 1, interleaved with and without) 1346 -> 1123 us (-17%), int8 -10%, int4
//   block 128 -21%, a torch op after them ~12% faster; a T0 prefetch as fast but that op slower.
// * Intel and the rest (`T0Ahead`): 4 KiB ahead into L1. An NTA prefetch there fills L1 alone
//   and the line is gone before its load: the int4 block-32 loop read 32 MiB of codes in huge
//   pages at 5.0 GB/s with it against 22.6 with no prefetch and 23.8 with T0 4 KiB ahead (one
//   thread, a 2-core Xeon with AVX512-BF16 / AMX, alternating; T1 / T2 at 2-8 KiB 22.9-23.9).
struct NtaAhead {
  static constexpr const char* kName = "NTA 2 KiB ahead";
  static void at(const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 2048), _MM_HINT_NTA);
  }
};
struct T0Ahead {
  static constexpr const char* kName = "T0 4 KiB ahead";
  static void at(const uint8_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p + 4096), _MM_HINT_T0);
  }
};
bool amd_cpu() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}
// at one task of rows (decode) a task takes at least kTaskBytes of codes: 16 weight rows of a
// 1024-wide int4 weight are 8 KiB, and claiming 2000 such tasks for a [32000, 1024] LM head
// (the claims' shared counter, short streams) read it at 12-13 GB/s from memory against 18-22
// GB/s with 32 KiB tasks; tg128 of the 141M benchmark model in int4 128 -> 175 tok/s
constexpr int64_t kTaskBytes = 32768;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

// One row of x: k elements (zero-padded to width, a multiple of the weight block) into codes q
// [width] and scales d [width / kAct]; isum [width / kAct] = sum(q) per sub-block, xsum
// [width / block] = per weight block sum over its sub-blocks of d * sum(q). With `odd_even` (4-bit weights) each pair of
// sub-blocks (s, s + 1) is stored as [evens of s | evens of s + 1 | odds of s | odds of s + 1]
// -- the order in which 32 bytes of 4-bit codes unpack into low and high nibbles -- with
// pairs[8 i ..] = [d_s x 4 | d_s+1 x 4]; a last unpaired sub-block as [evens | odds].
template <typename TX>
void quantize_row(const TX* x, int64_t k, int64_t width, int64_t block, bool odd_even,
                  float* pairs, int8_t* q, float* d, float* xsum, int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // per 128-bit lane: bytes 0, 2, ..., 14 then 1, 3, ..., 15
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  float buf[kAct];
  const int64_t subs_per_block = block / kAct;
  float block_sum = 0.0f;
  for (int64_t s = 0; s * kAct < width; ++s) {
    const int64_t e0 = s * kAct;
    __m256 v[4];
    if (e0 + kAct <= k) {
      for (int i = 0; i < 4; ++i) v[i] = load8(x + e0 + 8 * i);
    } else {
      for (int i = 0; i < kAct; ++i) buf[i] = e0 + i < k ? to_float(x[e0 + i]) : 0.0f;
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(buf + 8 * i);
    }
    __m256 amax = _mm256_andnot_ps(sign, v[0]);
    for (int i = 1; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float dv = _mm_cvtss_f32(m4) / 127.0f;
    const float inv = dv != 0.0f ? 1.0f / dv : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));  // nearest-even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                           _mm256_add_epi32(i[2], i[3]));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                        _mm256_packs_epi32(i[2], i[3]));
    packed = _mm256_permutevar8x32_epi32(packed, order);  // elements back in order
    if (odd_even) {
      packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(packed, split),
                                        _MM_SHUFFLE(3, 1, 2, 0));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e0), packed);
    d[s] = dv;
    isum[s] = hsum(total);
    block_sum += dv * static_cast<float>(isum[s]);
    if ((s + 1) % subs_per_block == 0) {
      xsum[s / subs_per_block] = block_sum;
      block_sum = 0.0f;
    }
  }
  if (!odd_even) return;
  for (int64_t i = 0; 2 * i + 1 < width / kAct; ++i) {
    __m256i* p = reinterpret_cast<__m256i*>(q + 2 * i * kAct);
    const __m256i s0 = _mm256_loadu_si256(p), s1 = _mm256_loadu_si256(p + 1);
    _mm256_storeu_si256(p, _mm256_permute2x128_si256(s0, s1, 0x20));
    _mm256_storeu_si256(p + 1, _mm256_permute2x128_si256(s0, s1, 0x31));
    _mm256_storeu_ps(pairs + 8 * i, _mm256_set_m128(_mm_set1_ps(d[2 * i + 1]),
                                                    _mm_set1_ps(d[2 * i])));
  }
#if defined(__AVX512BW__)
  if (block != kAct) return;
  // block 32 on AVX-512 (dot_quads): each quad of sub-blocks (two pairs) as
  // [evens s .. s + 3 | odds s .. s + 3], what 64 bytes of codes unpack into
  for (int64_t g = 0; 4 * g + 3 < width / kAct; ++g) {
    int8_t* p = q + 4 * g * kAct;
    const __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
    _mm512_storeu_si512(p, _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_storeu_si512(p + 64, _mm512_shuffle_i64x2(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
#endif
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

struct Rows {  // the quantised activations
  const int8_t* q;
  const int8_t* natural;  // the codes in their natural order (4-bit weights: q is reordered)
  const float* d;
  const float* xsum;
  const int32_t* isum;  // [subs] per row: sum(q) of each sub-block
  const float* pairs;  // 4-bit weights: [d_s x 4 | d_s+1 x 4] per pair of sub-blocks
  int64_t width, subs, blocks;  // per row: codes, sub-block scales, block sums
};

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
constexpr int64_t kGroup = 16;
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

struct Weight {  // one weight's rows, and where its products go
  const uint8_t* codes;
  const c10::Half* scales;
  const uint8_t* zeros;
  int64_t n;
  void* out;  // [M, n] in x's dtype
  bool grouped;  // in groups of kGroup rows (group_rows)
};

// R rows of x from r0 against the groups of rows [c0, c1) of a grouped weight w.
template <class PF, int BITS, int R, typename TO>
inline void groups(const Rows& x, int64_t r0, const Weight& w, int64_t block, int64_t c0,
                   int64_t c1) {
  TO* out = static_cast<TO*>(w.out) + r0 * w.n;
  for (int64_t c = c0; c < c1; c += kGroup)
    group_rows<PF, BITS, R>(x, r0, w.codes + c * (x.width * BITS / 8), w.scales + c * x.blocks,
                            w.zeros ? w.zeros + c * x.blocks : nullptr, block, out + c, w.n);
}

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

// A weight's codes: the row layout [N, nb, block * bits / 8], or in groups of kGroup rows
// [N / 16, nb, L, 64] (group_rows).
struct CodeLayout {
  int64_t n, nb, block;
  bool grouped;
};
CodeLayout code_layout(const at::Tensor& codes, int64_t bits) {
  if (codes.dim() == 4)
    return {codes.size(0) * kGroup, codes.size(1), codes.size(2) * 32 / bits, true};
  return {codes.size(0), codes.size(1), codes.size(2) * 8 / bits, false};
}

// scales (and zeros) of codes of `lay`: grouped [N / 16, nb, 16], each group's rows last; else
// [N, nb]
void check_scales(const char* op, const std::string& name, const CodeLayout& lay,
                  const at::Tensor& scales, const c10::optional<at::Tensor>& zeros) {
  const auto check_rows = [&](const std::string& arg, const at::Tensor& t, at::ScalarType dt) {
    check_tensor(op, arg.c_str(), t, lay.grouped ? 3 : 2, dt);
    check_size(op, arg.c_str(), t, 0, lay.grouped ? lay.n / kGroup : lay.n,
               lay.grouped ? "the groups of codes" : "the rows N of codes");
    check_size(op, arg.c_str(), t, 1, lay.nb, "the blocks of codes");
    if (lay.grouped) check_size(op, arg.c_str(), t, 2, kGroup, "the rows of a group");
  };
  check_rows(name + "scales", scales, at::kHalf);
  if (zeros.has_value() && zeros->defined()) check_rows(name + "zeros", *zeros, at::kByte);
}

}  // namespace

int64_t quant_weight_rows(const at::Tensor& codes) {
  return codes.dim() == 4 ? codes.size(0) * kGroup : codes.size(0);
}

void check_quant_weight(const char* op, const std::string& name, const at::Tensor& codes,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        int64_t bits, int64_t k) {
  const std::string c = name + "codes";
  PH_CHECK(bits == 4 || bits == 8, op, name + "bits", "must be 4 or 8 (got ", bits, ")");
  PH_CHECK(codes.defined(), op, c, "must be a tensor");
  const bool grouped = codes.dim() == 4;  // in groups of kGroup rows
  check_tensor(op, c.c_str(), codes, grouped ? 4 : 3, at::kByte);
  const CodeLayout lay = code_layout(codes, bits);
  const int64_t nb = lay.nb, block = lay.block;
  if (grouped) {
    PH_CHECK(codes.size(3) == 4 * kGroup && codes.size(2) * 32 % bits == 0 && block >= kAct &&
                 block % kAct == 0, op, c, "grouped codes must be [N / ", kGroup,
             ", blocks, block * bits / 32, ", 4 * kGroup, "] with the block a multiple of ", kAct,
             " (got shape ", shape_of(codes), ", bits ", bits, ")");
  } else {
    PH_CHECK(block >= kAct && block % kAct == 0 && codes.size(2) * 8 % bits == 0, op, c,
             "size(2) * 8 / bits (the block) must be a multiple of ", kAct, " (got shape ",
             shape_of(codes), ", bits ", bits, ")");
  }
  PH_CHECK(nb >= 1 && k <= nb * block && k > (nb - 1) * block, op, c, "must hold K = ", k,
           " columns in size(1) blocks of ", block, " (got shape ", shape_of(codes), ")");
  check_scales(op, name, lay, scales, zeros);
}

void quant_linear_many(const at::Tensor& x, int64_t bits, const std::vector<QuantWeightRef>& ws,
                       const std::vector<at::Tensor>& outs) {
  const char* op = "quant_linear";
  PH_CHECK(x.defined() && x.dim() == 2, op, "x", "must be [M, K] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto xt = x.scalar_type();
  PH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, "x",
           "must be float32, bfloat16 or float16 (got ", xt, ")");
  check_tensor(op, "x", x, 2, xt);
  PH_CHECK(!ws.empty() && ws.size() == outs.size(), op, "out", "one per weight");
  for (size_t j = 0; j < ws.size(); ++j) {
    check_quant_weight(op, "", ws[j].codes, ws[j].scales, ws[j].zeros, bits, x.size(1));
    const CodeLayout lj = code_layout(ws[j].codes, bits), l0 = code_layout(ws[0].codes, bits);
    PH_CHECK(lj.nb == l0.nb && lj.block == l0.block, op, "codes",
             "the weights of one call must share their blocks (got ", shape_of(ws[j].codes),
             " and ", shape_of(ws[0].codes), ")");
    check_tensor(op, "out", outs[j], 2, xt);
    check_size(op, "out", outs[j], 0, x.size(0), "the rows M of x");
    check_size(op, "out", outs[j], 1, quant_weight_rows(ws[j].codes), "the rows N of codes");
  }
  const CodeLayout lay = code_layout(ws[0].codes, bits);
  const int64_t m = x.size(0), k = x.size(1), nb = lay.nb, block = lay.block, width = nb * block;
  if (m == 0) return;
  bool grouped = false, rowwise = false;
  for (const auto& w : ws) (w.codes.dim() == 4 ? grouped : rowwise) = true;
  // 4-bit weights in rows take the codes reordered (quantize_row), grouped ones in order
  const bool both = bits == 4 && grouped && rowwise;
  std::vector<int8_t> q(m * width), natural(both ? m * width : 0);
  std::vector<float> d(m * (width / kAct)), xsum(m * nb);
  std::vector<int32_t> isum(m * (width / kAct));
  std::vector<float> pairs(bits == 4 ? m * (width / kAct / 2) * 8 : 0);
  std::vector<Weight> weights;
  for (size_t j = 0; j < ws.size(); ++j) {
    const auto& z = ws[j].zeros;
    weights.push_back({ws[j].codes.data_ptr<uint8_t>(), ws[j].scales.data_ptr<c10::Half>(),
                       z.has_value() && z->defined() ? z->data_ptr<uint8_t>() : nullptr,
                       quant_weight_rows(ws[j].codes), outs[j].data_ptr(),
                       ws[j].codes.dim() == 4});
  }
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    parallel_items(m, 8, m * width * 8, [&](int64_t r) {  // (4-bit in rows: reordered)
      quantize_row(xp + r * k, k, width, block, bits == 4 && rowwise,
                   pairs.data() + r * (width / kAct / 2) * 8, q.data() + r * width,
                   d.data() + r * (width / kAct), xsum.data() + r * nb,
                   isum.data() + r * (width / kAct));
    });
    if (both) {  // the grouped weights' codes in order
      parallel_items(m, 8, m * width * 8, [&](int64_t r) {
        quantize_row(xp + r * k, k, width, block, false, nullptr, natural.data() + r * width,
                     d.data() + r * (width / kAct), xsum.data() + r * nb,
                     isum.data() + r * (width / kAct));
      });
    }
    const Rows rows{q.data(), both ? natural.data() : q.data(), d.data(), xsum.data(),
                    isum.data(), pairs.data(), width, width / kAct, nb};
    const auto with = [&](auto policy) {
      using PF = decltype(policy);
      if (bits == 4) {
        product<PF, 4, scalar_t>(rows, m, weights, block);
      } else {
        product<PF, 8, scalar_t>(rows, m, weights, block);
      }
    };
    if (amd_cpu()) {
      with(NtaAhead{});
    } else {
      with(T0Ahead{});
    }
  };
  if (xt == at::kFloat) {
    run(float{});
  } else if (xt == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(c10::Half{});
  }
}

void quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t bits, at::Tensor out) {
  quant_linear_many(x, bits, {QuantWeightRef{codes, scales, zeros}}, {out});
}

namespace {

// Rows [row0, row0 + R) of the weight as float32 (code - zero) * scale into out [R, K]: the
// prefill form multiplies a cache-sized chunk of them with the fp32 GEMM (kernels/native/quant.py).
void quant_dequantize(const at::Tensor& codes, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t row0,
                      at::Tensor out) {
  const char* op = "quant_dequantize";
  PH_CHECK(bits == 4 || bits == 8, op, "bits", "must be 4 or 8 (got ", bits, ")");
  check_tensor(op, "out", out, 2, at::kFloat);
  const bool grouped = codes.defined() && codes.dim() == 4;
  if (grouped) check_quant_weight(op, "", codes, scales, zeros, bits, out.size(1));
  check_tensor(op, "codes", codes, grouped ? 4 : 3, at::kByte);
  const CodeLayout lay = code_layout(codes, bits);
  const int64_t n = lay.n, nb = lay.nb, block = lay.block;
  const int64_t rows = out.size(0), k = out.size(1);
  PH_CHECK(row0 >= 0 && row0 + rows <= n, op, "row0", "rows [row0, row0 + out.size(0)) must lie "
           "in [0, ", n, ") (got row0 ", row0, ", ", rows, " rows)");
  PH_CHECK(block >= kAct && block % kAct == 0 && k <= nb * block && k > (nb - 1) * block, op,
           "out", "size(1) must be the K the codes hold (got shape ", shape_of(out),
           ", codes ", shape_of(codes), ")");
  if (!grouped) check_scales(op, "", lay, scales, zeros);  // (grouped: with the codes above)
  const uint8_t* zp = zeros.has_value() && zeros->defined() ? zeros->data_ptr<uint8_t>() : nullptr;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const c10::Half* sp = scales.data_ptr<c10::Half>();
  float* op_ = out.data_ptr<float>();
  const int64_t row_bytes = nb * block * bits / 8, block_bytes = block * bits / 8;
  const __m128i low = _mm_set1_epi8(0x0F);
  parallel_items(rows, 4, rows * k * 4, [&](int64_t r) {
    const int64_t c = row0 + r, g = c / kGroup, i = c % kGroup;
    float* o = op_ + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = grouped ? (g * nb + b) * kGroup + i : c * nb + b;  // scale, zero
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(sp[at].x));
      const __m256 z = _mm256_set1_ps(zp ? zp[at] : (1 << (bits - 1)));
      // the block's codes: its rows in a row, or its lines of 16 rows' four bytes (row i at 4i)
      const uint8_t* src = grouped ? cp + g * kGroup * row_bytes + b * kGroup * block_bytes + 4 * i
                                   : cp + c * row_bytes + b * block_bytes;
      for (int64_t e = 0; e < block && b * block + e < k; e += 8) {
        __m128i eight;  // elements e .. e + 7 as bytes
        if (grouped && bits == 8) {  // two lines of four
          uint32_t lo, hi;
          std::memcpy(&lo, src + (e / 4) * 64, 4);
          std::memcpy(&hi, src + (e / 4 + 1) * 64, 4);
          eight = _mm_unpacklo_epi32(_mm_cvtsi32_si128(static_cast<int>(lo)),
                                     _mm_cvtsi32_si128(static_cast<int>(hi)));
        } else if (grouped) {  // one line: e + t low, e + 4 + t high
          uint32_t four;
          std::memcpy(&four, src + (e / 8) * 64, 4);
          const __m128i b4 = _mm_cvtsi32_si128(static_cast<int>(four));
          eight = _mm_unpacklo_epi32(_mm_and_si128(b4, low),
                                     _mm_and_si128(_mm_srli_epi16(b4, 4), low));
        } else if (bits == 4) {  // 4 bytes: low nibble first
          uint32_t four;
          std::memcpy(&four, src + e / 2, 4);
          const __m128i b4 = _mm_cvtsi32_si128(static_cast<int>(four));
          eight = _mm_unpacklo_epi8(_mm_and_si128(b4, low),
                                    _mm_and_si128(_mm_srli_epi16(b4, 4), low));
        } else {
          eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + e));
        }
        const __m256 w = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(
                                           _mm256_cvtepu8_epi32(eight)), z), s);
        const int64_t left = k - (b * block + e);
        if (left >= 8) {
          _mm256_storeu_ps(o + b * block + e, w);
        } else {
          float tail[8];
          _mm256_storeu_ps(tail, w);
          std::memcpy(o + b * block + e, tail, left * sizeof(float));
        }
      }
    }
  });
}

// The prefetch of the codes this CPU gets, as the engine's kernel line names it.
std::string code_prefetch() {
  return amd_cpu() ? std::string(NtaAhead::kName) + " (AMD)" : std::string(T0Ahead::kName);
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("code_prefetch() -> str", &pagedhybrid::code_prefetch);
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int bits, "
        "Tensor(a!) out) -> ()");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? zeros, int bits, int row0, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("quant_linear", &pagedhybrid::quant_linear);
  m.impl("quant_dequantize", &pagedhybrid::quant_dequantize);
}
