// Paged decode / short-query attention reading K/V pages in place (SEPARATE layout).
//
// Inputs (validated by the caller; internal entry point):
//   q            float32 [N, Hq, D]            query rows, packed sequence after sequence
//   key_cache    T [P, bs, Hkv, D]             T = float32 | bfloat16 | float16
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
// item leaves (acc, m, l) partials; a second pass merges the splits of each (b, kv head) in
// ascending split order (deterministic) and writes out = acc / l.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
};

// One item: all rows (q_len x G) of sequence b / kv head h over keys [k0, k1), kLanes keys per
// tile. Rows go in blocks of up to kRowBlock so a K/V tile element loaded from L1 feeds several
// rows' FMAs (the G query heads of a GQA group share every K/V read).
constexpr int kRowBlock = 8;

// Scores, online-softmax update and P.V for NR rows against one transposed K tile `kt` and V
// tile `vt` (n valid keys starting at key t0; row k sees keys <= limit[k]). NR is a compile-time
// constant so the row accumulators stay in registers.
template <int NR>
inline void tile_rows_n(const float* const* qrow, const int* limit, int t0, int n, int d,
                        float scale, const float (*kt)[kLanes], const float (*vt)[kMaxHead],
                        float* acc, float* m, float* l) {
  VF sc[NR];
  for (int k = 0; k < NR; ++k) sc[k] = zero();
  for (int e = 0; e < d; ++e) {
    const VF ke = load(kt[e]);
    for (int k = 0; k < NR; ++k) sc[k] = fma(bcast(qrow[k][e]), ke, sc[k]);
  }
  alignas(64) float pr[NR][kLanes];
  float corr[NR];
  for (int k = 0; k < NR; ++k) {
    const int visible = std::max(0, std::min(n, limit[k] - t0 + 1));
    const VF s = first_n(mul(sc[k], bcast(scale)), visible);
    const float mnew = visible > 0 ? std::max(m[k], reduce_max(s)) : m[k];
    corr[k] = mnew == kNegInf ? 1.f : std::exp(m[k] - mnew);
    const VF e = visible > 0 ? exp(sub(s, bcast(mnew))) : zero();
    store(pr[k], e);
    l[k] = l[k] * corr[k] + reduce_add(e);
    m[k] = mnew;
  }
  for (int c = 0; c < d; c += kLanes) {
    VF a[NR];
    for (int k = 0; k < NR; ++k) a[k] = mul(load(acc + k * d + c), bcast(corr[k]));
    for (int j = 0; j < n; ++j) {
      const VF vj = load(&vt[j][c]);
      for (int k = 0; k < NR; ++k) a[k] = fma(bcast(pr[k][j]), vj, a[k]);
    }
    for (int k = 0; k < NR; ++k) store(acc + k * d + c, a[k]);
  }
}

inline void tile_rows(int nr, const float* const* qrow, const int* limit, int t0, int n, int d,
                      float scale, const float (*kt)[kLanes], const float (*vt)[kMaxHead],
                      float* acc, float* m, float* l) {
  switch (nr) {
#define PH_CASE(N) \
  case N:          \
    return tile_rows_n<N>(qrow, limit, t0, n, d, scale, kt, vt, acc, m, l);
    PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6) PH_CASE(7) PH_CASE(8)
#undef PH_CASE
    default:
      break;
  }
}

template <typename T>
void run_item(const Item& it, const float* q, const T* kc, const T* vc, const int32_t* table,
              const int32_t* cu, const int32_t* past, const Geometry& g, float* acc, float* m,
              float* l) {
  const int q0 = cu[it.b], qlen = cu[it.b + 1] - cu[it.b], p = past[it.b];
  const int rows = qlen * g.group, d = g.d, dv = d / kLanes;
  const int64_t tok_stride = static_cast<int64_t>(g.hkv) * d;            // one token, all heads
  const int64_t page_stride = static_cast<int64_t>(g.bs) * tok_stride;  // one page
  for (int r = 0; r < rows; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<int64_t>(rows) * d, 0.f);
  alignas(64) float kt[kMaxHead][kLanes];  // K tile transposed: kt[dim][key]
  alignas(64) float vt[kLanes][kMaxHead];  // V tile rows
  int64_t offs[kLanes];
  const float* qrow[kRowBlock];
  int limit[kRowBlock];
  const int32_t* row_table = table + static_cast<int64_t>(it.b) * g.max_pages;
  for (int t0 = it.k0; t0 < it.k1; t0 += kLanes) {
    const int n = std::min(kLanes, it.k1 - t0);
    // gather + convert the tile (keys t0 .. t0+n-1 may span two pages; bs is a power of two)
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      offs[j] = row_table[t >> g.bs_log2] * page_stride + (t & (g.bs - 1)) * tok_stride +
                static_cast<int64_t>(it.h) * d;
    }
    for (int c = 0; c < dv; ++c) {
      VF rk[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        if (j < n) {
          rk[j] = load(kc + offs[j] + c * kLanes);
          store(&vt[j][c * kLanes], load(vc + offs[j] + c * kLanes));
        } else {
          rk[j] = zero();
          store(&vt[j][c * kLanes], zero());
        }
      }
      transpose(rk);
      for (int e = 0; e < kLanes; ++e) store(kt[c * kLanes + e], rk[e]);
    }
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int nr = std::min(kRowBlock, rows - r0);
      int live = 0;  // rows of the block that see at least one key of the tile
      for (int k = 0; k < nr; ++k) {
        const int r = r0 + k, i = r / g.group, hh = it.h * g.group + r % g.group;
        qrow[k] = q + (static_cast<int64_t>(q0 + i) * g.hq + hh) * d;
        limit[k] = p + i;  // last visible key of this query token
        live += t0 <= limit[k];
      }
      if (live == 0) continue;
      tile_rows(nr, qrow, limit, t0, n, d, g.scale, kt, vt, acc + static_cast<int64_t>(r0) * d,
                m + r0, l + r0);
    }
  }
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kcache, const at::Tensor& vcache,
                          const at::Tensor& table, const at::Tensor& cu_t,
                          const at::Tensor& past_t, const at::Tensor& seqs_t, at::Tensor& out,
                          float scale, int64_t split) {
  const int batch = static_cast<int>(seqs_t.size(0));  // sequences computed here
  const int32_t* seqs = seqs_t.data_ptr<int32_t>();
  Geometry g{static_cast<int>(q.size(1)), static_cast<int>(kcache.size(2)),
             static_cast<int>(q.size(2)), static_cast<int>(kcache.size(1)), 0,
             static_cast<int>(table.size(1)), scale, 0};
  g.group = g.hq / g.hkv;
  while ((1 << g.bs_log2) < g.bs) ++g.bs_log2;
  const int32_t* cu = cu_t.data_ptr<int32_t>();
  const int32_t* past = past_t.data_ptr<int32_t>();
  std::vector<Item> items;
  std::vector<int> first(batch + 1, 0);  // splits of the i-th listed sequence: first[i+1]-first[i]
  for (int i = 0; i < batch; ++i) {
    const int b = seqs[i];
    const int total = past[b] + cu[b + 1] - cu[b];
    const int ns = total > 0 ? (total + split - 1) / split : 0;
    first[i + 1] = first[i] + ns;
    for (int h = 0; h < g.hkv; ++h)
      for (int sp = 0; sp < ns; ++sp)
        items.push_back({b, h, sp, static_cast<int>(sp * split),
                         static_cast<int>(std::min<int64_t>((sp + 1) * split, total))});
  }
  int max_rows = 0;
  for (int i = 0; i < batch; ++i)
    max_rows = std::max(max_rows, (cu[seqs[i] + 1] - cu[seqs[i]]) * g.group);
  const int64_t row_floats = static_cast<int64_t>(max_rows) * g.d;
  std::vector<float> acc(items.size() * row_floats), ms(items.size() * max_rows),
      ls(items.size() * max_rows);
  const float* qp = q.data_ptr<float>();
  const T* kp = kcache.data_ptr<T>();
  const T* vp = vcache.data_ptr<T>();
  const int32_t* tp = table.data_ptr<int32_t>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k)
      run_item<T>(items[k], qp, kp, vp, tp, cu, past, g, acc.data() + k * row_floats,
                  ms.data() + k * max_rows, ls.data() + k * max_rows);
  });
  // merge the splits of each (b, h) in ascending split order; items are laid out b-major,
  // then head, then split
  float* op = out.data_ptr<float>();
  std::vector<int64_t> base(batch + 1, 0);
  for (int i = 0; i < batch; ++i) base[i + 1] = base[i] + (first[i + 1] - first[i]) * g.hkv;
  at::parallel_for(0, static_cast<int64_t>(batch) * g.hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int idx = static_cast<int>(bh / g.hkv), h = static_cast<int>(bh % g.hkv);
      const int b = seqs[idx];
      const int ns = first[idx + 1] - first[idx];
      const int rows = (cu[b + 1] - cu[b]) * g.group;
      if (ns == 0) continue;
      const int64_t k0 = base[idx] + static_cast<int64_t>(h) * ns;
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
          const float* src = acc.data() + (k0 + sp) * row_floats + static_cast<int64_t>(r) * g.d;
          for (int e = 0; e < g.d; ++e) dst[e] += w * src[e];
        }
        const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
        for (int e = 0; e < g.d; ++e) dst[e] *= inv;
      }
    }
  });
}

void paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& cu_seqlens, const at::Tensor& past_lens,
                     const at::Tensor& seqs, at::Tensor out, double scale, int64_t split) {
  TORCH_CHECK(q.dtype() == at::kFloat && out.dtype() == at::kFloat, "q/out must be float32");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && block_table.is_contiguous(),
              "tensors must be contiguous");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= kMaxHead,
              "head size must be a multiple of 16 and at most 256");
  const int64_t bs = key_cache.size(1);
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "block size must be a power of two");
  TORCH_CHECK(split > 0 && split % bs == 0, "split must be a multiple of the block size");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "K/V cache dtypes differ");
  TORCH_CHECK(seqs.dtype() == at::kInt && cu_seqlens.dtype() == at::kInt &&
                  past_lens.dtype() == at::kInt && block_table.dtype() == at::kInt,
              "seqs, cu_seqlens, past_lens and block_table must be int32");
  auto run = [&](auto tag) {
    paged_attention_impl<decltype(tag)>(q, key_cache, value_cache, block_table, cu_seqlens,
                                        past_lens, seqs, out, static_cast<float>(scale), split);
  };
  if (key_cache.dtype() == at::kFloat) {
    run(float{});
  } else if (key_cache.dtype() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (key_cache.dtype() == at::kHalf) {
    run(c10::Half{});
  } else {
    TORCH_CHECK(false, "cache dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(pagedhybrid, m) {
  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
      "Tensor cu_seqlens, Tensor past_lens, Tensor seqs, Tensor(a!) out, float scale, "
      "int split) -> ()");
}

TORCH_LIBRARY_IMPL(pagedhybrid, CPU, m) { m.impl("paged_attention", &pagedhybrid::paged_attention); }
