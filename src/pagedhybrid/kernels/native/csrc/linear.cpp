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
#include <vector>

#include "common.h"
#include "gemm.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int64_t kRowsPerTask = 64;  // rows of x per task (cache block)
constexpr int64_t kColsPerTask = 32;  // weight rows per task
constexpr int64_t kPairRows = 64;  // bf16 pairs: rows below which `linear` streams (PAIR_ROWS)

template <typename TX, typename TW, typename TO>
void linear_rows(const TX* xp, const at::Tensor& w, at::Tensor& out, int64_t m, int64_t k);

// x's bf16 / fp16 rows widened to fp32 (exactly), once for every task that reads them
template <typename TX>
std::vector<float> widened(const at::Tensor& x) {
  const int64_t n = x.numel();
  std::vector<float> xf(static_cast<size_t>(n));
  const TX* xp = x.data_ptr<TX>();
  for (int64_t i = 0; i < n; ++i) xf[i] = to_float(xp[i]);
  return xf;
}

// Several bf16 / fp16 rows are widened to fp32 once (exactly) first: each register block then
// loads them as they are instead of widening them again for every weight block (the same
// products, so the same bits; a 4-row [4096, 256] product: 167 -> 127 us on one EPYC core).
template <typename TX, typename TW, typename TO>
void linear_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1);
  if constexpr (!std::is_same_v<TX, float> && !kBf16Pairs<TX, TW>) {
    if (m >= 2) {
      const std::vector<float> xf = widened<TX>(x);
      linear_rows<float, TW, TO>(xf.data(), w, out, m, k);
      return;
    }
  }
  linear_rows<TX, TW, TO>(x.data_ptr<TX>(), w, out, m, k);
}

template <typename TX, typename TW, typename TO>
void linear_rows(const TX* xp, const at::Tensor& w, at::Tensor& out, int64_t m, int64_t k) {
  const int64_t n = w.size(0);
  const TW* wp = w.data_ptr<TW>();
  TO* op = out.data_ptr<TO>();
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t col_tasks = (n + kColsPerTask - 1) / kColsPerTask;
  parallel_items(row_tasks * col_tasks, 1, m * n * k, [&](int64_t task) {
    const int64_t c0 = (task / row_tasks) * kColsPerTask, r0 = (task % row_tasks) * kRowsPerTask;
    const int64_t cols = std::min(kColsPerTask, n - c0), r1 = std::min(m, r0 + kRowsPerTask);
    gemm_fixed<TX, TW, TO>(xp + r0 * k, k, r1 - r0, wp + c0 * k, cols, k, op + r0 * n + c0, n);
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
template <typename TX, typename TW, typename TO>
void linear_packed(const TX* xp, const at::Tensor& w, at::Tensor& out, int64_t m, int64_t k) {
  const int64_t n = w.size(0);
  const TW* wp = w.data_ptr<TW>();
  TO* op = out.data_ptr<TO>();
  const int64_t row_tasks = (m + kPackTaskRows - 1) / kPackTaskRows;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  parallel_items(row_tasks * panels, 1, m * n * k, [&](int64_t task) {
    const int64_t c0 = (task / row_tasks) * kPanel, r0 = (task % row_tasks) * kPackTaskRows;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - c0));
    const int64_t r1 = std::min(m, r0 + kPackTaskRows);
    gemm_panel<TX, TW, TO>(xp + r0 * k, k, r1 - r0, wp + c0 * k, cols, k, op + r0 * n + c0, n);
  });
}

// x [M, K], w [N, K], out [M, N]; out in x's dtype, w in x's dtype or x float32.
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& out) {
  PH_CHECK(x.defined() && x.dim() == 2, op, "x", "must be [M, K] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto xt = x.scalar_type();
  check_x_dtype(op, xt);
  check_tensor(op, "x", x, 2, xt);
  PH_CHECK(w.defined() && w.dim() == 2, op, "w", "must be [N, K] (got shape ",
           w.defined() ? shape_of(w) : std::string("none"), ")");
  const auto wt = w.scalar_type();
  check_w_dtype(op, "w", xt, wt);
  check_tensor(op, "w", w, 2, wt);
  check_size(op, "w", w, 1, x.size(1), "the columns K of x");
  check_tensor(op, "out", out, 2, xt);
  check_size(op, "out", out, 0, x.size(0), "the rows M of x");
  check_size(op, "out", out, 1, w.size(0), "the rows N of w");
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
    const int64_t m = x.size(0), k = x.size(1);
    if (m < (kBf16Pairs<TX, TW> ? kPairRows : kPackRows)) {
      linear_impl<TX, TW, TX>(x, w, out);
    } else if constexpr (std::is_same_v<TX, float>) {
      linear_packed<float, TW, TX>(x.data_ptr<float>(), w, out, m, k);
    } else {  // bf16 / fp16 rows widened once for every panel's task (else gemm_panel widens
      // them per task: 16 x [4096, 256] bf16 on AVX2 378 -> 328 us)
      const std::vector<float> xf = widened<TX>(x);
      linear_packed<float, TW, TX>(xf.data(), w, out, m, k);
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
