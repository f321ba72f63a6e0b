// The sampler's greedy pick: per row of fp32 logits [R, V], the index of the first maximum
// (torch.argmax's rule), or -1 where the row holds a NaN or an infinity (the engine fails that
// request alone). One pass finds the row's maximum and whether every value is finite (x - x is 0
// for a finite x, NaN otherwise, and a NaN anywhere makes the running sum NaN); a second pass
// finds the first lane equal to the maximum. Exact: no arithmetic touches the chosen value, so
// the result is the same whatever the batch, the row's place in it or the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "common.h"
#include "kernels.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

int64_t pick_row(const float* x, int64_t v) {
  VF top = bcast(-__builtin_inff());
  VF nan_if_bad = zero();
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    const VF a = load(x + j);
    top = vmax(top, a);
    nan_if_bad = add(nan_if_bad, sub(a, a));
  }
  float best = reduce_max(top);
  bool finite = std::isfinite(reduce_add(nan_if_bad));
  for (int64_t t = j; t < v; ++t) {
    finite = finite && std::isfinite(x[t]);
    best = x[t] > best ? x[t] : best;
  }
  if (!finite) return -1;
  const VF want = bcast(best);
  for (j = 0; j + kLanes <= v; j += kLanes) {
    const int lane = first_equal(load(x + j), want);
    if (lane >= 0) return j + lane;
  }
  for (; j < v; ++j)
    if (x[j] == best) return j;
  return -1;  // not reached: best is one of the row's values
}

}  // namespace

at::Tensor greedy_rows(const at::Tensor& logits) {
  const char* op = "greedy_rows";
  check_tensor(op, "logits", logits, 2, at::kFloat);
  PH_CHECK(logits.size(1) >= 1, op, "logits", "must have at least one column (got shape ",
           shape_of(logits), ")");
  const int64_t rows = logits.size(0), v = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  parallel_items(rows, 1, rows * v, [&](int64_t r) { o[r] = pick_row(x + r * v, v); });
  return out;
}

}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) { m.def("greedy_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) { m.impl("greedy_rows", &pagedhybrid::greedy_rows); }
