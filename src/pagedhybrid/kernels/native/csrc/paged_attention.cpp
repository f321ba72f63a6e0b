// Paged decode / short-query attention reading K/V pages in place (SEPARATE layout).
//
// Inputs (every one checked before a page is read; see check_call):
//   q            float32 [N, Hq, D]            query rows, packed sequence after sequence
//   key_cache    T [P, bs, Hkv, D]             T = float32 | bfloat16 | float16 | int8 |
//                                              float8_e4m3fn (quantized pages are converted
//                                              in registers; the caller folds the scales into
//                                              q and the output)
//   value_cache  T [P, bs, Hkv, D]
//   block_table  int32 [B, M]                  physical page of logical block j
//   cu_seqlens   int32 [B+1]                   query rows of sequence b: [cu[b], cu[b+1])
//   past_lens    int32 [B]                     keys before the sequence's first new token
//   seqs         int32 [n]                     the sequences to compute (rows of the others
//                                              are left untouched)
//   out          float32 [N, Hq, D]            written
// Query token i of sequence b (absolute position past + i) attends causally to keys
// [0, past + i]; query head h reads kv head h / G (G = Hq / Hkv).
//
// Work: items (b, kv head, split) -- the context of each sequence is cut into fixed splits of
// `split` tokens (a multiple of the page size, independent of the batch and of the thread
// count) so that long contexts spread over threads; every item runs an online softmax over its
// keys for all G query heads of its kv head and every query token at once (rows = q_len x G),
// 16 keys at a time: the K tile is converted to fp32 and transposed in registers, scores are
// 16-lane FMAs over D, exp is vectorised, and the V tile is accumulated into fp32 rows. Each
// item leaves (acc, m, l) partials; the splits of each (b, kv head) are merged in ascending
// split order (deterministic) into out = acc / l by the thread that finishes the group's last
// split -- one parallel region per call, items claimed dynamically (common.h).
//
// Checks: q / out float32 [N, Hq, D], D in [1, 256]; K/V caches of one dtype and shape
// [P, bs, Hkv, D], bs a power of two, Hq a multiple of Hkv; split a multiple of bs;
// cu_seqlens [B+1] from 0, non-decreasing, ending at N; past_lens [B] >= 0; seqs distinct, in
// [0, B); for every sequence computed, ceil((past + q_len) / bs) <= M and each of those table
// entries in [0, P) (-1 padding after them is allowed) -- one min/max over the entries read.
//
// Any head size D in [1, 256]: one that is not whole vectors has its last K/V chunk loaded
// zero-filled (nothing past a row is read), scores run over the D dims, and V rows and the
// accumulators are D rounded up to whole vectors wide (the zero lanes are never written out) --
// a row's arithmetic still depends on D alone, not on the batch.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxHead = 256;

struct Item {
  int b, h, split;
  int k0, k1;  // key range [k0, k1)
};

struct Geometry {
  int hq, hkv, d, bs, group, max_pages;
  float scale;
  int bs_log2;
  int dp;  // d rounded up to whole vectors: the row stride of the tiles' V rows and of acc
};

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

// Scores, online-softmax update and P.V for NR rows (row k sees keys <= limit[k]).
template <int NR, bool Pairs>
inline void tile_rows_n(const float* const* qrow, const uint32_t* const* qpair, const int* limit,
                        int t0, int n, int d, int dp, float scale, Tile& t, float* acc, float* m,
                        float* l) {
  VF sc[NR];
  scores<NR, Pairs>(qrow, qpair, d, t, sc);
  alignas(64) float mold[kLanes] = {}, mnew[kLanes] = {};
  int visible[NR];
  for (int k = 0; k < NR; ++k) {
    visible[k] = std::max(0, std::min(n, limit[k] - t0 + 1));
    sc[k] = first_n(mul(sc[k], bcast(scale)), visible[k]);
    mold[k] = m[k];
    mnew[k] = visible[k] > 0 ? std::max(m[k], reduce_max(sc[k])) : m[k];
  }
  // corr = exp(m_old - m_new) for all rows at once (1 where nothing was seen yet)
  alignas(64) float corr[kLanes];
  const VF mo = load(mold), mn = load(mnew);
  store(corr, exp(sub(mo, mn)));
  for (int k = 0; k < NR; ++k) {
    t.corr[k] = mnew[k] == kNegInf ? 1.f : corr[k];
    const VF e = visible[k] > 0 ? exp(sub(sc[k], bcast(mnew[k]))) : zero();
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

template <bool Pairs>
inline void tile_rows(int nr, const float* const* qrow, const uint32_t* const* qpair,
                      const int* limit, int t0, int n, int d, int dp, float scale, Tile& t,
                      float* acc, float* m, float* l) {
  switch (nr) {
#define PH_CASE(N) \
  case N:          \
    return tile_rows_n<N, Pairs>(qrow, qpair, limit, t0, n, d, dp, scale, t, acc, m, l);
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

template <typename T, bool Pairs>
void run_item(const Item& it, const float* q, const T* kc, const T* vc, const int32_t* table,
              const int32_t* cu, const int32_t* past, const Geometry& g, float* acc, float* m,
              float* l) {
  static_assert(!Pairs || pairs_path<T>(), "the pairs path is the bf16 cache's");
  const int q0 = cu[it.b], qlen = cu[it.b + 1] - cu[it.b], p = past[it.b];
  const int rows = qlen * g.group, d = g.d, dp = g.dp;
  const int64_t tok_stride = static_cast<int64_t>(g.hkv) * d;            // one token, all heads
  const int64_t page_stride = static_cast<int64_t>(g.bs) * tok_stride;  // one page
  for (int r = 0; r < rows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<int64_t>(rows) * dp, 0.f);
  Tile t;
  std::vector<uint32_t> qpairs;  // bf16 pairs of the rows' q (pairs path)
  std::vector<const float*> qrow_all(rows);
  std::vector<const uint32_t*> qpair_all(rows, nullptr);
  std::vector<int> limit_all(rows);
  for (int r = 0; r < rows; ++r) {
    const int i = r / g.group, hh = it.h * g.group + r % g.group;
    qrow_all[r] = q + (static_cast<int64_t>(q0 + i) * g.hq + hh) * d;
    limit_all[r] = p + i;  // last visible key of this query token
  }
  if constexpr (Pairs) {
    qpairs.resize(static_cast<size_t>(rows) * d / 2);
    for (int r = 0; r < rows; ++r) {
      for (int e = 0; e < d / 2; ++e)
        qpairs[r * d / 2 + e] = bf16_bits(qrow_all[r][2 * e]) |
                                (bf16_bits(qrow_all[r][2 * e + 1]) << 16);
      qpair_all[r] = qpairs.data() + r * d / 2;
    }
  }
  int64_t offs[kLanes];
  const int32_t* row_table = table + static_cast<int64_t>(it.b) * g.max_pages;
  for (int t0 = it.k0; t0 < it.k1; t0 += kLanes) {
    const int n = std::min(kLanes, it.k1 - t0);
    // gather the tile (keys t0 .. t0+n-1 may span two pages; bs is a power of two)
    for (int j = 0; j < kLanes; ++j) {
      const int tt = t0 + std::min(j, n - 1);  // pad lanes repeat the last key (masked later)
      offs[j] = row_table[tt >> g.bs_log2] * page_stride + (tt & (g.bs - 1)) * tok_stride +
                static_cast<int64_t>(it.h) * d;
    }
    // the next tile's K/V rows are scattered over pages: prefetch them while this one computes
    for (int j = 0, tn = t0 + kPrefetchTiles * kLanes; j < kLanes && tn + j < it.k1; ++j) {
      const int tt = tn + j;
      const int64_t off = row_table[tt >> g.bs_log2] * page_stride +
                          (tt & (g.bs - 1)) * tok_stride + static_cast<int64_t>(it.h) * d;
      for (int64_t b = 0; b < static_cast<int64_t>(d * sizeof(T)); b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + off) + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + off) + b, _MM_HINT_T1);
      }
    }
    if constexpr (Pairs) {  // 32 bf16 = 16 dim pairs per key and register
      for (int c = 0; c < d / (2 * kLanes); ++c) {
        VF rk[kLanes];
        for (int j = 0; j < kLanes; ++j) rk[j] = _mm512_castsi512_ps(_mm512_loadu_si512(
            reinterpret_cast<const void*>(kc + offs[j] + c * 2 * kLanes)));
        transpose(rk);
        for (int e = 0; e < kLanes; ++e) store(t.kt[c * kLanes + e], rk[e]);
      }
    } else {  // a head dim that is not whole vectors: its last chunk loads zero-filled
      for (int c = 0; c < dp / kLanes; ++c) {
        const int w = std::min(kLanes, d - c * kLanes);
        VF rk[kLanes];
        for (int j = 0; j < kLanes; ++j)
          rk[j] = w == kLanes ? load(kc + offs[j] + c * kLanes)
                              : load_first(kc + offs[j] + c * kLanes, w);
        transpose(rk);
        for (int e = 0; e < kLanes; ++e) store(t.kt[c * kLanes + e], rk[e]);
      }
    }
    if constexpr (Pairs) {  // key pairs interleaved per dim (see pv_pairs_block)
      for (int jp = 0; jp < kLanes / 2; ++jp) {
        const T* a = vc + offs[2 * jp];
        const T* b = vc + offs[2 * jp + 1];
        for (int c = 0; c < d / (2 * kLanes); ++c) {
          const __m512i va = _mm512_loadu_si512(reinterpret_cast<const void*>(a + c * 2 * kLanes));
          const __m512i vb = _mm512_loadu_si512(reinterpret_cast<const void*>(b + c * 2 * kLanes));
          _mm512_store_si512(reinterpret_cast<void*>(&t.vt[jp][c * 2 * kLanes]),
                             _mm512_unpacklo_epi16(va, vb));
          _mm512_store_si512(reinterpret_cast<void*>(&t.vt[jp][c * 2 * kLanes + kLanes]),
                             _mm512_unpackhi_epi16(va, vb));
        }
      }
    } else {
      for (int j = 0; j < n; ++j)
        for (int c = 0; c < dp; c += kLanes)
          store(&t.vt[j][c], c + kLanes <= d ? load(vc + offs[j] + c)
                                             : load_first(vc + offs[j] + c, d - c));
    }
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int nr = std::min(kRowBlock, rows - r0);
      bool live = false;  // a row of the block sees at least one key of the tile
      for (int k = 0; k < nr; ++k) live |= t0 <= limit_all[r0 + k];
      if (!live) continue;
      tile_rows<Pairs>(nr, qrow_all.data() + r0, qpair_all.data() + r0, limit_all.data() + r0,
                       t0, n, d, dp, g.scale, t, acc + static_cast<int64_t>(r0) * dp, m + r0,
                       l + r0);
    }
  }
  if constexpr (Pairs) unpermute_pairs(acc, rows, d);
}

// The call's sequences, checked (see paged_attention) -- what the kernel reads.
struct Call {
  const int32_t *seqs, *cu, *past, *table;
  int batch;  // sequences computed
  int width;  // block-table entries per sequence
};

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kcache, const at::Tensor& vcache,
                          const Call& c, at::Tensor& out, float scale, int64_t split) {
  const int batch = c.batch;
  const int32_t *seqs = c.seqs, *cu = c.cu, *past = c.past;
  Geometry g{static_cast<int>(q.size(1)), static_cast<int>(kcache.size(2)),
             static_cast<int>(q.size(2)), static_cast<int>(kcache.size(1)), 0, c.width, scale,
             0, 0};
  g.group = g.hq / g.hkv;
  g.dp = (g.d + kLanes - 1) / kLanes * kLanes;
  while ((1 << g.bs_log2) < g.bs) ++g.bs_log2;
  // items b-major, then kv head, then split; group (i, h): the ns_i splits of kv head h
  std::vector<Item> items;
  std::vector<int> group_of;  // item -> its (sequence, kv head) group
  std::vector<int> group_first, group_splits, group_seq;  // group -> first item, splits, index
  int64_t work = 0;  // multiply-adds, for the inline threshold
  int max_rows = 0;
  for (int i = 0; i < batch; ++i) {
    const int b = seqs[i], qlen = cu[b + 1] - cu[b];
    const int total = past[b] + qlen;
    const int ns = total > 0 ? static_cast<int>((total + split - 1) / split) : 0;
    max_rows = std::max(max_rows, qlen * g.group);
    work += static_cast<int64_t>(total) * qlen * g.group * g.d * 2;
    for (int h = 0; h < g.hkv; ++h) {
      if (ns == 0) continue;
      const int grp = static_cast<int>(group_first.size());
      group_first.push_back(static_cast<int>(items.size()));
      group_splits.push_back(ns);
      group_seq.push_back(i);
      for (int sp = 0; sp < ns; ++sp) {
        items.push_back({b, h, sp, static_cast<int>(sp * split),
                         static_cast<int>(std::min<int64_t>((sp + 1) * split, total))});
        group_of.push_back(grp);
      }
    }
  }
  const int64_t row_floats = static_cast<int64_t>(max_rows) * g.dp;
  std::vector<float> acc(items.size() * row_floats), ms(items.size() * max_rows),
      ls(items.size() * max_rows);
  std::vector<std::atomic<int>> remaining(group_first.size());
  for (size_t k = 0; k < group_first.size(); ++k) remaining[k].store(group_splits[k]);
  const float* qp = q.data_ptr<float>();
  const T* kp = kcache.data_ptr<T>();
  const T* vp = vcache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const bool pairs = pairs_path<T>() && g.d % (2 * kLanes) == 0;  // head dim in 32-dim pairs

  // merge the splits of group grp in ascending split order (deterministic whoever runs it)
  auto merge = [&](int grp) {
    const int idx = group_seq[grp], b = seqs[idx], ns = group_splits[grp];
    const int h = items[group_first[grp]].h;
    const int rows = (cu[b + 1] - cu[b]) * g.group;
    const int64_t k0 = group_first[grp];
    for (int r = 0; r < rows; ++r) {
      float mm = kNegInf;
      for (int sp = 0; sp < ns; ++sp) mm = std::max(mm, ms[(k0 + sp) * max_rows + r]);
      const int i = r / g.group, hh = h * g.group + r % g.group;
      float* dst = op + (static_cast<int64_t>(cu[b] + i) * g.hq + hh) * g.d;
      float lsum = 0.f;
      std::fill(dst, dst + g.d, 0.f);
      for (int sp = 0; sp < ns; ++sp) {
        const float mi = ms[(k0 + sp) * max_rows + r];
        if (mi == kNegInf) continue;
        const float w = std::exp(mi - mm);
        lsum += w * ls[(k0 + sp) * max_rows + r];
        const float* src = acc.data() + (k0 + sp) * row_floats + static_cast<int64_t>(r) * g.dp;
        for (int e = 0; e < g.d; ++e) dst[e] += w * src[e];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      for (int e = 0; e < g.d; ++e) dst[e] *= inv;
    }
  };
  // one region: items claimed dynamically; the thread that finishes a group's last split
  // merges the group (acq_rel: it sees the other splits' partials)
  parallel_items(static_cast<int64_t>(items.size()), 1, work, [&](int64_t k) {
    float* a = acc.data() + k * row_floats;
    float* mk = ms.data() + k * max_rows;
    float* lk = ls.data() + k * max_rows;
    bool done = false;
    if constexpr (pairs_path<T>()) {
      if (pairs) {
        run_item<T, true>(items[k], qp, kp, vp, c.table, cu, past, g, a, mk, lk);
        done = true;
      }
    }
    if (!done) run_item<T, false>(items[k], qp, kp, vp, c.table, cu, past, g, a, mk, lk);
    const int grp = group_of[k];
    if (remaining[grp].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(grp);
  });
}

constexpr const char* kOp = "paged_attention";

// Every input checked before any page is read: shapes and dtypes, the head ratio, the page
// size, and for each sequence computed: its query rows inside q, a table row long enough for its
// keys, and every page id it reads inside the pool (one min/max over the row's used entries).
Call check_call(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& table, const at::Tensor& cu_t, const at::Tensor& past_t,
                const at::Tensor& seqs_t, const at::Tensor& out, int64_t split) {
  check_tensor(kOp, "q", q, 3, at::kFloat);
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  PH_CHECK(d >= 1 && d <= kMaxHead, kOp, "q", "head size must be in [1, ", kMaxHead, "] (got ", d,
           ")");
  check_tensor(kOp, "key_cache", kc, 4, kc.scalar_type());
  check_tensor(kOp, "value_cache", vc, 4, kc.scalar_type());
  PH_CHECK(vc.sizes() == kc.sizes(), kOp, "value_cache", "must have key_cache's shape ",
           shape_of(kc), " (got ", shape_of(vc), ")");
  const int64_t pages = kc.size(0), bs = kc.size(1), hkv = kc.size(2);
  check_size(kOp, "key_cache", kc, 3, d, "the head size of q");
  PH_CHECK(hkv >= 1 && hq % hkv == 0, kOp, "q", "head ratio: the query heads (", hq,
           ") must be a multiple of the kv heads of key_cache (", hkv, ")");
  PH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, kOp, "key_cache",
           "block size (size(1)) must be a power of two (got ", bs, ")");
  PH_CHECK(split > 0 && split % bs == 0, kOp, "split",
           "must be a positive multiple of the block size ", bs, " (got ", split, ")");
  check_tensor(kOp, "out", out, 3, at::kFloat);
  PH_CHECK(out.sizes() == q.sizes(), kOp, "out", "must have q's shape ", shape_of(q), " (got ",
           shape_of(out), ")");
  check_tensor(kOp, "block_table", table, 2, at::kInt);
  const int64_t batch = table.size(0), width = table.size(1);
  const int32_t* cu = check_cu_seqlens(kOp, cu_t, batch, n);
  check_tensor(kOp, "past_lens", past_t, 1, at::kInt);
  check_size(kOp, "past_lens", past_t, 0, batch, "the number of sequences (block_table rows)");
  check_tensor(kOp, "seqs", seqs_t, 1, at::kInt);
  const int32_t* past = past_t.data_ptr<int32_t>();
  const int32_t* seqs = seqs_t.data_ptr<int32_t>();
  const int32_t* tp = table.data_ptr<int32_t>();
  std::vector<bool> seen(static_cast<size_t>(batch), false);
  for (int64_t i = 0; i < seqs_t.size(0); ++i) {
    const int64_t b = seqs[i];
    PH_CHECK(b >= 0 && b < batch, kOp, "seqs", "seqs[", i, "] = ", b,
             " is not a sequence of the batch [0, ", batch, ")");
    PH_CHECK(!seen[b], kOp, "seqs", "sequence ", b, " is listed twice");
    seen[b] = true;
    PH_CHECK(past[b] >= 0, kOp, "past_lens", "past_lens[", b, "] = ", past[b], " is negative");
    const int64_t total = static_cast<int64_t>(past[b]) + cu[b + 1] - cu[b];
    const int64_t used = (total + bs - 1) / bs;  // table entries the sequence reads
    PH_CHECK(used <= width, kOp, "block_table", "sequence ", b, " has ", total,
             " keys and needs ", used, " pages, its row holds ", width);
    const int32_t* row = tp + b * width;
    int32_t lo = 0, hi = 0;
    if (used > 0) {
      lo = hi = row[0];
      for (int64_t j = 1; j < used; ++j) {
        lo = std::min(lo, row[j]);
        hi = std::max(hi, row[j]);
      }
    }
    if (lo < 0 || hi >= pages) {
      int64_t j = 0;
      while (row[j] >= 0 && row[j] < pages) ++j;
      PH_CHECK(false, kOp, "block_table", "block_table[", b, "][", j, "] = ", row[j],
               " is outside the page pool [0, ", pages, ") (entry ", j, " of the ", used,
               " that sequence ", b, " reads)");
    }
  }
  return {seqs, cu, past, tp, static_cast<int>(seqs_t.size(0)), static_cast<int>(width)};
}

}  // namespace

void check_paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_table,
                           const at::Tensor& cu_seqlens, const at::Tensor& past_lens,
                           const at::Tensor& seqs, const at::Tensor& out, int64_t split) {
  check_call(q, key_cache, value_cache, block_table, cu_seqlens, past_lens, seqs, out, split);
}

void paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& cu_seqlens, const at::Tensor& past_lens,
                     const at::Tensor& seqs, at::Tensor out, double scale, int64_t split) {
  const Call c = check_call(q, key_cache, value_cache, block_table, cu_seqlens, past_lens, seqs,
                            out, split);
  auto run = [&](auto tag) {
    paged_attention_impl<decltype(tag)>(q, key_cache, value_cache, c, out,
                                        static_cast<float>(scale), split);
  };
  const auto dt = key_cache.scalar_type();
  if (dt == at::kFloat) {
    run(float{});
  } else if (dt == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (dt == at::kHalf) {
    run(c10::Half{});
  } else if (dt == at::kChar) {
    run(int8_t{});
  } else if (dt == at::kFloat8_e4m3fn) {
    run(c10::Float8_e4m3fn{});
  } else {
    PH_CHECK(false, kOp, "key_cache",
             "dtype must be float32, bfloat16, float16, int8 or float8_e4m3fn (got ", dt, ")");
  }
}
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor cu_seqlens, Tensor past_lens, Tensor seqs, Tensor(a!) out, float scale, "
      "int split) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) { m.impl("paged_attention", &pagedhybrid::paged_attention); }
