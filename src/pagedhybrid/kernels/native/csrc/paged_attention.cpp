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
// Query token i of sequence b (absolute position p = past + i) attends to keys [0, p]
// (is_causal, the default) or to every key of its sequence [0, past + q_len) (is_causal=0: a
// block drafter's bidirectional block, all history visible); with local_window_size w > 0 only
// to keys >= p - w (w + 1 keys with itself, causal; the left side only otherwise). Query head h
// reads kv head h / G (G = Hq / Hkv).
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
#include "attention_tile.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

struct Item {
  int b, h, split;
  int k0, k1;  // key range [k0, k1)
};

struct Geometry {
  int hq, hkv, d, bs, group, max_pages;
  float scale;
  int bs_log2;
  int dp;  // d rounded up to whole vectors: the row stride of the tiles' V rows and of acc
  int window;   // local_window_size: a query at p sees keys >= p - window (-1: all)
  bool causal;  // is_causal: a query at p sees keys <= p (else every key of its sequence)
};

template <typename T, bool Pairs, bool Window>
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
  std::vector<int> lo_all(rows), hi_all(rows);  // each row's first and last visible key
  int item_lo = it.k1, item_hi = -1;              // the keys any row sees
  for (int r = 0; r < rows; ++r) {
    const int i = r / g.group, hh = it.h * g.group + r % g.group;
    qrow_all[r] = q + (static_cast<int64_t>(q0 + i) * g.hq + hh) * d;
    hi_all[r] = g.causal ? p + i : p + qlen - 1;
    lo_all[r] = g.window > 0 ? std::max(0, p + i - g.window) : 0;
    item_lo = std::min(item_lo, lo_all[r]);
    item_hi = std::max(item_hi, hi_all[r]);
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
  for (int t0 = it.k0; t0 < it.k1 && t0 <= item_hi; t0 += kLanes) {
    const int n = std::min(kLanes, it.k1 - t0);
    if (t0 + n <= item_lo) continue;  // before every row's window: not read
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
      for (int k = 0; k < nr; ++k)
        live |= t0 <= hi_all[r0 + k] && (!Window || t0 + n > lo_all[r0 + k]);
      if (!live) continue;
      tile_rows<Pairs, Window>(nr, qrow_all.data() + r0, qpair_all.data() + r0, lo_all.data() + r0,
                       hi_all.data() + r0, t0, n, d, dp, g.scale, t,
                       acc + static_cast<int64_t>(r0) * dp, m + r0, l + r0);
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
                          const Call& c, at::Tensor& out, float scale, int64_t split,
                          int64_t window, bool causal) {
  const int batch = c.batch;
  const int32_t *seqs = c.seqs, *cu = c.cu, *past = c.past;
  Geometry g{static_cast<int>(q.size(1)), static_cast<int>(kcache.size(2)),
             static_cast<int>(q.size(2)), static_cast<int>(kcache.size(1)), 0, c.width, scale,
             0, 0, static_cast<int>(window), causal};
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
    auto run = [&](auto pairs_tag, auto window_tag) {
      run_item<T, decltype(pairs_tag)::value, decltype(window_tag)::value>(
          items[k], qp, kp, vp, c.table, cu, past, g, a, mk, lk);
    };
    bool done = false;
    if constexpr (pairs_path<T>()) {
      if (pairs) {
        g.window > 0 ? run(std::true_type{}, std::true_type{})
                     : run(std::true_type{}, std::false_type{});
        done = true;
      }
    }
    if (!done) {
      g.window > 0 ? run(std::false_type{}, std::true_type{})
                   : run(std::false_type{}, std::false_type{});
    }
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
                     const at::Tensor& seqs, at::Tensor out, double scale, int64_t split,
                     int64_t local_window_size, bool is_causal) {
  const Call c = check_call(q, key_cache, value_cache, block_table, cu_seqlens, past_lens, seqs,
                            out, split);
  PH_CHECK(local_window_size == -1 || (local_window_size > 0 && local_window_size < (1 << 30)),
           kOp, "local_window_size", "must be -1 (off) or in [1, 2^30) (got ", local_window_size,
           ")");
  auto run = [&](auto tag) {
    paged_attention_impl<decltype(tag)>(q, key_cache, value_cache, c, out,
                                        static_cast<float>(scale), split, local_window_size,
                                        is_causal);
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
      "int split, int local_window_size=-1, bool is_causal=True) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) { m.impl("paged_attention", &pagedhybrid::paged_attention); }
