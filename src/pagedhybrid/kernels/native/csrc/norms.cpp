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
// out's dtype. Each row is reduced by one thread in one fixed order (kLanes partial sums, then
// reduce_add), whatever R is: a row's result never depends on the batch, so the batch-invariant
// bundle uses these too; silu is pointwise.cpp's lane code (exp(-|x|)), the same for every
// element.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "common.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

template <typename T>
float sum_squares(const T* x, int64_t d) {
  VF acc = zero();
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const VF v = load(x + i);
    acc = fma(v, v, acc);
  }
  if (i < d) {
    const VF v = load_first(x + i, static_cast<int>(d - i));
    acc = fma(v, v, acc);
  }
  return reduce_add(acc);
}

inline float silu(float x) {  // pointwise.cpp's form: (x < 0 ? x e : x) / (1 + e), e = exp(-|x|)
  if (std::isnan(x)) return x;
  const float e = std::exp(-std::fabs(x));
  return (x < 0.f ? x * e : x) / (1.f + e);
}

enum class Kind { kRms, kGated, kL2 };

template <Kind K, typename T, typename W, typename O>
void rows(const T* x, const T* gate, const W* w, O* out, int64_t r, int64_t d, float eps,
          bool offset) {
  // ~4 flops an element; a row is one item
  parallel_items(r, 1, r * d * 4, [&](int64_t row) {
    const T* xr = x + row * d;
    O* orow = out + row * d;
    const float ss = sum_squares(xr, d);
    const float inv =
        1.f / std::sqrt(K == Kind::kL2 ? ss + eps : ss / static_cast<float>(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      float y = to_float(xr[j]) * inv;
      if constexpr (K == Kind::kRms) {
        y = y * (offset ? 1.f + to_float(w[j]) : to_float(w[j]));
      } else if constexpr (K == Kind::kGated) {
        y = y * to_float(w[j]) * silu(to_float(gate[row * d + j]));
      }
      orow[j] = from_float<O>(y);
    }
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

void check_weight(const char* op, const at::Tensor& w, int64_t d) {
  PH_CHECK(w.defined() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
           op, "w", "must be float32 or bfloat16");
  check_tensor(op, "w", w, 1, w.scalar_type());
  check_size(op, "w", w, 0, d, "x.size(1)");
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

void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, double eps,
              bool offset) {
  const char* op = "rms_norm";
  check_rows(op, x, out, x.scalar_type());
  check_weight(op, w, x.size(1));
  if (x.scalar_type() == at::kFloat) {
    by_weight<Kind::kRms, float, float>(x, nullptr, &w, out, eps, offset);
  } else {
    by_weight<Kind::kRms, c10::BFloat16, c10::BFloat16>(x, nullptr, &w, out, eps, offset);
  }
}

void gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& w,
                    at::Tensor out, double eps) {
  const char* op = "gated_rms_norm";
  check_rows(op, x, out, x.scalar_type());
  check_tensor(op, "gate", gate, 2, x.scalar_type());
  check_size(op, "gate", gate, 0, x.size(0), "x.size(0)");
  check_size(op, "gate", gate, 1, x.size(1), "x.size(1)");
  check_weight(op, w, x.size(1));
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
