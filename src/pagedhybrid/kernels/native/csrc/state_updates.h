// What the state updates' two files share: state_updates.cpp (the decode and varlen
// recurrences: the Gated DeltaNet and the causal conv) defines the one out-of-line token
// function of each, which gdn_mixer.cpp (a verify step's capture and the fused mixer) runs
// too -- so a token's every bit is the same whichever op runs it -- and GdnCall, the checked
// tensors of a GDN call. Hidden visibility, as kernels.h's: every CPU form's library has its
// own.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <utility>

#include "common.h"
#include "kernels.h"

namespace pagedhybrid {

// What a verify step keeps of one token of one value head: the decay exp(g) and the delta
// u [Dv] that the update adds as u k^T (the rest of ORT's capsule, the key, is the input row).
struct TokenCapture {
  float* decay;
  float* delta;
};

// One Gated DeltaNet token of one value head: state [Dv, Dk] advanced in place, o [Dv] written
// (and, with `cap`, its decay and delta).
PH_LOCAL void gdn_token(float* state, const float* qv, const float* kv, const float* vv, float a,
                        float b, float a_log, float dt_bias, bool zero, int64_t dv, int64_t dk,
                        float sc, float* o, const TokenCapture* cap = nullptr);

// One token of the depthwise causal conv: state [C, K-1] advanced in place (read as zeros when
// `zero`), out [C] = the conv of x [C] by wp [C, K] (+ bp [C]), SiLU when `silu` (T: float,
// c10::BFloat16 or c10::Half; float and c10::BFloat16 instantiated for gdn_mixer.cpp).
template <typename T>
PH_LOCAL void conv_token(T* state, const T* x, const T* wp, const T* bp, bool zero, int64_t ch,
                         int64_t kk, bool silu, T* out);

namespace {  // internal linkage: every CPU form's library has its own copy

// The tensors of a GDN call, checked once; token(t, b, h, zero) runs token row t of value head h
// on sequence b's pool row.
struct GdnCall {
  const float *q, *k, *v, *a, *b, *a_log, *dt_bias;
  const int64_t* slots;
  const bool* fresh;
  float *pool, *out;
  int64_t hv, dv, hk, dk, ratio;
  float scale;

  // q, k [T, Hk, Dk]; v [T, Hv, Dv]; a, b [T, Hv]; a_log, dt_bias [Hv]; pool [S, Hv, Dv, Dk];
  // out [T, Hv, Dv] (all float32, contiguous); Hv a multiple of Hk; slots int64 [B] distinct in
  // [0, S); fresh bool [B].
  GdnCall(const char* op, int64_t batch, const at::Tensor& q_, const at::Tensor& k_,
          const at::Tensor& v_, const at::Tensor& a_, const at::Tensor& b_,
          const at::Tensor& a_log_, const at::Tensor& dt_bias_, at::Tensor& pool_,
          const at::Tensor& slots_, const at::Tensor& fresh_, at::Tensor& out_, double scale_) {
    check_tensor(op, "q", q_, 3, at::kFloat);
    const int64_t t = q_.size(0);
    hk = q_.size(1), dk = q_.size(2);
    check_tensor(op, "k", k_, 3, at::kFloat);
    PH_CHECK(k_.sizes() == q_.sizes(), op, "k", "must have q's shape ", shape_of(q_), " (got ",
             shape_of(k_), ")");
    check_tensor(op, "v", v_, 3, at::kFloat);
    check_size(op, "v", v_, 0, t, "the token rows of q");
    hv = v_.size(1), dv = v_.size(2);
    PH_CHECK(hk >= 1 && hv % hk == 0, op, "v", "head ratio: the value heads (", hv,
             ") must be a multiple of the key heads of q and k (", hk, ")");
    const std::array<std::pair<const char*, const at::Tensor*>, 2> ab{{{"a", &a_}, {"b", &b_}}};
    for (const auto& [name, x] : ab) {
      check_tensor(op, name, *x, 2, at::kFloat);
      check_size(op, name, *x, 0, t, "the token rows of q");
      check_size(op, name, *x, 1, hv, "the value heads of v");
    }
    const std::array<std::pair<const char*, const at::Tensor*>, 2> per_head{
        {{"a_log", &a_log_}, {"dt_bias", &dt_bias_}}};
    for (const auto& [name, x] : per_head) {
      check_tensor(op, name, *x, 1, at::kFloat);
      check_size(op, name, *x, 0, hv, "the value heads of v");
    }
    check_tensor(op, "pool", pool_, 4, at::kFloat);
    check_size(op, "pool", pool_, 1, hv, "the value heads of v");
    check_size(op, "pool", pool_, 2, dv, "the value head size of v");
    check_size(op, "pool", pool_, 3, dk, "the key head size of q");
    check_tensor(op, "out", out_, 3, at::kFloat);
    PH_CHECK(out_.sizes() == v_.sizes(), op, "out", "must have v's shape ", shape_of(v_),
             " (got ", shape_of(out_), ")");
    check_slots(op, slots_, batch, pool_.size(0));
    check_tensor(op, "fresh", fresh_, 1, at::kBool);
    check_size(op, "fresh", fresh_, 0, batch, "the number of sequences");
    q = q_.data_ptr<float>(), k = k_.data_ptr<float>(), v = v_.data_ptr<float>();
    a = a_.data_ptr<float>(), b = b_.data_ptr<float>();
    a_log = a_log_.data_ptr<float>(), dt_bias = dt_bias_.data_ptr<float>();
    slots = slots_.data_ptr<int64_t>(), fresh = fresh_.data_ptr<bool>();
    pool = pool_.data_ptr<float>(), out = out_.data_ptr<float>();
    ratio = hv / hk;
    scale = static_cast<float>(scale_);
  }

  int64_t token_work() const { return 4 * dv * dk; }  // multiply-adds of one token and head

  void token(int64_t t, int64_t bb, int64_t h, bool zero) const {
    gdn_token(pool + (slots[bb] * hv + h) * dv * dk, q + (t * hk + h / ratio) * dk,
              k + (t * hk + h / ratio) * dk, v + (t * hv + h) * dv, a[t * hv + h], b[t * hv + h],
              a_log[h], dt_bias[h], zero, dv, dk, scale, out + (t * hv + h) * dv);
  }
};

}  // namespace
}  // namespace pagedhybrid
