// Batch-invariant linear: out[m, n] = sum_k x[m, k] w[n, k] with one fixed reduction order.
//
// Inputs (checked here): x [M, K], w [N, K], out [M, N] -- float32, bfloat16 or float16, out in
// x's dtype, w in x's dtype or (beside float32 x) bfloat16 / float16 -- each widened to fp32 in
// registers, accumulated in fp32, out rounded once. Every output element is computed the same
// way whatever M is and wherever its row sits: kLanes partial sums, lane l accumulating k = l,
// l + kLanes, ... in ascending order with FMAs (a masked zero-filled load for the K tail), then
// one fixed horizontal reduction. Rows and weight rows are register-blocked 4 x 4 (a block only
// shares loads; each accumulator's arithmetic is its own), tails use the same code with fewer
// rows, and work is split over (weight rows x row blocks) -- never over K -- so neither the batch
// size, the packing position nor the thread count changes a bit of the result (torch's GEMMs
// pick kernels and K splits by shape, so their rows drift with the batch).
//
// bf16 / fp16 weights are widened to fp32 exactly (bf16: the high half of an fp32), so the
// arithmetic -- and every bit -- is the fp32 kernel's on the widened weights: in registers for
// the few rows of a decode step (the weights stream from memory once, at half the bytes of fp32),
// and for tasks of at least kWidenRows rows into a per-task fp32 panel first (converted once,
// reused by every row block). It serves the batch-invariant mode's projections
// (kernels/native/invariant.py: fp32, and bf16 on CPU forms without BF16 dot instructions).
//
// `linear` (x, w, out as above) is the fast form for everything else, without the invariance:
// decode-sized M runs the kernel above; from kPackRows rows on, packed fp32 panels and an
// outer-product micro-kernel (see below). It is how a CPU without BF16 dot instructions (AVX-512
// without AVX512-BF16, or AVX2) runs bf16 weights in fp32 registers (kernels/native/dense.py);
// torch's bf16 GEMM there emulates bf16 products and runs 2-4x slower than its fp32 GEMM.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int kBlockRows = 4;  // x rows per register block
constexpr int kBlockCols = 4;  // weight rows per register block
constexpr int64_t kRowsPerTask = 64;  // rows of x per task (cache block)
constexpr int64_t kColsPerTask = 32;  // weight rows per task
constexpr int64_t kWidenRows = 16;    // rows of a task from which bf16/fp16 panels are widened

// x rows TX, weight rows TW (both widened to fp32 in registers by load()), out TO.
template <typename TX, typename TW, typename TO, int R, int C>
inline void block(const TX* x, const TW* w, int64_t k, int64_t ldx, int64_t ldw, TO* out,
                  int64_t ldo) {
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t e = 0;
  for (; e + kLanes <= k; e += kLanes) {
    if constexpr (R == 1) {
      // decode streams each weight once: fetch the next block's rows (same offset) into L2
      // while this block computes (short 2-8 KiB rows start too many streams for the hardware
      // prefetcher to ramp up on); past the matrix's end a prefetch is a no-op
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + (C + c) * ldw + e), _MM_HINT_T1);
    }
    VF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + c * ldw + e);
    for (int r = 0; r < R; ++r) {
      const VF xv = load(x + r * ldx + e);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  if (e < k) {
    const int n = static_cast<int>(k - e);
    VF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_first(w + c * ldw + e, n);
    for (int r = 0; r < R; ++r) {
      const VF xv = load_first(x + r * ldx + e, n);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = from_float<TO>(reduce_add(acc[r][c]));
}

// A single row blocks 8 weight rows (8 independent FMA chains keep both FMA ports busy); more
// rows share each weight load kBlockCols at a time. Each accumulator's arithmetic is its own
// either way, so the blocking changes no bit of the result.
template <typename TX, typename TW, typename TO, int R>
inline void row_block(const TX* x, const TW* w, int64_t cols, int64_t k, int64_t ldx, TO* out,
                      int64_t ldo) {
  constexpr int kCols = R == 1 ? 2 * kBlockCols : kBlockCols;
  int64_t c = 0;
  for (; c + kCols <= cols; c += kCols)
    block<TX, TW, TO, R, kCols>(x, w + c * k, k, ldx, k, out + c, ldo);
  if constexpr (kCols != kBlockCols) {
    for (; c + kBlockCols <= cols; c += kBlockCols)
      block<TX, TW, TO, R, kBlockCols>(x, w + c * k, k, ldx, k, out + c, ldo);
  }
  for (; c < cols; ++c) block<TX, TW, TO, R, 1>(x, w + c * k, k, ldx, k, out + c, ldo);
}

// rows [r0, r1) of x against weight rows [c0, c0 + cols) (wb: their first row)
template <typename TX, typename TW, typename TO>
inline void task_rows(const TX* xp, const TW* wb, int64_t r0, int64_t r1, int64_t c0,
                      int64_t cols, int64_t k, int64_t n, TO* op) {
  int64_t r = r0;
  for (; r + kBlockRows <= r1; r += kBlockRows)
    row_block<TX, TW, TO, kBlockRows>(xp + r * k, wb, cols, k, k, op + r * n + c0, n);
  for (; r < r1; ++r) row_block<TX, TW, TO, 1>(xp + r * k, wb, cols, k, k, op + r * n + c0, n);
}

template <typename TX, typename TW, typename TO>
void linear_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const TX* xp = x.data_ptr<TX>();
  const TW* wp = w.data_ptr<TW>();
  TO* op = out.data_ptr<TO>();
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t col_tasks = (n + kColsPerTask - 1) / kColsPerTask;
  parallel_items(row_tasks * col_tasks, 1, m * n * k, [&](int64_t task) {
    const int64_t c0 = (task / row_tasks) * kColsPerTask, r0 = (task % row_tasks) * kRowsPerTask;
    const int64_t cols = std::min(kColsPerTask, n - c0), r1 = std::min(m, r0 + kRowsPerTask);
    const TW* wb = wp + c0 * k;
    if constexpr (!std::is_same_v<TW, float>) {
      if (r1 - r0 >= kWidenRows) {  // widen the panel once, reuse it for every row block
        thread_local std::vector<float> panel;
        panel.resize(static_cast<size_t>(cols * k));
        for (int64_t i = 0; i < cols * k; i += kLanes) {
          const int rest = static_cast<int>(std::min<int64_t>(kLanes, cols * k - i));
          if (rest == kLanes) {
            store(panel.data() + i, load(wb + i));
          } else {
            store_first(panel.data() + i, load_first(wb + i, rest), rest);
          }
        }
        task_rows<TX, float, TO>(xp, panel.data(), r0, r1, c0, cols, k, n, op);
        return;
      }
    }
    task_rows<TX, TW, TO>(xp, wb, r0, r1, c0, cols, k, n, op);
  });
}

// -- linear: the fast form (not batch-invariant) -------------------------------------------------
// Below kPackRows rows (decode) it is linear_invariant's kernel (weights streamed once, widened in
// registers). From kPackRows rows on (prefill) the weights are packed per task into fp32 panels
// of kPanel output columns, K-major ([kc][kPanel], widened and transposed in registers, kc =
// kDepth dims at a time), and an outer-product micro-kernel keeps kMicroRows x kPanel fp32
// accumulators in registers (per K step kPanelVecs weight loads and kMicroRows broadcasts feed
// kPanelVecs x kMicroRows FMAs; the dot-product form above needs a load per FMA pair and is bound
// by the cache's bandwidth there), summing K blocks into a per-task fp32 tile that is rounded to
// out's dtype once. The K blocks and the path chosen by M change the summation order, so this
// form's rows depend on M at the rounding level: the batch-invariant mode uses linear_invariant.
constexpr int kPanelVecs = 2;
constexpr int kPanel = kPanelVecs * kLanes;  // output columns (weight rows) per panel
#if defined(__AVX512F__)
constexpr int kMicroRows = 12;  // 24 accumulators + 2 weight vectors + 1 broadcast of 32 zmm
#else
constexpr int kMicroRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 ymm
#endif
constexpr int64_t kPackRows = 16;      // rows from which the packed form runs
constexpr int64_t kPackTaskRows = 96;  // rows per task (a multiple of 12 and of 6)
constexpr int64_t kDepth = 256;        // K dims per packed panel block (32 KiB: L1)

// panel[e][c] = w[c][e0 + e] for e < kc, c < cols (zero columns past cols), in fp32
template <typename TW>
void pack_panel(const TW* w, int64_t k, int64_t e0, int kc, int cols, float* panel) {
  for (int cb = 0; cb < kPanelVecs; ++cb) {
    for (int e = 0; e < kc; e += kLanes) {
      const int n = std::min(kLanes, kc - e);
      VF rows[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const int c = cb * kLanes + j;
        const TW* src = w + c * k + e0 + e;
        rows[j] = c >= cols ? zero() : n == kLanes ? load(src) : load_first(src, n);
      }
      transpose(rows);  // rows[i] = dim e + i of the kLanes columns
      for (int i = 0; i < n; ++i) store(panel + (e + i) * kPanel + cb * kLanes, rows[i]);
    }
  }
}

// tile[r][:] (+)= x[r][0:kc] . panel for R rows (tile rows of kPanel fp32)
template <typename TX, int R>
inline void micro(const TX* x, int64_t ldx, const float* panel, int kc, bool first,
                  float* tile) {
  VF acc[R][kPanelVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVecs; ++v)
      acc[r][v] = first ? zero() : load(tile + r * kPanel + v * kLanes);
  for (int e = 0; e < kc; ++e) {
    VF wv[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) wv[v] = load(panel + e * kPanel + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VF xb = bcast(to_float(x[r * ldx + e]));
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = fma(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kPanelVecs; ++v) store(tile + r * kPanel + v * kLanes, acc[r][v]);
}

template <typename TX>
inline void micro_rows(int rows, const TX* x, int64_t ldx, const float* panel, int kc,
                       bool first, float* tile) {
  switch (rows) {
#define PH_CASE(N) \
  case N:          \
    return micro<TX, N>(x, ldx, panel, kc, first, tile);
    PH_CASE(1) PH_CASE(2) PH_CASE(3) PH_CASE(4) PH_CASE(5) PH_CASE(6)
#if defined(__AVX512F__)
    PH_CASE(7) PH_CASE(8) PH_CASE(9) PH_CASE(10) PH_CASE(11) PH_CASE(12)
#endif
#undef PH_CASE
    default:
      break;
  }
}

template <typename TX, typename TW, typename TO>
void linear_packed(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const TX* xp = x.data_ptr<TX>();
  const TW* wp = w.data_ptr<TW>();
  TO* op = out.data_ptr<TO>();
  const int64_t row_tasks = (m + kPackTaskRows - 1) / kPackTaskRows;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  parallel_items(row_tasks * panels, 1, m * n * k, [&](int64_t task) {
    const int64_t c0 = (task / row_tasks) * kPanel, r0 = (task % row_tasks) * kPackTaskRows;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - c0));
    const int64_t r1 = std::min(m, r0 + kPackTaskRows);
    thread_local std::vector<float> panel, tile;
    panel.resize(static_cast<size_t>(kDepth * kPanel));
    tile.resize(static_cast<size_t>(kPackTaskRows * kPanel));
    for (int64_t e0 = 0; e0 < k; e0 += kDepth) {
      const int kc = static_cast<int>(std::min<int64_t>(kDepth, k - e0));
      pack_panel<TW>(wp + c0 * k, k, e0, kc, cols, panel.data());
      for (int64_t r = r0; r < r1; r += kMicroRows)
        micro_rows<TX>(static_cast<int>(std::min<int64_t>(kMicroRows, r1 - r)),
                       xp + r * k + e0, k, panel.data(), kc, e0 == 0,
                       tile.data() + (r - r0) * kPanel);
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < cols; ++c)
        op[r * n + c0 + c] = from_float<TO>(tile[(r - r0) * kPanel + c]);
  });
}

// x [M, K], w [N, K], out [M, N]; out in x's dtype, w in x's dtype or x float32.
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& out) {
  PH_CHECK(x.defined() && x.dim() == 2, op, "x", "must be [M, K] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto xt = x.scalar_type();
  PH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, "x",
           "dtype must be float32, bfloat16 or float16 (got ", xt, ")");
  check_tensor(op, "x", x, 2, xt);
  PH_CHECK(w.defined() && w.dim() == 2, op, "w", "must be [N, K] (got shape ",
           w.defined() ? shape_of(w) : std::string("none"), ")");
  const auto wt = w.scalar_type();
  PH_CHECK(wt == xt || (xt == at::kFloat && (wt == at::kBFloat16 || wt == at::kHalf)), op, "w",
           "dtype must be x's (", xt, "), or bfloat16 / float16 with float32 x (got ", wt, ")");
  check_tensor(op, "w", w, 2, wt);
  check_size(op, "w", w, 1, x.size(1), "the columns K of x");
  check_tensor(op, "out", out, 2, xt);
  check_size(op, "out", out, 0, x.size(0), "the rows M of x");
  check_size(op, "out", out, 1, w.size(0), "the rows N of w");
}

// f(x tag, w tag) for the dtype pairs check_linear allows (out is x's dtype)
template <class F>
void by_dtypes(const at::Tensor& x, const at::Tensor& w, const F& f) {
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  if (xt == at::kBFloat16) {
    f(c10::BFloat16{}, c10::BFloat16{});
  } else if (xt == at::kHalf) {
    f(c10::Half{}, c10::Half{});
  } else if (wt == at::kBFloat16) {
    f(float{}, c10::BFloat16{});
  } else if (wt == at::kHalf) {
    f(float{}, c10::Half{});
  } else {
    f(float{}, float{});
  }
}

void linear_invariant(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  check_linear("linear_invariant", x, w, out);
  by_dtypes(x, w, [&](auto xtag, auto wtag) {
    using TX = decltype(xtag);
    linear_impl<TX, decltype(wtag), TX>(x, w, out);
  });
}

}  // namespace

void linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  check_linear("linear", x, w, out);
  by_dtypes(x, w, [&](auto xtag, auto wtag) {
    using TX = decltype(xtag);
    using TW = decltype(wtag);
    if (x.size(0) >= kPackRows) {
      linear_packed<TX, TW, TX>(x, w, out);
    } else {
      linear_impl<TX, TW, TX>(x, w, out);
    }
  });
}
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("linear_invariant(Tensor x, Tensor w, Tensor(a!) out) -> ()");
  m.def("linear(Tensor x, Tensor w, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("linear_invariant", &pagedhybrid::linear_invariant);
  m.impl("linear", &pagedhybrid::linear);
}
