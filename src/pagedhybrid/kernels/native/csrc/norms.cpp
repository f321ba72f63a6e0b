// Row-wise normalisations of the Qwen3.5 decoder, one op each instead of ~10 torch ops:
//
//   rms_norm(x, w, out, eps, offset):  out = x * rsqrt(mean(x^2) + eps) * (offset ? 1 + w : w)
//   gated_rms_norm(x, gate, w, out, eps):
//                                      out = x * rsqrt(mean(x^2) + eps) * w * silu(gate)
//   l2_normalize(x, out, eps):         out = x * rsqrt(sum(x^2) + eps)      (out float32)
//
// Inputs (checked here): x [R, D] float32 or bfloat16, contiguous; gate as x; w [D] float32 or
// bfloat16; out [R, D] contiguous, x's dtype (l2_normalize: float32). The arithmetic is fp32
// in the order the torch layers write it (kernels/registry.py TORCH_NORMS), rounded once into
// out's dtype. Each row is reduced by one thread in one fixed order (rows.h), whatever R is: a
// row's result never depends on the batch, so the batch-invariant bundle uses these too.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "common.h"
#include "kernels.h"
#include "rows.h"

namespace pagedhybrid {
namespace {

template <Kind K, typename T, typename W, typename O>
void rows(const T* x, const T* gate, const W* w, O* out, int64_t r, int64_t d, float eps,
          bool offset) {
  // ~4 flops an element; a row is one item
  parallel_items(r, 1, r * d * 4, [&](int64_t row) {
    norm_row<K, T, W, O>(x + row * d, gate != nullptr ? gate + row * d : nullptr, w, out + row * d,
                         d, eps, offset);
  });
}

void check_rows(const char* op, const at::Tensor& x, const at::Tensor& out,
                at::ScalarType out_dtype) {
  PH_CHECK(x.defined() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
           op, "x", "must be float32 or bfloat16");
  check_tensor(op, "x", x, 2, x.scalar_type());
  check_tensor(op, "out", out, 2, out_dtype);
  check_size(op, "out", out, 0, x.size(0), "x.size(0)");
  check_size(op, "out", out, 1, x.size(1), "x.size(1)");
}

template <Kind K, typename T, typename O>
void by_weight(const at::Tensor& x, const at::Tensor* gate, const at::Tensor* w, at::Tensor& out,
               double eps, bool offset) {
  const int64_t r = x.size(0), d = x.size(1);
  const T* g = gate != nullptr ? gate->data_ptr<T>() : nullptr;
  if (w == nullptr || w->scalar_type() == at::kFloat) {
    rows<K, T, float, O>(x.data_ptr<T>(), g, w ? w->data_ptr<float>() : nullptr,
                         out.data_ptr<O>(), r, d, static_cast<float>(eps), offset);
  } else {
    rows<K, T, c10::BFloat16, O>(x.data_ptr<T>(), g, w->data_ptr<c10::BFloat16>(),
                                 out.data_ptr<O>(), r, d, static_cast<float>(eps), offset);
  }
}


void gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w,
                    at::Tensor out, double eps) {
  const char* op = "gated_rms_norm";
  check_rows(op, x, out, x.scalar_type());
  check_tensor(op, "gate", gate, 2, x.scalar_type());
  check_size(op, "gate", gate, 0, x.size(0), "x.size(0)");
  check_size(op, "gate", gate, 1, x.size(1), "x.size(1)");
  check_norm_weight(op, "w", w, x.size(1), "x.size(1)");
  if (x.scalar_type() == at::kFloat) {
    by_weight<Kind::kGated, float, float>(x, &gate, &w, out, eps, false);
  } else {
    by_weight<Kind::kGated, c10::BFloat16, c10::BFloat16>(x, &gate, &w, out, eps, false);
  }
}

void l2_normalize(const at::Tensor& x, at::Tensor out, double eps) {
  const char* op = "l2_normalize";
  check_rows(op, x, out, at::kFloat);
  if (x.scalar_type() == at::kFloat) {
    by_weight<Kind::kL2, float, float>(x, nullptr, nullptr, out, eps, false);
  } else {
    by_weight<Kind::kL2, c10::BFloat16, float>(x, nullptr, nullptr, out, eps, false);
  }
}

}  // namespace

void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, double eps,
              bool offset) {
  const char* op = "rms_norm";
  check_rows(op, x, out, x.scalar_type());
  check_norm_weight(op, "w", w, x.size(1), "x.size(1)");
  if (x.scalar_type() == at::kFloat) {
    by_weight<Kind::kRms, float, float>(x, nullptr, &w, out, eps, offset);
  } else {
    by_weight<Kind::kRms, c10::BFloat16, c10::BFloat16>(x, nullptr, &w, out, eps, offset);
  }
}
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def("rms_norm(Tensor x, Tensor w, Tensor(a!) out, float eps, bool offset) -> ()");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor w, Tensor(a!) out, float eps) -> ()");
  m.def("l2_normalize(Tensor x, Tensor(a!) out, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("rms_norm", &pagedhybrid::rms_norm);
  m.impl("gated_rms_norm", &pagedhybrid::gated_rms_norm);
  m.impl("l2_normalize", &pagedhybrid::l2_normalize);
}
