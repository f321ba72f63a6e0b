// The tile of the native paged attention (paged_attention.cpp, which alone includes it): the
// scores of a block of query rows against kLanes keys, the online-softmax update and P.V.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace pagedhybrid {
namespace {  // internal linkage: every CPU form's library has its own copy

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxHead = 256;

// Per item: all rows (q_len x G) of sequence b / kv head h over keys [k0, k1), kLanes keys per
// tile. The K tile is transposed (key index in the lanes) so scores are broadcast-FMAs over the
// head dim; with a bf16 cache and AVX512-BF16 the K tile stays bf16, transposed as pairs of
// dims, and scores are vdpbf16ps pair products (q rounded to bf16, as the bf16 model's q is).
// Rows go in blocks of kRowBlock for the scores (a K element loaded once feeds every row of the
// block) and in pairs for P.V with the pair's accumulators in registers across the tile's keys.
constexpr int kRowBlock = 8;
constexpr int kPrefetchTiles = 4;  // tiles ahead whose K/V rows are prefetched into L2

struct Tile {
  alignas(64) float kt[kMaxHead][kLanes];  // K transposed: kt[dim][key] (fp32 path), or
                                           // kt[dim pair][key] as bf16 pairs (bf16 path)
  alignas(64) float vt[kLanes][kMaxHead];  // V rows, fp32; bf16 path: key pairs interleaved
                                           // (vt[pair] = 16-lane chunks of (v_2j, v_2j+1)
                                           // dim pairs, dims permuted within 32: see below)
  alignas(64) float pr[kRowBlock][kLanes];  // probabilities of the tile, per row
  float corr[kRowBlock];
};

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

template <typename T>
constexpr bool pairs_path() {
  return kBf16Dot && std::is_same_v<T, c10::BFloat16>;
}

// Scores of NR rows (q rows as fp32, or as bf16 pairs `qp` when pairs_path) against the tile.
template <int NR, bool Pairs>
inline void scores(const float* const* qrow, const uint32_t* const* qpair, int d, const Tile& t,
                   VF (&sc)[NR]) {
  for (int k = 0; k < NR; ++k) sc[k] = zero();
#if defined(__AVX512BF16__)
  if constexpr (Pairs) {
    for (int e = 0; e < d / 2; ++e) {
      const __m512bh ke = reinterpret_cast<const __m512bh&>(t.kt[e]);
      for (int k = 0; k < NR; ++k)
        sc[k] = _mm512_dpbf16_ps(sc[k], (__m512bh)_mm512_set1_epi32(static_cast<int>(qpair[k][e])),
                                 ke);
    }
    return;
  }
#endif
  (void)qpair;
  for (int e = 0; e < d; ++e) {
    const VF ke = load(t.kt[e]);
    for (int k = 0; k < NR; ++k) sc[k] = fma(bcast(qrow[k][e]), ke, sc[k]);
  }
}

// acc rows k, k+1 (KR = 1 or 2) += P.V over n keys, CB vector chunks of the head dim from c0.
template <int KR, int CB>
inline void pv_block(const Tile& t, int k, int n, int c0, int d, float* acc) {
  VF a[KR][CB];
  for (int r = 0; r < KR; ++r)
    for (int c = 0; c < CB; ++c)
      a[r][c] = mul(load(acc + (k + r) * d + c0 + c * kLanes), bcast(t.corr[k + r]));
  for (int j = 0; j < n; ++j) {
    VF w[KR];
    for (int r = 0; r < KR; ++r) w[r] = bcast(t.pr[k + r][j]);
    for (int c = 0; c < CB; ++c) {
      const VF vj = load(&t.vt[j][c0 + c * kLanes]);
      for (int r = 0; r < KR; ++r) a[r][c] = fma(w[r], vj, a[r][c]);
    }
  }
  for (int r = 0; r < KR; ++r)
    for (int c = 0; c < CB; ++c) store(acc + (k + r) * d + c0 + c * kLanes, a[r][c]);
}

template <int KR>
inline void pv_rows(const Tile& t, int k, int n, int d, float* acc) {
  constexpr int kBlock = 8;  // vector chunks of the head dim per pass
  for (int c0 = 0; c0 < d; c0 += kBlock * kLanes) {
    switch (std::min(kBlock, (d - c0) / kLanes)) {
#define PH_CASE(N) \
  case N:          \
    pv_block<KR, N>(t, k, n, c0, d, acc); \
    break;
      PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6) PH_CASE(7) PH_CASE(8)
#undef PH_CASE
      default:
        break;
    }
  }
}

// bf16 path: acc += P.V with vdpbf16ps over key pairs: P rounded to bf16 (as bf16 attention
// kernels do), V staged as (v_2j, v_2j+1) pairs per dim. The pair staging interleaves two keys'
// 32-dim chunks with unpacklo/hi_epi16, which works within 128-bit lanes: lane 4L+i of the lo
// half is dim 8L+i, of the hi half dim 8L+4+i (L = 0..3). acc keeps that order and the item
// puts it back at the end (`unpermute_pairs`).
template <int KR, int CB>
inline void pv_pairs_block(const Tile& t, const uint32_t (*pp)[kLanes / 2], int k, int npairs,
                           int c0, int d, float* acc) {
#if defined(__AVX512BF16__)
  VF a[KR][CB];
  for (int r = 0; r < KR; ++r)
    for (int c = 0; c < CB; ++c)
      a[r][c] = mul(load(acc + (k + r) * d + c0 + c * kLanes), bcast(t.corr[k + r]));
  for (int jp = 0; jp < npairs; ++jp) {
    __m512bh w[KR];
    for (int r = 0; r < KR; ++r)
      w[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[k + r][jp]));
    for (int c = 0; c < CB; ++c) {
      const __m512bh vj = reinterpret_cast<const __m512bh&>(t.vt[jp][c0 + c * kLanes]);
      for (int r = 0; r < KR; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], w[r], vj);
    }
  }
  for (int r = 0; r < KR; ++r)
    for (int c = 0; c < CB; ++c) store(acc + (k + r) * d + c0 + c * kLanes, a[r][c]);
#else
  (void)t, (void)pp, (void)k, (void)npairs, (void)c0, (void)d, (void)acc;
#endif
}

template <int KR>
inline void pv_pairs_rows(const Tile& t, int k, int n, int d, float* acc) {
#if defined(__AVX512BF16__)
  alignas(64) uint32_t pp[KR > 0 ? kRowBlock : 1][kLanes / 2];
  for (int r = 0; r < KR; ++r)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[k + r]),
                       (__m256i)_mm512_cvtneps_pbh(load(t.pr[k + r])));
  const int npairs = (n + 1) / 2;  // an odd last key pairs with a zero probability
  constexpr int kBlock = 8;
  for (int c0 = 0; c0 < d; c0 += kBlock * kLanes) {
    switch (std::min(kBlock, (d - c0) / kLanes)) {
#define PH_CASE(N) \
  case N:          \
    pv_pairs_block<KR, N>(t, pp, k, npairs, c0, d, acc); \
    break;
      PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6) PH_CASE(7) PH_CASE(8)
#undef PH_CASE
      default:
        break;
    }
  }
#else
  (void)t, (void)k, (void)n, (void)d, (void)acc;
#endif
}

// Scores, online-softmax update and P.V for NR rows (row k sees keys lo[k] .. hi[k]; lo is
// read only with a local window: without one every row's lo is 0).
template <int NR, bool Pairs, bool Window>
inline void tile_rows_n(const float* const* qrow, const uint32_t* const* qpair, const int* lo,
                        const int* hi, int t0, int n, int d, int dp, float scale, Tile& t,
                        float* acc, float* m, float* l) {
  VF sc[NR];
  scores<NR, Pairs>(qrow, qpair, d, t, sc);
  alignas(64) float mold[kLanes] = {}, mnew[kLanes] = {};
  bool visible[NR];
  for (int k = 0; k < NR; ++k) {
    const int end = std::min(n, hi[k] - t0 + 1);
    if constexpr (Window) {
      const int first = std::max(0, lo[k] - t0);
      visible[k] = end > first;
      sc[k] = lanes_in(mul(sc[k], bcast(scale)), first, end);
    } else {
      visible[k] = end > 0;
      sc[k] = first_n(mul(sc[k], bcast(scale)), end);
    }
    mold[k] = m[k];
    mnew[k] = visible[k] ? std::max(m[k], reduce_max(sc[k])) : m[k];
  }
  // corr = exp(m_old - m_new) for all rows at once (1 where nothing was seen yet)
  alignas(64) float corr[kLanes];
  const VF mo = load(mold), mn = load(mnew);
  store(corr, exp(sub(mo, mn)));
  for (int k = 0; k < NR; ++k) {
    t.corr[k] = mnew[k] == kNegInf ? 1.f : corr[k];
    const VF e = visible[k] ? exp(sub(sc[k], bcast(mnew[k]))) : zero();
    store(t.pr[k], e);
    l[k] = l[k] * t.corr[k] + reduce_add(e);
    m[k] = mnew[k];
  }
  int k = 0;
  if constexpr (Pairs) {
    for (; k + 2 <= NR; k += 2) pv_pairs_rows<2>(t, k, n, dp, acc);
    if (k < NR) pv_pairs_rows<1>(t, k, n, dp, acc);
  } else {
    for (; k + 2 <= NR; k += 2) pv_rows<2>(t, k, n, dp, acc);
    if (k < NR) pv_rows<1>(t, k, n, dp, acc);
  }
}

template <bool Pairs, bool Window>
inline void tile_rows(int nr, const float* const* qrow, const uint32_t* const* qpair,
                      const int* lo, const int* hi, int t0, int n, int d, int dp, float scale,
                      Tile& t, float* acc, float* m, float* l) {
  switch (nr) {
#define PH_CASE(N) \
  case N:          \
    return tile_rows_n<N, Pairs, Window>(qrow, qpair, lo, hi, t0, n, d, dp, scale, t, acc, m, \
                                         l);
    PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6) PH_CASE(7) PH_CASE(8)
#undef PH_CASE
    default:
      break;
  }
}

// acc rows of the bf16 path back to natural dim order: within each 32 dims, position
// 16h + 4L + i holds dim 8L + 4h + i.
inline void unpermute_pairs(float* acc, int rows, int d) {
  float tmp[32];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; c += 32) {
      float* x = acc + static_cast<int64_t>(r) * d + c;
      for (int h = 0; h < 2; ++h)
        for (int lane = 0; lane < 4; ++lane)
          for (int i = 0; i < 4; ++i) tmp[8 * lane + 4 * h + i] = x[16 * h + 4 * lane + i];
      std::copy(tmp, tmp + 32, x);
    }
}

inline uint32_t bf16_bits(float x) {  // round to nearest even, as torch rounds to bf16
  return static_cast<uint32_t>(c10::BFloat16(x).x);
}

}  // namespace
}  // namespace pagedhybrid
