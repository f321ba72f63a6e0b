// Batch-invariant linear: out[m, n] = sum_k x[m, k] w[n, k] with one fixed reduction order.
//
// Inputs (validated by the caller): x float32 [M, K], w float32 [N, K], out float32 [M, N]. Every output element is computed the same way
// whatever M is and wherever its row sits: kLanes partial sums, lane l accumulating k = l,
// l + kLanes, ... in ascending order with FMAs (a masked zero-filled load for the K tail), then
// one fixed horizontal reduction. Rows and weight rows are register-blocked 4 x 4 (a block only
// shares loads; each accumulator's arithmetic is its own), tails use the same code with fewer
// rows, and work is split over (weight rows x row blocks) -- never over K -- so neither the
// batch size, the packing position nor the thread count changes a bit of the result (torch's
// GEMMs pick kernels and K splits by shape, so their rows drift with the batch).
// fp32 only: bf16 runs oneDNN's bf16 GEMM on fixed row tiles instead (kernels/native/invariant.py;
// this kernel with vdpbf16ps pairs was 4-10x slower than oneDNN there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int kBlockRows = 4;  // x rows per register block
constexpr int kBlockCols = 4;  // weight rows per register block
constexpr int64_t kRowsPerTask = 64;  // rows of x per task (cache block)
constexpr int64_t kColsPerTask = 32;  // weight rows per task

template <typename T, int R, int C>
inline void block(const T* x, const T* w, int64_t k, int64_t ldx, int64_t ldw, float* out,
                  int64_t ldo) {
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  int64_t e = 0;
  for (; e + kLanes <= k; e += kLanes) {
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
    for (int c = 0; c < C; ++c) out[r * ldo + c] = reduce_add(acc[r][c]);
}

template <typename T, int R>
inline void row_block(const T* x, const T* w, int64_t cols, int64_t k, int64_t ldx,
                      float* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + kBlockCols <= cols; c += kBlockCols)
    block<T, R, kBlockCols>(x, w + c * k, k, ldx, k, out + c, ldo);
  for (; c < cols; ++c) block<T, R, 1>(x, w + c * k, k, ldx, k, out + c, ldo);
}

template <typename T>
void linear_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t col_tasks = (n + kColsPerTask - 1) / kColsPerTask;
  at::parallel_for(0, row_tasks * col_tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c0 = (task / row_tasks) * kColsPerTask, r0 = (task % row_tasks) * kRowsPerTask;
      const int64_t cols = std::min(kColsPerTask, n - c0), r1 = std::min(m, r0 + kRowsPerTask);
      const T* wb = wp + c0 * k;
      int64_t r = r0;
      for (; r + kBlockRows <= r1; r += kBlockRows)
        row_block<T, kBlockRows>(xp + r * k, wb, cols, k, k, op + r * n + c0, n);
      for (; r < r1; ++r) row_block<T, 1>(xp + r * k, wb, cols, k, k, op + r * n + c0, n);
    }
  });
}

void linear_invariant(const at::Tensor& x, const at::Tensor& w, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && out.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0),
              "shapes: x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat && out.dtype() == at::kFloat,
              "x, w and out are float32");
  linear_impl<float>(x, w, out);
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(pagedhybrid, m) {
  m.def("linear_invariant(Tensor x, Tensor w, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagedhybrid, CPU, m) {
  m.impl("linear_invariant", &pagedhybrid::linear_invariant);
}
