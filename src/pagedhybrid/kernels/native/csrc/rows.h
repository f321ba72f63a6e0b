// One row of the decoder's row-wise norms (norms.cpp), shared with the fused Gated DeltaNet
// decode (gdn_mixer.cpp) so both compute every bit alike:
//
//   Kind::kRms    out = x * rsqrt(mean(x^2) + eps) * (offset ? 1 + w : w)
//   Kind::kGated  out = x * rsqrt(mean(x^2) + eps) * w * silu(gate)
//   Kind::kL2     out = x * rsqrt(sum(x^2) + eps)
//
// fp32 arithmetic in the order the torch layers write it (kernels/registry.py TORCH_NORMS); the
// sum of squares in kLanes partial sums then reduce_add (one fixed order whatever the batch);
// silu is vec.h's lane code (`activate`, as pointwise.cpp's), kLanes gates at a time; rounded
// once into O.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "vec.h"

namespace pagedhybrid {

// A norm's weight: float32 or bfloat16, [d], contiguous (`what` names d in the message).
inline void check_norm_weight(const char* op, const char* arg, const at::Tensor& w, int64_t d,
                              const char* what) {
  PH_CHECK(w.defined() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
           op, arg, "must be float32 or bfloat16");
  check_tensor(op, arg, w, 1, w.scalar_type());
  check_size(op, arg, w, 0, d, what);
}

template <typename T>
inline float sum_squares(const T* x, int64_t d) {
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

enum class Kind { kRms, kGated, kL2 };

template <Kind K, typename T, typename W, typename O>
inline void norm_row(const T* xr, const T* gr, const W* w, O* orow, int64_t d, float eps,
                     bool offset) {
  const float ss = sum_squares(xr, d);
  const float inv = 1.f / std::sqrt(K == Kind::kL2 ? ss + eps : ss / static_cast<float>(d) + eps);
  alignas(64) float gate[kLanes];
  for (int64_t j0 = 0; j0 < d; j0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, d - j0));
    if constexpr (K == Kind::kGated) {
      for (int i = 0; i < n; ++i) gate[i] = to_float(gr[j0 + i]);
      silu_lanes(gate, n);
    }
    for (int64_t j = j0; j < j0 + n; ++j) {
      float y = to_float(xr[j]) * inv;
      if constexpr (K == Kind::kRms) {
        y = y * (offset ? 1.f + to_float(w[j]) : to_float(w[j]));
      } else if constexpr (K == Kind::kGated) {
        y = y * to_float(w[j]) * gate[j - j0];
      }
      orow[j] = from_float<O>(y);
    }
  }
}

}  // namespace pagedhybrid
