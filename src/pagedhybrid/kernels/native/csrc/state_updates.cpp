// In-place decode updates of the fixed state pools of the linear-attention layers.
//
// gated_delta_decode -- one Gated DeltaNet recurrent step per sequence (one token each),
// reading and writing row `slots[b]` of the fp32 pool [S, Hv, Dv, Dk] (V-major) in one pass:
//   g = -exp(A_log[h]) * softplus(a + dt_bias[h])   (qwen gate)     beta = sigmoid(b)
//   for each state row s (Dv rows of Dk):  s *= exp(g);  r = s.k;  u = beta (v - r);
//                                          s += u k;     o = scale * (s.q)
// (two rows at a time, each loaded and stored once, where Dk is 1-16 whole vectors: gdn_rows)
// A `fresh` sequence starts from the zero state (its pool row is only written, never read).
// q, k: float32 [B, Hk, Dk] (already L2-normalised as the model does), v float32 [B, Hv, Dv],
// a, b float32 [B, Hv]; value head h reads key head h / (Hv / Hk). out float32 [B, Hv, Dv].
//
// causal_conv_decode -- one token of the depthwise causal conv per sequence, in place on row
// `slots[b]` of the conv pool [S, C, K-1] (the last K-1 inputs, oldest first):
//   y[c] = w[c, K-1] x[c] + sum_j w[c, j] state[c, j] (+ bias), optional SiLU (vec.h's
//   activate, kLanes channels at a time); the state shifts by one column and takes x. `fresh`
//   rows read zeros instead of the pool. T = pool dtype.
//
// gated_delta_varlen / causal_conv_varlen -- the same recurrences over every token of packed
// sequences (cu_seqlens int32 [B+1]), token after token, in place on the pool rows. Both
// kinds of kernel run one token through the same out-of-line function (`gdn_token`,
// `conv_token`), so a token's arithmetic -- and every bit of its output and of the state -- is
// the same whether it came in a decode step, a prefill chunk of any length or a batch of any
// composition (the batch-invariant mode's linear layers; the chunked WY form is faster but its
// arithmetic depends on where the chunk boundaries fall).
//
// gated_delta_capture / gated_delta_replay / commit_replay (a speculative verify step) and
// gdn_decode_mixer (a decode step's whole mixer) run these token functions too: gdn_mixer.cpp
// (state_updates.h: what the two share).
//
// Every op checks its inputs before touching a pool (GdnCall, check_conv): shapes, dtypes, the
// head ratio (Hv a multiple of Hk), cu_seqlens (from 0, non-decreasing, ending at the token
// rows), and the slots -- each in [0, S), none repeated (two sequences on one row would update
// it at once). Items are (sequence, value head) for GDN and sequences for the conv, claimed
// dynamically in one region; calls below common.h's kInlineWork run inline.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "state_updates.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// Rows r0, r0 + 1 of a state whose Dk = NV vectors: each row is loaded once, decayed, dotted
// with k, updated and dotted with q in registers, and stored once. The two rows' chains are
// independent, so their latencies overlap; each dot is two partial sums (even / odd vectors).
template <int NV>
inline void gdn_row_pair(float* s0, float* s1, const float* kv, const float* qv, float v0,
                         float v1, VF decay, float beta, bool zero, float sc, float* o,
                         float* u) {
  VF x0[NV], x1[NV];
  float r0 = 0.f, r1 = 0.f;
  if (!zero) {
    VF a0 = pagedhybrid::zero(), a1 = pagedhybrid::zero(), b0 = a0, b1 = a0;
    for (int i = 0; i < NV; ++i) {
      const VF k = load(kv + i * kLanes);
      x0[i] = mul(load(s0 + i * kLanes), decay);
      x1[i] = mul(load(s1 + i * kLanes), decay);
      if (i % 2 == 0) {
        a0 = fma(x0[i], k, a0);
        b0 = fma(x1[i], k, b0);
      } else {
        a1 = fma(x0[i], k, a1);
        b1 = fma(x1[i], k, b1);
      }
    }
    r0 = reduce_add(add(a0, a1));
    r1 = reduce_add(add(b0, b1));
  }
  const float d0 = beta * (v0 - r0), d1 = beta * (v1 - r1);
  if (u != nullptr) u[0] = d0, u[1] = d1;
  const VF u0 = bcast(d0), u1 = bcast(d1);
  VF a0 = pagedhybrid::zero(), a1 = pagedhybrid::zero(), b0 = a0, b1 = a0;
  for (int i = 0; i < NV; ++i) {
    const VF k = load(kv + i * kLanes), q = load(qv + i * kLanes);
    const VF y0 = zero ? mul(u0, k) : fma(u0, k, x0[i]);
    const VF y1 = zero ? mul(u1, k) : fma(u1, k, x1[i]);
    store(s0 + i * kLanes, y0);
    store(s1 + i * kLanes, y1);
    if (i % 2 == 0) {
      a0 = fma(y0, q, a0);
      b0 = fma(y1, q, b0);
    } else {
      a1 = fma(y0, q, a1);
      b1 = fma(y1, q, b1);
    }
  }
  o[0] = sc * reduce_add(add(a0, a1));
  o[1] = sc * reduce_add(add(b0, b1));
}

template <int NV>
void gdn_rows(float* state, const float* qv, const float* kv, const float* vv, float decay,
              float beta, bool zero, int64_t dv, float sc, float* o, float* u) {
  const VF d = bcast(decay);
  constexpr int64_t dk = NV * kLanes;
  for (int64_t r = 0; r + 1 < dv; r += 2)
    gdn_row_pair<NV>(state + r * dk, state + (r + 1) * dk, kv, qv, vv[r], vv[r + 1], d, beta,
                     zero, sc, o + r, u != nullptr ? u + r : nullptr);
  if (dv % 2) {  // the last row paired with a scratch copy of itself
    float scratch[dk], out2[2], u2[2];
    float* last = state + (dv - 1) * dk;
    for (int64_t e = 0; e < dk; ++e) scratch[e] = last[e];
    gdn_row_pair<NV>(last, scratch, kv, qv, vv[dv - 1], vv[dv - 1], d, beta, zero, sc, out2, u2);
    o[dv - 1] = out2[0];
    if (u != nullptr) u[dv - 1] = u2[0];
  }
}

}  // namespace

// shared with gdn_mixer.cpp (state_updates.h)

// One Gated DeltaNet token of one value head: state [Dv, Dk] advanced in place, o [Dv] written
// (and, with `cap`, its decay and delta). Dk of 1, 2, 4, 8 or 16 whole vectors runs gdn_rows (the
// two dots of a row in registers); any other Dk the scalar loops below.
__attribute__((noinline)) void gdn_token(float* state, const float* qv, const float* kv,
                                         const float* vv, float a, float b, float a_log,
                                         float dt_bias, bool zero, int64_t dv, int64_t dk,
                                         float sc, float* o, const TokenCapture* cap) {
  const float g = -std::exp(a_log) * softplus(a + dt_bias);
  const float decay = std::exp(g);
  const float beta = 1.f / (1.f + std::exp(-b));
  float* u = nullptr;
  if (cap != nullptr) *cap->decay = decay, u = cap->delta;
  if (dk % kLanes == 0) {
    switch (dk / kLanes) {
      case 1: return gdn_rows<1>(state, qv, kv, vv, decay, beta, zero, dv, sc, o, u);
      case 2: return gdn_rows<2>(state, qv, kv, vv, decay, beta, zero, dv, sc, o, u);
      case 4: return gdn_rows<4>(state, qv, kv, vv, decay, beta, zero, dv, sc, o, u);
      case 8: return gdn_rows<8>(state, qv, kv, vv, decay, beta, zero, dv, sc, o, u);
      case 16: return gdn_rows<16>(state, qv, kv, vv, decay, beta, zero, dv, sc, o, u);
      default: break;
    }
  }
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
    if (cap != nullptr) cap->delta[r] = u;
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

namespace {

void gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                        const at::Tensor& dt_bias, at::Tensor pool, const at::Tensor& slots,
                        const at::Tensor& fresh, at::Tensor out, double scale) {
  constexpr const char* op = "gated_delta_decode";
  PH_CHECK(q.dim() >= 1, op, "q", "must be [B, Hk, Dk] (got shape ", shape_of(q), ")");
  const GdnCall call(op, q.size(0), q, k, v, a, b, a_log, dt_bias, pool, slots, fresh, out,
                     scale);
  const int64_t n = q.size(0) * call.hv, w = call.token_work();
  parallel_items(n, std::max<int64_t>(1, kInlineWork / w), n * w, [&](int64_t item) {
    const int64_t bb = item / call.hv;
    call.token(bb, bb, item % call.hv, call.fresh[bb]);
  });
}

// Every token of sequence b (rows cu[b] .. cu[b+1]-1 of q, k, v, a, b, out) in order.
void gated_delta_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                        const at::Tensor& dt_bias, at::Tensor pool, const at::Tensor& slots,
                        const at::Tensor& fresh, const at::Tensor& cu_seqlens, at::Tensor out,
                        double scale) {
  constexpr const char* op = "gated_delta_varlen";
  const int64_t batch = varlen_batch(op, cu_seqlens);
  const GdnCall call(op, batch, q, k, v, a, b, a_log, dt_bias, pool, slots, fresh, out, scale);
  const int32_t* cu = check_cu_seqlens(op, cu_seqlens, batch, q.size(0));
  const int64_t w = call.token_work();
  parallel_items(batch * call.hv, 1, q.size(0) * call.hv * w, [&](int64_t item) {
    const int64_t bb = item / call.hv, h = item % call.hv;
    for (int64_t t = cu[bb]; t < cu[bb + 1]; ++t)
      call.token(t, bb, h, call.fresh[bb] && t == cu[bb]);
  });
}

}  // namespace

// shared with gdn_mixer.cpp (state_updates.h)

template <typename T>
__attribute__((noinline)) void conv_token(T* state, const T* x, const T* wp, const T* bp,
                                          bool zero, int64_t ch, int64_t kk, bool silu, T* out) {
  const int64_t st = kk - 1;
  alignas(64) float y[kLanes];
  for (int64_t c0 = 0; c0 < ch; c0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, ch - c0));
    for (int i = 0; i < n; ++i) {
      const int64_t c = c0 + i;
      const T* w = wp + c * kk;
      T* s = state + c * st;
      float yc = to_float(w[st]) * to_float(x[c]) + (bp != nullptr ? to_float(bp[c]) : 0.f);
      if (!zero)
        for (int64_t j = 0; j < st; ++j) yc += to_float(w[j]) * to_float(s[j]);
      y[i] = yc;
      if (st > 0) {
        if (zero) {
          for (int64_t j = 0; j + 1 < st; ++j) s[j] = from_float<T>(0.f);
        } else {
          for (int64_t j = 0; j + 1 < st; ++j) s[j] = s[j + 1];
        }
        s[st - 1] = x[c];
      }
    }
    if (silu) silu_lanes(y, n);  // vec.h's silu, kLanes channels at a time
    for (int i = 0; i < n; ++i) out[c0 + i] = from_float<T>(y[i]);
  }
}

// the mixer's forms (gdn_mixer.cpp; the ops here run float32, bfloat16 and float16)
template void conv_token(float*, const float*, const float*, const float*, bool, int64_t,
                         int64_t, bool, float*);
template void conv_token(c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                         const c10::BFloat16*, bool, int64_t, int64_t, bool, c10::BFloat16*);

namespace {

// cu == nullptr: one token per sequence (decode); else tokens cu[b] .. cu[b+1]-1 in order.
template <typename T>
void conv_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
               at::Tensor& pool, const at::Tensor& slots, const at::Tensor& fresh,
               const int32_t* cu, int64_t batch, at::Tensor& out, bool silu) {
  const int64_t ch = x.size(1), kk = weight.size(1), st = kk - 1;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  T* pp = pool.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  const int64_t w = ch * kk;  // multiply-adds of one token
  parallel_items(batch, cu != nullptr ? 1 : std::max<int64_t>(1, kInlineWork / w),
                 x.size(0) * w, [&](int64_t bb) {
    const int64_t t0 = cu != nullptr ? cu[bb] : bb, t1 = cu != nullptr ? cu[bb + 1] : bb + 1;
    for (int64_t t = t0; t < t1; ++t)
      conv_token<T>(pp + sl[bb] * ch * st, xp + t * ch, wp, bp, fr[bb] && t == t0, ch, kk, silu,
                    op + t * ch);
  });
}

// x [T, C]; weight [C, K] (K >= 1); bias [C] or none; pool [S, C, K-1]; out [T, C] -- one dtype
// (float32, bfloat16 or float16), contiguous; slots int64 [B] distinct in [0, S); fresh bool [B].
void check_conv(const char* op, int64_t batch, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias, const at::Tensor& pool,
                const at::Tensor& slots, const at::Tensor& fresh, const at::Tensor& out) {
  PH_CHECK(x.defined() && x.dim() == 2, op, "x", "must be [T, C] (got shape ",
           x.defined() ? shape_of(x) : std::string("none"), ")");
  const auto dt = x.scalar_type();
  PH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, "x",
           "dtype must be float32, bfloat16 or float16 (got ", dt, ")");
  check_tensor(op, "x", x, 2, dt);
  const int64_t ch = x.size(1);
  check_tensor(op, "weight", weight, 2, dt);
  check_size(op, "weight", weight, 0, ch, "the channels of x");
  PH_CHECK(weight.size(1) >= 1, op, "weight", "the kernel width K must be >= 1 (got shape ",
           shape_of(weight), ")");
  if (bias.has_value()) {
    check_tensor(op, "bias", *bias, 1, dt);
    check_size(op, "bias", *bias, 0, ch, "the channels of x");
  }
  check_tensor(op, "pool", pool, 3, dt);
  check_size(op, "pool", pool, 1, ch, "the channels of x");
  check_size(op, "pool", pool, 2, weight.size(1) - 1, "the kernel width - 1");
  check_tensor(op, "out", out, 2, dt);
  PH_CHECK(out.sizes() == x.sizes(), op, "out", "must have x's shape ", shape_of(x), " (got ",
           shape_of(out), ")");
  check_slots(op, slots, batch, pool.size(0));
  check_tensor(op, "fresh", fresh, 1, at::kBool);
  check_size(op, "fresh", fresh, 0, batch, "the number of sequences");
}

void run_conv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
              at::Tensor& pool, const at::Tensor& slots, const at::Tensor& fresh,
              const int32_t* cu, int64_t batch, at::Tensor& out, bool silu) {
  const at::Tensor* bp = bias.has_value() ? &bias.value() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    conv_impl<float>(x, weight, bp, pool, slots, fresh, cu, batch, out, silu);
  } else if (x.scalar_type() == at::kBFloat16) {
    conv_impl<c10::BFloat16>(x, weight, bp, pool, slots, fresh, cu, batch, out, silu);
  } else {
    conv_impl<c10::Half>(x, weight, bp, pool, slots, fresh, cu, batch, out, silu);
  }
}

void causal_conv_decode(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, at::Tensor pool,
                        const at::Tensor& slots, const at::Tensor& fresh, at::Tensor out,
                        bool silu) {
  constexpr const char* op = "causal_conv_decode";
  check_conv(op, x.defined() && x.dim() == 2 ? x.size(0) : 0, x, weight, bias, pool, slots,
             fresh, out);
  run_conv(x, weight, bias, pool, slots, fresh, nullptr, x.size(0), out, silu);
}

void causal_conv_varlen(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, at::Tensor pool,
                        const at::Tensor& slots, const at::Tensor& fresh,
                        const at::Tensor& cu_seqlens, at::Tensor out, bool silu) {
  constexpr const char* op = "causal_conv_varlen";
  const int64_t batch = varlen_batch(op, cu_seqlens);
  check_conv(op, batch, x, weight, bias, pool, slots, fresh, out);
  const int32_t* cu = check_cu_seqlens(op, cu_seqlens, batch, x.size(0));
  run_conv(x, weight, bias, pool, slots, fresh, cu, batch, out, silu);
}

}  // namespace
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def(
      "gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor a_log, "
      "Tensor dt_bias, Tensor(a!) pool, Tensor slots, Tensor fresh, Tensor(b!) out, "
      "float scale) -> ()");
  m.def(
      "causal_conv_decode(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) pool, Tensor slots, "
      "Tensor fresh, Tensor(b!) out, bool silu) -> ()");
  m.def(
      "gated_delta_varlen(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor a_log, "
      "Tensor dt_bias, Tensor(a!) pool, Tensor slots, Tensor fresh, Tensor cu_seqlens, "
      "Tensor(b!) out, float scale) -> ()");
  m.def(
      "causal_conv_varlen(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) pool, Tensor slots, "
      "Tensor fresh, Tensor cu_seqlens, Tensor(b!) out, bool silu) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("gated_delta_decode", &pagedhybrid::gated_delta_decode);
  m.impl("causal_conv_decode", &pagedhybrid::causal_conv_decode);
  m.impl("gated_delta_varlen", &pagedhybrid::gated_delta_varlen);
  m.impl("causal_conv_varlen", &pagedhybrid::causal_conv_varlen);
}
