// Batch-invariant pointwise nonlinearities: silu and sigmoid with one arithmetic per element.
//
// Inputs (checked here): x float32, contiguous, any shape; out float32, contiguous, same numel.
// torch's CPU silu / sigmoid run a vector main loop (Sleef exp) over whole vectors and a scalar
// loop (libm exp) over what is left -- of the tensor, and of each thread's chunk -- and the two
// round differently, so an element's bits depend on the tensor's size and on where the element
// sits in it: the last token of a step whose row width (Hv*Dv of the gated norm, H*hd of the
// attention gate, the MLP width) is not a multiple of the vector loop computes on the scalar path,
// the same token elsewhere on the vector path. Here every element, the tail included (loaded
// zero-filled into a full vector), runs the same lane code:
//   vec.h's activate: e = exp(-|x|), sigmoid(x) = (x < 0 ? e : 1) / (1 + e),
//                     silu(x) = (x < 0 ? x e : x) / (1 + e)
// (NaN in, NaN out), so neither the batch, the position nor the thread count changes a bit.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

constexpr int64_t kBlock = 4096;  // elements per task (a multiple of kLanes)

template <bool Silu>
void pointwise(const char* op_name, const at::Tensor& x, at::Tensor& out) {
  check_tensor(op_name, "x", x, x.defined() ? x.dim() : 0, at::kFloat);
  check_tensor(op_name, "out", out, out.defined() ? out.dim() : 0, at::kFloat);
  PH_CHECK(x.numel() == out.numel(), op_name, "out", "must have x's ", x.numel(),
           " elements (got ", out.numel(), ")");
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // ~20 flops an element; blocks of kBlock claimed dynamically (common.h)
  parallel_items((n + kBlock - 1) / kBlock, 1, n * 8, [&](int64_t blk) {
    const int64_t e1 = std::min(n, (blk + 1) * kBlock);
    int64_t e = blk * kBlock;
    for (; e + kLanes <= e1; e += kLanes) store(op + e, activate<Silu>(load(xp + e)));
    if (e < e1) {
      const int rest = static_cast<int>(e1 - e);
      store_first(op + e, activate<Silu>(load_first(xp + e, rest)), rest);
    }
  });
}

void silu_invariant(const at::Tensor& x, at::Tensor out) {
  pointwise<true>("silu_invariant", x, out);
}
void sigmoid_invariant(const at::Tensor& x, at::Tensor out) {
  pointwise<false>("sigmoid_invariant", x, out);
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("silu_invariant(Tensor x, Tensor(a!) out) -> ()");
  m.def("sigmoid_invariant(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("silu_invariant", &pagedhybrid::silu_invariant);
  m.impl("sigmoid_invariant", &pagedhybrid::sigmoid_invariant);
}
