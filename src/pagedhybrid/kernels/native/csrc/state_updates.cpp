// In-place decode updates of the fixed state pools of the linear-attention layers.
//
// gated_delta_decode -- one Gated DeltaNet recurrent step per sequence (one token each),
// reading and writing row `slots[b]` of the fp32 pool [S, Hv, Dv, Dk] (V-major) in one pass:
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h])   (qwen gate)     beta = sigmoid(b)
//   for each state row s (Dv rows of Dk):  s *= exp(g);  r = s.k;  u = beta (v - r);
//                                          s += u k;     o = scale * (s.q)
// A `fresh` sequence starts from the zero state (its pool row is only written, never read).
// q, k: float32 [B, Hk, Dk] (already L2-normalised as the model does), v float32 [B, Hv, Dv],
// a, b float32 [B, Hv]; value head h reads key head h / (Hv / Hk). out float32 [B, Hv, Dv].
//
// causal_conv_decode -- one token of the depthwise causal conv per sequence, in place on row
// `slots[b]` of the conv pool [S, C, K-1] (the last K-1 inputs, oldest first):
//   y[c] = w[c, K-1] x[c] + sum_j w[c, j] state[c, j] (+ bias), optional SiLU; the state shifts
//   by one column and takes x. `fresh` rows read zeros instead of the pool. T = pool dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>

#include "vec.h"

namespace pagedhybrid {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                        const at::Tensor& dt_bias, at::Tensor pool, const at::Tensor& slots,
                        const at::Tensor& fresh, at::Tensor out, double scale) {
  const std::array<const at::Tensor*, 9> all{&q, &k, &v, &a, &b, &a_log, &dt_bias, &pool, &out};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->dtype() == at::kFloat && t->is_contiguous(), "float32 contiguous expected");
  TORCH_CHECK(slots.dtype() == at::kLong && fresh.dtype() == at::kBool, "slots int64, fresh bool");
  const int64_t batch = v.size(0), hv = v.size(1), dv = v.size(2), hk = q.size(1),
                dk = q.size(2);
  TORCH_CHECK(pool.size(1) == hv && pool.size(2) == dv && pool.size(3) == dk, "pool shape");
  const int64_t ratio = hv / hk;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* alog = a_log.data_ptr<float>();
  const float* dtb = dt_bias.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  float* pp = pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, batch * hv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t bb = item / hv, h = item % hv;
      const float* qv = qp + (bb * hk + h / ratio) * dk;
      const float* kv = kp + (bb * hk + h / ratio) * dk;
      const float* vv = vp + (bb * hv + h) * dv;
      const float g = -std::exp(alog[h]) * softplus(ap[bb * hv + h] + dtb[h]);
      const float decay = std::exp(g);
      const float beta = 1.f / (1.f + std::exp(-bp[bb * hv + h]));
      float* state = pp + (sl[bb] * hv + h) * dv * dk;
      float* o = op + (bb * hv + h) * dv;
      const bool zero = fr[bb];
      for (int64_t r = 0; r < dv; ++r) {
        float* s = state + r * dk;
        float dot_k = 0.f;
        if (!zero) {
#pragma omp simd reduction(+ : dot_k)
          for (int64_t e = 0; e < dk; ++e) {
            s[e] *= decay;
            dot_k += s[e] * kv[e];
          }
        }
        const float u = beta * (vv[r] - dot_k);
        float dot_q = 0.f;
        if (zero) {
#pragma omp simd reduction(+ : dot_q)
          for (int64_t e = 0; e < dk; ++e) {
            s[e] = u * kv[e];
            dot_q += s[e] * qv[e];
          }
        } else {
#pragma omp simd reduction(+ : dot_q)
          for (int64_t e = 0; e < dk; ++e) {
            s[e] += u * kv[e];
            dot_q += s[e] * qv[e];
          }
        }
        o[r] = sc * dot_q;
      }
    }
  });
}

template <typename T>
void conv_decode_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
                      at::Tensor& pool, const at::Tensor& slots, const at::Tensor& fresh,
                      at::Tensor& out, bool silu) {
  const int64_t batch = x.size(0), ch = x.size(1), kk = weight.size(1), st = kk - 1;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  T* pp = pool.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  at::parallel_for(0, batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t bb = lo; bb < hi; ++bb) {
      T* state = pp + sl[bb] * ch * st;
      const bool zero = fr[bb];
      for (int64_t c = 0; c < ch; ++c) {
        const float xc = to_float(xp[bb * ch + c]);
        const T* w = wp + c * kk;
        T* s = state + c * st;
        float y = to_float(w[st]) * xc + (bp != nullptr ? to_float(bp[c]) : 0.f);
        if (!zero)
          for (int64_t j = 0; j < st; ++j) y += to_float(w[j]) * to_float(s[j]);
        if (silu) y = y / (1.f + std::exp(-y));
        op[bb * ch + c] = from_float<T>(y);
        if (st > 0) {
          if (zero) {
            for (int64_t j = 0; j + 1 < st; ++j) s[j] = from_float<T>(0.f);
          } else {
            for (int64_t j = 0; j + 1 < st; ++j) s[j] = s[j + 1];
          }
          s[st - 1] = xp[bb * ch + c];
        }
      }
    }
  });
}

void causal_conv_decode(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, at::Tensor pool,
                        const at::Tensor& slots, const at::Tensor& fresh, at::Tensor out,
                        bool silu) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && pool.is_contiguous() &&
                  out.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(x.dtype() == weight.dtype() && x.dtype() == pool.dtype() &&
                  x.dtype() == out.dtype(), "x, weight, pool and out must share a dtype");
  TORCH_CHECK(slots.dtype() == at::kLong && fresh.dtype() == at::kBool, "slots int64, fresh bool");
  TORCH_CHECK(pool.size(2) == weight.size(1) - 1, "pool holds K-1 columns");
  const at::Tensor* bp = bias.has_value() ? &bias.value() : nullptr;
  if (x.dtype() == at::kFloat) {
    conv_decode_impl<float>(x, weight, bp, pool, slots, fresh, out, silu);
  } else if (x.dtype() == at::kBFloat16) {
    conv_decode_impl<c10::BFloat16>(x, weight, bp, pool, slots, fresh, out, silu);
  } else if (x.dtype() == at::kHalf) {
    conv_decode_impl<c10::Half>(x, weight, bp, pool, slots, fresh, out, silu);
  } else {
    TORCH_CHECK(false, "dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(pagedhybrid, m) {
  m.def(
      "gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor a_log, "
      "Tensor dt_bias, Tensor(a!) pool, Tensor slots, Tensor fresh, Tensor(b!) out, "
      "float scale) -> ()");
  m.def(
      "causal_conv_decode(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) pool, Tensor slots, "
      "Tensor fresh, Tensor(b!) out, bool silu) -> ()");
}

TORCH_LIBRARY_IMPL(pagedhybrid, CPU, m) {
  m.impl("gated_delta_decode", &pagedhybrid::gated_delta_decode);
  m.impl("causal_conv_decode", &pagedhybrid::causal_conv_decode);
}
