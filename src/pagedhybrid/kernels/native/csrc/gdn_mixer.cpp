// The Gated DeltaNet state updates of a speculative verify step, and the fused mixer of a
// decode step; both run their tokens through state_updates.cpp's token functions (gdn_token,
// conv_token: state_updates.h), so every bit equals the in-place ops'.
//
// gated_delta_capture / gated_delta_replay -- a speculative verify step: the verify sequences'
// tokens run through gdn_token on a copy of their pool rows (never written), capturing ONNX
// Runtime's compact state update per token (decay, key, delta) into a capsule indexed by slot;
// once the accepted count is known, replay advances the pool row by the accepted tokens alone;
// commit_replay does that for every linear layer's conv and recurrent rows in one call.
//
// gdn_decode_mixer -- a decode step's whole Gated DeltaNet mixer, from the layer's projections
// (contiguous, or row views of a wider product) to the gated-norm output: conv_token + SiLU, rows.h's L2
// norms of q and k, gdn_token, the rounding to the model dtype and rows.h's gated norm with z --
// the functions the separate ops run, so every bit equals running them in turn.
//
// Every op checks its inputs (GdnCall, Capsule, check_row_view) before touching a pool or a
// capsule, as state_updates.cpp's do.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <cmath>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>

#include "common.h"
#include "kernels.h"
#include "rows.h"
#include "state_updates.h"
#include "vec.h"

namespace pagedhybrid {
namespace {

// The capsule of a verify step, indexed by state slot: decay [S, C, Hv], key [S, C, Hk, Dk],
// delta [S, C, Hv, Dv], float32, contiguous (C: the capsule's token capacity).
struct Capsule {
  float *decay, *key, *delta;
  int64_t cap, hv, hk, dk, dv;

  Capsule(const char* op, const at::Tensor& decay_, const at::Tensor& key_,
          const at::Tensor& delta_, int64_t slots, int64_t hv_, int64_t hk_, int64_t dk_,
          int64_t dv_)
      : hv(hv_), hk(hk_), dk(dk_), dv(dv_) {
    check_tensor(op, "decay", decay_, 3, at::kFloat);
    cap = decay_.size(1);
    const std::array<std::pair<const char*, std::vector<int64_t>>, 3> want{
        {{"decay", {slots, cap, hv}}, {"key", {slots, cap, hk, dk}},
         {"delta", {slots, cap, hv, dv}}}};
    const std::array<const at::Tensor*, 3> got{&decay_, &key_, &delta_};
    for (size_t i = 0; i < 3; ++i) {
      check_tensor(op, want[i].first, *got[i], static_cast<int64_t>(want[i].second.size()),
                   at::kFloat);
      PH_CHECK(got[i]->sizes() == at::IntArrayRef(want[i].second), op, want[i].first,
               "must be [slots, capacity, ...] = ", at::IntArrayRef(want[i].second),
               " (got shape ", shape_of(*got[i]), ")");
    }
    decay = decay_.data_ptr<float>(), key = key_.data_ptr<float>();
    delta = delta_.data_ptr<float>();
  }

  // Every captured sequence (verify[b], all when null) fits: at most `cap` tokens.
  void check_fits(const char* op, const char* what, const int32_t* cu, int64_t batch,
                  const bool* verify) const {
    for (int64_t bb = 0; bb < batch; ++bb)
      PH_CHECK((verify != nullptr && !verify[bb]) || cu[bb + 1] - cu[bb] <= cap, op,
               "cu_seqlens", what, " ", bb, " has ", cu[bb + 1] - cu[bb],
               " tokens, more than the capsule's capacity ", cap);
  }

  // Token j of state slot `slot`, value head h: where its decay and delta go.
  TokenCapture at(int64_t slot, int64_t j, int64_t h) const {
    const int64_t i = slot * cap + j;
    return TokenCapture{decay + i * hv + h, delta + (i * hv + h) * dv};
  }

  // Token j of state slot `slot`: its key row of key head kh.
  float* key_row(int64_t slot, int64_t j, int64_t kh) const {
    return key + ((slot * cap + j) * hk + kh) * dk;
  }
};

// gated_delta_capture -- the tokens of verify sequences (rows cu[b] .. cu[b+1]-1, at most the
// capsule's capacity each) from their pool rows, which are read and never written: each
// (sequence, value head) runs its tokens through gdn_token on a thread-local copy of its row
// and captures token j's decay and delta (and, once per key head, its key row) into capsule
// slot j of row slots[b]. out is what the in-place kernels compute for those tokens, bit for bit.
void gated_delta_capture(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                         const at::Tensor& dt_bias, at::Tensor pool, const at::Tensor& slots,
                         const at::Tensor& fresh, const at::Tensor& cu_seqlens, at::Tensor out,
                         double scale, at::Tensor decay, at::Tensor key, at::Tensor delta) {
  constexpr const char* op = "gated_delta_capture";
  const int64_t batch = varlen_batch(op, cu_seqlens);
  const GdnCall call(op, batch, q, k, v, a, b, a_log, dt_bias, pool, slots, fresh, out, scale);
  const int32_t* cu = check_cu_seqlens(op, cu_seqlens, batch, q.size(0));
  const Capsule capsule(op, decay, key, delta, pool.size(0), call.hv, call.hk, call.dk, call.dv);
  capsule.check_fits(op, "sequence", cu, batch, nullptr);
  const int64_t w = call.token_work(), row = call.dv * call.dk;
  parallel_items(batch * call.hv, 1, q.size(0) * call.hv * w, [&](int64_t item) {
    const int64_t bb = item / call.hv, h = item % call.hv, slot = call.slots[bb];
    thread_local std::vector<float> state;
    state.resize(row);
    const float* src = call.pool + (slot * call.hv + h) * row;
    std::copy(src, src + row, state.data());
    for (int64_t t = cu[bb]; t < cu[bb + 1]; ++t) {
      const int64_t j = t - cu[bb], kh = h / call.ratio;
      const TokenCapture tc = capsule.at(slot, j, h);
      gdn_token(state.data(), call.q + (t * call.hk + kh) * call.dk,
                call.k + (t * call.hk + kh) * call.dk, call.v + (t * call.hv + h) * call.dv,
                call.a[t * call.hv + h], call.b[t * call.hv + h], call.a_log[h], call.dt_bias[h],
                call.fresh[bb] && t == cu[bb], call.dv, call.dk, call.scale,
                call.out + (t * call.hv + h) * call.dv, &tc);
      if (h % call.ratio == 0) {
        const float* kr = call.k + (t * call.hk + kh) * call.dk;
        std::copy(kr, kr + call.dk, capsule.key_row(slot, j, kh));
      }
    }
  });
}

// A replay's recurrent pool [S, Hv, Dv, Dk] and its capsule, checked.
Capsule replay_capsule(const char* op, const at::Tensor& pool, const at::Tensor& decay,
                       const at::Tensor& key, const at::Tensor& delta) {
  check_tensor(op, "pool", pool, 4, at::kFloat);
  check_tensor(op, "key", key, 4, at::kFloat);
  const int64_t hv = pool.size(1), hk = key.size(2);
  PH_CHECK(hk >= 1 && hv % hk == 0, op, "key", "head ratio: the value heads (", hv,
           ") must be a multiple of the key heads (got shape ", shape_of(key), ")");
  return Capsule(op, decay, key, delta, pool.size(0), hv, hk, pool.size(3), pool.size(2));
}

// begin / end: int32 [B], 0 <= begin <= end <= the capsules' capacity for every sequence.
void check_ends(const char* op, const at::Tensor& begin, const at::Tensor& end, int64_t batch,
                int64_t cap) {
  const std::array<std::pair<const char*, const at::Tensor*>, 2> ends{
      {{"begin", &begin}, {"end", &end}}};
  for (const auto& [name, x] : ends) {
    check_tensor(op, name, *x, 1, at::kInt);
    check_size(op, name, *x, 0, batch, "the sequences of slots");
  }
  const int32_t *b0 = begin.data_ptr<int32_t>(), *b1 = end.data_ptr<int32_t>();
  for (int64_t bb = 0; bb < batch; ++bb)
    PH_CHECK(0 <= b0[bb] && b0[bb] <= b1[bb] && b1[bb] <= cap, op, "begin/end", "sequence ",
             bb, ": need 0 <= begin <= end <= capacity ", cap, " (got ", b0[bb], ", ", b1[bb],
             ")");
}

// Value head h of pool row `slot` advanced in place by capsule tokens t0 .. t1-1, each
// S = S exp(g) + delta k^T rounded as gdn_token rounds its update (the decayed row, then one
// fused multiply-add per element).
void replay_head(float* pool, const Capsule& c, int64_t slot, int64_t h, int64_t t0,
                 int64_t t1) {
  const int64_t dv = c.dv, dk = c.dk;
  float* s = pool + (slot * c.hv + h) * dv * dk;
  for (int64_t t = t0; t < t1; ++t) {
    const TokenCapture tc = c.at(slot, t, h);
    const float d = *tc.decay;
    const float* kv = c.key_row(slot, t, h / (c.hv / c.hk));
    const float* u = tc.delta;
    if (dk % kLanes == 0) {
      const VF dd = bcast(d);
      for (int64_t r = 0; r < dv; ++r) {
        const VF ur = bcast(u[r]);
        float* sr = s + r * dk;
        for (int64_t e = 0; e < dk; e += kLanes)
          store(sr + e, fma(ur, load(kv + e), mul(load(sr + e), dd)));
      }
    } else {
      for (int64_t r = 0; r < dv; ++r) {
        float* sr = s + r * dk;
#pragma omp simd
        for (int64_t e = 0; e < dk; ++e) sr[e] *= d;
#pragma omp simd
        for (int64_t e = 0; e < dk; ++e) sr[e] += u[r] * kv[e];
      }
    }
  }
}

// gated_delta_replay -- the commit of a verify step: pool row slots[b] advanced in place by its
// capsule's tokens begin[b] .. end[b]-1 (replay_head), so the row is bit for bit what running
// those tokens in place would have left.
void gated_delta_replay(at::Tensor pool, const at::Tensor& slots, const at::Tensor& decay,
                        const at::Tensor& key, const at::Tensor& delta, const at::Tensor& begin,
                        const at::Tensor& end) {
  constexpr const char* op = "gated_delta_replay";
  const Capsule capsule = replay_capsule(op, pool, decay, key, delta);
  PH_CHECK(slots.dim() == 1, op, "slots", "must be [B] (got shape ", shape_of(slots), ")");
  const int64_t batch = slots.size(0);
  check_slots(op, slots, batch, pool.size(0));
  check_ends(op, begin, end, batch, capsule.cap);
  const int32_t *b0 = begin.data_ptr<int32_t>(), *b1 = end.data_ptr<int32_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float* pp = pool.data_ptr<float>();
  const int64_t hv = capsule.hv;
  parallel_items(batch * hv, 1, batch * hv * capsule.dv * capsule.dk * capsule.cap,
                 [&](int64_t item) {
                   const int64_t bb = item / hv;
                   replay_head(pp, capsule, sl[bb], item % hv, b0[bb], b1[bb]);
                 });
}

// Conv row [C, L] (L = kernel - 1) advanced by capsule tokens t0 .. t1-1 of caps [cap, C]: the
// last L columns of [row | those tokens' inputs] (row copies: every bit kept).
template <typename E>
void replay_conv_row(E* row, const E* caps, int64_t channels, int64_t len, int64_t t0,
                     int64_t t1) {
  const int64_t n = t1 - t0;
  if (n == 0) return;
  for (int64_t c = 0; c < channels; ++c) {
    E* s = row + c * len;
    for (int64_t l = 0; l < len; ++l) {  // ascending: reads n + l >= l, not yet written
      const int64_t p = n + l;
      s[l] = p < len ? s[p] : caps[(t0 + p - len) * channels + c];
    }
  }
}

// commit_replay -- a verify step's whole commit in one call: for every linear layer i, conv
// pool rows slots[b] ([S, C, L], the model dtype) advanced by conv_capsules[i]'s input rows
// ([S, cap, C]) and recurrent pool rows by the layer's capsule (replay_head), tokens
// begin[b] .. end[b]-1 -- what the per-layer replays compute (capsule.replay_conv and
// gated_delta_replay), without a call per layer. Everything is checked before a row changes.
void commit_replay(at::TensorList conv_pools, at::TensorList conv_capsules, at::TensorList pools,
                   at::TensorList decays, at::TensorList keys, at::TensorList deltas,
                   const at::Tensor& slots, const at::Tensor& begin, const at::Tensor& end) {
  constexpr const char* op = "commit_replay";
  const size_t layers = pools.size();
  PH_CHECK(layers >= 1 && conv_pools.size() == layers && conv_capsules.size() == layers &&
               decays.size() == layers && keys.size() == layers && deltas.size() == layers,
           op, "pools", "need one conv pool, conv capsule, recurrent pool, decay, key and delta "
           "per linear layer (got ", conv_pools.size(), ", ", conv_capsules.size(), ", ", layers,
           ", ", decays.size(), ", ", keys.size(), ", ", deltas.size(), ")");
  PH_CHECK(slots.dim() == 1, op, "slots", "must be [B] (got shape ", shape_of(slots), ")");
  const int64_t batch = slots.size(0);
  std::vector<Capsule> caps;
  for (size_t i = 0; i < layers; ++i) {
    caps.push_back(replay_capsule(op, pools[i], decays[i], keys[i], deltas[i]));
    const at::Tensor &conv = conv_pools[i], &cc = conv_capsules[i];
    const auto dt = conv.scalar_type();
    PH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, "conv_pools",
             "must be float32, bfloat16 or float16 (got ", dt, ")");
    check_tensor(op, "conv_pools", conv, 3, dt);
    check_tensor(op, "conv_capsules", cc, 3, dt);
    check_size(op, "conv_pools", conv, 0, pools[i].size(0), "the recurrent pool's slots");
    PH_CHECK(cc.size(0) == conv.size(0) && cc.size(1) == caps[i].cap &&
                 cc.size(2) == conv.size(1), op, "conv_capsules", "must be [slots, capacity, "
             "channels] = [", conv.size(0), ", ", caps[i].cap, ", ", conv.size(1), "] (got ",
             shape_of(cc), ")");
    check_slots(op, slots, batch, pools[i].size(0));
    check_ends(op, begin, end, batch, caps[i].cap);
  }
  const int32_t *b0 = begin.data_ptr<int32_t>(), *b1 = end.data_ptr<int32_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t hv = caps[0].hv;
  for (const Capsule& c : caps)
    PH_CHECK(c.hv == hv, op, "pools", "every layer needs the same value heads (", hv, ")");
  const int64_t per = batch * hv;
  parallel_items(static_cast<int64_t>(layers) * per, 1,
                 static_cast<int64_t>(layers) * per * caps[0].dv * caps[0].dk * caps[0].cap,
                 [&](int64_t item) {
                   const int64_t i = item / per, bb = (item % per) / hv, h = item % hv;
                   replay_head(pools[i].data_ptr<float>(), caps[i], sl[bb], h, b0[bb], b1[bb]);
                   if (h != 0) return;
                   const at::Tensor &conv = conv_pools[i], &cc = conv_capsules[i];
                   const int64_t ch = conv.size(1), len = conv.size(2);
                   const int64_t off = sl[bb] * ch * len, coff = sl[bb] * cc.size(1) * ch;
                   if (conv.element_size() == 4) {
                     replay_conv_row(static_cast<uint32_t*>(conv.data_ptr()) + off,
                                     static_cast<const uint32_t*>(cc.data_ptr()) + coff, ch, len,
                                     b0[bb], b1[bb]);
                   } else {
                     replay_conv_row(static_cast<uint16_t*>(conv.data_ptr()) + off,
                                     static_cast<const uint16_t*>(cc.data_ptr()) + coff, ch, len,
                                     b0[bb], b1[bb]);
                   }
                 });
}

// A [R, cols] view whose rows may be spaced out (a column range of a wider projection): the
// last dimension contiguous, rows at a stride >= cols.
void check_row_view(const char* op, const char* arg, const at::Tensor& t, int64_t rows,
                    int64_t cols, at::ScalarType dtype) {
  PH_CHECK(t.defined(), op, arg, "must be a tensor");
  PH_CHECK(t.device().is_cpu(), op, arg, "must be a CPU tensor (got ", t.device(), ")");
  PH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, arg, "must be [", rows,
           ", ", cols, "] (got shape ", shape_of(t), ")");
  PH_CHECK(t.scalar_type() == dtype, op, arg, "must be ", dtype, " (got ", t.scalar_type(), ")");
  PH_CHECK(t.stride(1) == 1 && t.stride(0) >= cols, op, arg,
           "rows must be contiguous (stride(1) == 1, stride(0) >= ", cols, ")");
}

// The tokens of a mixer call: one row per sequence (decode: cu == nullptr), or rows cu[b] ..
// cu[b+1]-1 of sequence b, where verify[b] marks a speculative verify chunk: its conv and
// recurrent rows are read into thread-local copies and never written, and each token's conv
// input row (capsule_conv [S, C, channels], the model dtype) and compact state update (caps)
// are captured into capsule slot j of row slots[b].
template <typename T>
struct MixerChunks {
  const int32_t* cu = nullptr;
  const bool* verify = nullptr;
  T* capsule_conv = nullptr;
  const Capsule* caps = nullptr;
  int64_t batch = 0;

  int64_t first(int64_t bb) const { return cu != nullptr ? cu[bb] : bb; }
  int64_t last(int64_t bb) const { return cu != nullptr ? cu[bb + 1] : bb + 1; }
  bool verifying(int64_t bb) const { return verify != nullptr && verify[bb]; }
};

// The Gated DeltaNet mixer of a decode step (or a step of decodes and verify chunks), in one
// call: the conv (+ SiLU) on the q|k|v projection, the L2 norms of q and k, the recurrent step,
// the rounding of its output to the model dtype and the gated RMS norm with z -- each by the
// very function the separate ops run (conv_token, rows.h's norm_row, gdn_token), so every bit
// equals running causal_conv_decode / causal_conv_varlen, l2_normalize (x2),
// gated_delta_decode / gated_delta_capture and gated_rms_norm in turn.
template <typename T>
void gdn_mixer_impl(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& a,
                    const at::Tensor& b, const at::Tensor& conv_weight, at::Tensor& conv_pool,
                    const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor& pool,
                    const int64_t* slots, const bool* fresh, const at::Tensor& norm_weight,
                    at::Tensor& out, int64_t hk, double scale, double l2_eps, double norm_eps,
                    const MixerChunks<T>& chunks) {
  const int64_t rows = qkv.size(0), ch = qkv.size(1), kk = conv_weight.size(1), st = kk - 1;
  const int64_t batch = chunks.batch;
  const int64_t hv = pool.size(1), dv = pool.size(2), dk = pool.size(3), ratio = hv / hk;
  const int64_t qk = 2 * hk;  // normalised q and k rows per token
  at::Tensor mixed = at::empty({rows, ch}, qkv.options());
  at::Tensor qkn = at::empty({rows, qk, dk}, qkv.options().dtype(at::kFloat));
  at::Tensor vf = at::empty({rows, hv, dv}, qkv.options().dtype(at::kFloat));
  const T* xp = qkv.data_ptr<T>();
  const T* wp = conv_weight.data_ptr<T>();
  T* cp = conv_pool.data_ptr<T>();
  T* mp = mixed.data_ptr<T>();
  float* qp = qkn.data_ptr<float>();
  float* vp = vf.data_ptr<float>();
  const int64_t ldx = qkv.stride(0);
  const float l2e = static_cast<float>(l2_eps);
  const int64_t per_seq = std::max<int64_t>(1, rows / std::max<int64_t>(batch, 1));
  parallel_items(batch, std::max<int64_t>(1, kInlineWork / (per_seq * ch * kk)),
                 rows * ch * kk, [&](int64_t bb) {
    T* state = cp + slots[bb] * ch * st;
    thread_local std::vector<T> copy;
    const bool verify = chunks.verifying(bb);
    if (verify) {
      copy.assign(state, state + ch * st);
      state = copy.data();
    }
    for (int64_t t = chunks.first(bb); t < chunks.last(bb); ++t) {
      T* m = mp + t * ch;
      const T* x = xp + t * ldx;
      conv_token<T>(state, x, wp, nullptr, fresh[bb] && t == chunks.first(bb), ch, kk, true, m);
      if (verify) {
        const int64_t j = slots[bb] * chunks.caps->cap + t - chunks.first(bb);
        std::copy(x, x + ch, chunks.capsule_conv + j * ch);
      }
      for (int64_t i = 0; i < qk; ++i)
        norm_row<Kind::kL2, T, float, float>(m + i * dk, nullptr, nullptr,
                                             qp + (t * qk + i) * dk, dk, l2e, false);
      for (int64_t j = 0; j < hv * dv; ++j) vp[t * hv * dv + j] = to_float(m[qk * dk + j]);
    }
  });
  const T* zp = z.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const float* alp = a_log.data_ptr<float>();
  const float* dtp = dt_bias.data_ptr<float>();
  float* pp = pool.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t ldz = z.stride(0), lda = a.stride(0), ldb = b.stride(0);
  const float sc = static_cast<float>(scale), ne = static_cast<float>(norm_eps);
  const bool fp32_weight = norm_weight.scalar_type() == at::kFloat;
  const int64_t w = 4 * dv * dk;
  parallel_items(batch * hv, std::max<int64_t>(1, kInlineWork / (per_seq * w)), rows * hv * w,
                 [&](int64_t item) {
    const int64_t bb = item / hv, h = item % hv;
    thread_local std::vector<float> o, copy;
    thread_local std::vector<T> ot;
    o.resize(dv);
    ot.resize(dv);
    float* state = pp + (slots[bb] * hv + h) * dv * dk;
    const bool verify = chunks.verifying(bb);
    if (verify) {
      copy.assign(state, state + dv * dk);
      state = copy.data();
    }
    for (int64_t t = chunks.first(bb); t < chunks.last(bb); ++t) {
      const float* q = qp + (t * qk + h / ratio) * dk;
      TokenCapture tc{nullptr, nullptr};
      if (verify) {
        const int64_t j = t - chunks.first(bb);
        tc = chunks.caps->at(slots[bb], j, h);
        if (h % ratio == 0)
          std::copy(q + hk * dk, q + hk * dk + dk, chunks.caps->key_row(slots[bb], j, h / ratio));
      }
      gdn_token(state, q, q + hk * dk, vp + (t * hv + h) * dv, to_float(ap[t * lda + h]),
                to_float(bp[t * ldb + h]), alp[h], dtp[h], fresh[bb] && t == chunks.first(bb),
                dv, dk, sc, o.data(), verify ? &tc : nullptr);
      for (int64_t r = 0; r < dv; ++r) ot[r] = from_float<T>(o[r]);
      const T* gate = zp + t * ldz + h * dv;
      T* orow = op + t * hv * dv + h * dv;
      if (fp32_weight) {
        norm_row<Kind::kGated, T, float, T>(ot.data(), gate, norm_weight.data_ptr<float>(), orow,
                                            dv, ne, false);
      } else {
        norm_row<Kind::kGated, T, c10::BFloat16, T>(
            ot.data(), gate, norm_weight.data_ptr<c10::BFloat16>(), orow, dv, ne, false);
      }
    }
  });
}

}  // namespace

// qkv [N, 2 Hk Dk + Hv Dv], z [N, Hv Dv], a, b [N, Hv] (row views, model dtype: float32 or
// bfloat16); conv_weight [C, K], conv_pool [S, C, K-1] (model dtype); a_log, dt_bias float32 [Hv];
// pool float32 [S, Hv, Dv, Dk]; slots int64 [B] distinct in [0, S); fresh bool [B]; norm_weight
// [Dv] (float32 or bfloat16); out [N, Hv Dv] (model dtype, contiguous). Without cu_seqlens each
// of the N = B rows is one sequence's token; with it (int32 [B+1]) sequence b has rows
// cu[b] .. cu[b+1]-1, and verify (bool [B]) marks verify chunks, captured into capsule_conv
// [S, C, channels] (model dtype), decay [S, C, Hv], key [S, C, Hk, Dk], delta [S, C, Hv, Dv].
void gdn_decode_mixer(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& a,
                      const at::Tensor& b, const at::Tensor& conv_weight, at::Tensor conv_pool,
                      const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor pool,
                      const at::Tensor& slots, const at::Tensor& fresh,
                      const at::Tensor& norm_weight, at::Tensor out, int64_t key_heads,
                      double scale, double l2_eps, double norm_eps,
                      const c10::optional<at::Tensor>& cu_seqlens,
                      const c10::optional<at::Tensor>& verify,
                      const c10::optional<at::Tensor>& capsule_conv,
                      const c10::optional<at::Tensor>& decay,
                      const c10::optional<at::Tensor>& key,
                      const c10::optional<at::Tensor>& delta) {
  constexpr const char* op = "gdn_decode_mixer";
  PH_CHECK(qkv.defined() && qkv.dim() == 2, op, "qkv", "must be [N, C] (got shape ",
           qkv.defined() ? shape_of(qkv) : std::string("none"), ")");
  const auto dt = qkv.scalar_type();
  PH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, "qkv",
           "dtype must be float32 or bfloat16 (got ", dt, ")");
  const int64_t rows = qkv.size(0), ch = qkv.size(1);
  check_row_view(op, "qkv", qkv, rows, ch, dt);
  check_tensor(op, "pool", pool, 4, at::kFloat);
  const int64_t hv = pool.size(1), dv = pool.size(2), dk = pool.size(3);
  PH_CHECK(key_heads >= 1 && hv % key_heads == 0, op, "key_heads", "head ratio: the value heads (",
           hv, ") must be a multiple of the key heads (got ", key_heads, ")");
  PH_CHECK(ch == 2 * key_heads * dk + hv * dv, op, "qkv", "size(1) must equal 2 key_heads Dk + ",
           "Hv Dv = ", 2 * key_heads * dk + hv * dv, " (got shape ", shape_of(qkv), ")");
  check_row_view(op, "z", z, rows, hv * dv, dt);
  check_row_view(op, "a", a, rows, hv, dt);
  check_row_view(op, "b", b, rows, hv, dt);
  check_tensor(op, "conv_weight", conv_weight, 2, dt);
  check_size(op, "conv_weight", conv_weight, 0, ch, "the channels of qkv");
  PH_CHECK(conv_weight.size(1) >= 1, op, "conv_weight", "the kernel width K must be >= 1 (got ",
           "shape ", shape_of(conv_weight), ")");
  check_tensor(op, "conv_pool", conv_pool, 3, dt);
  check_size(op, "conv_pool", conv_pool, 1, ch, "the channels of qkv");
  check_size(op, "conv_pool", conv_pool, 2, conv_weight.size(1) - 1, "the kernel width - 1");
  PH_CHECK(conv_pool.size(0) == pool.size(0), op, "conv_pool", "must have the recurrent pool's ",
           pool.size(0), " rows (got shape ", shape_of(conv_pool), ")");
  const std::array<std::pair<const char*, const at::Tensor*>, 2> per_head{
      {{"a_log", &a_log}, {"dt_bias", &dt_bias}}};
  for (const auto& [name, x] : per_head) {
    check_tensor(op, name, *x, 1, at::kFloat);
    check_size(op, name, *x, 0, hv, "the value heads of pool");
  }
  check_norm_weight(op, "norm_weight", norm_weight, dv, "the value head size of pool");
  check_tensor(op, "out", out, 2, dt);
  check_size(op, "out", out, 0, rows, "the token rows of qkv");
  check_size(op, "out", out, 1, hv * dv, "Hv Dv");
  int64_t batch = rows;
  const int32_t* cu = nullptr;
  if (cu_seqlens.has_value()) {
    batch = varlen_batch(op, *cu_seqlens);
    cu = check_cu_seqlens(op, *cu_seqlens, batch, rows);
  }
  check_slots(op, slots, batch, pool.size(0));
  check_tensor(op, "fresh", fresh, 1, at::kBool);
  check_size(op, "fresh", fresh, 0, batch, "the number of sequences");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* fr = fresh.data_ptr<bool>();
  std::optional<Capsule> caps;
  const bool* ver = nullptr;
  if (verify.has_value()) {
    PH_CHECK(cu != nullptr, op, "verify", "needs cu_seqlens");
    check_tensor(op, "verify", *verify, 1, at::kBool);
    check_size(op, "verify", *verify, 0, batch, "the number of sequences");
    PH_CHECK(capsule_conv.has_value() && decay.has_value() && key.has_value() &&
                 delta.has_value(), op, "capsule", "verify chunks need capsule_conv, decay, key "
             "and delta");
    caps.emplace(op, *decay, *key, *delta, pool.size(0), hv, key_heads, dk, dv);
    check_tensor(op, "capsule_conv", *capsule_conv, 3, dt);
    PH_CHECK(capsule_conv->size(0) == pool.size(0) && capsule_conv->size(1) == caps->cap &&
                 capsule_conv->size(2) == ch, op, "capsule_conv", "must be [slots, capacity, C] = [",
             pool.size(0), ", ", caps->cap, ", ", ch, "] (got shape ", shape_of(*capsule_conv),
             ")");
    ver = verify->data_ptr<bool>();
    caps->check_fits(op, "verify chunk", cu, batch, ver);
  }
  if (dt == at::kFloat) {
    MixerChunks<float> chunks{cu, ver, ver ? capsule_conv->data_ptr<float>() : nullptr,
                              caps ? &*caps : nullptr, batch};
    gdn_mixer_impl<float>(qkv, z, a, b, conv_weight, conv_pool, a_log, dt_bias, pool, sl, fr,
                          norm_weight, out, key_heads, scale, l2_eps, norm_eps, chunks);
  } else {
    MixerChunks<c10::BFloat16> chunks{
        cu, ver, ver ? capsule_conv->data_ptr<c10::BFloat16>() : nullptr,
        caps ? &*caps : nullptr, batch};
    gdn_mixer_impl<c10::BFloat16>(qkv, z, a, b, conv_weight, conv_pool, a_log, dt_bias, pool, sl,
                                  fr, norm_weight, out, key_heads, scale, l2_eps, norm_eps,
                                  chunks);
  }
}
}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.def(
      "gdn_decode_mixer(Tensor qkv, Tensor z, Tensor a, Tensor b, Tensor conv_weight, "
      "Tensor(a!) conv_pool, Tensor a_log, Tensor dt_bias, Tensor(b!) pool, Tensor slots, "
      "Tensor fresh, Tensor norm_weight, Tensor(c!) out, int key_heads, float scale, "
      "float l2_eps, float norm_eps, Tensor? cu_seqlens=None, Tensor? verify=None, "
      "Tensor(d!)? capsule_conv=None, Tensor(e!)? decay=None, Tensor(f!)? key=None, "
      "Tensor(g!)? delta=None) -> ()");
  m.def(
      "gated_delta_capture(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor a_log, "
      "Tensor dt_bias, Tensor pool, Tensor slots, Tensor fresh, Tensor cu_seqlens, "
      "Tensor(a!) out, float scale, Tensor(b!) decay, Tensor(c!) key, Tensor(d!) delta) -> ()");
  m.def(
      "gated_delta_replay(Tensor(a!) pool, Tensor slots, Tensor decay, Tensor key, "
      "Tensor delta, Tensor begin, Tensor end) -> ()");
  m.def(
      "commit_replay(Tensor(a!)[] conv_pools, Tensor[] conv_capsules, Tensor(b!)[] pools, "
      "Tensor[] decays, Tensor[] keys, Tensor[] deltas, Tensor slots, Tensor begin, "
      "Tensor end) -> ()");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("gdn_decode_mixer", &pagedhybrid::gdn_decode_mixer);
  m.impl("gated_delta_capture", &pagedhybrid::gated_delta_capture);
  m.impl("gated_delta_replay", &pagedhybrid::gated_delta_replay);
  m.impl("commit_replay", &pagedhybrid::commit_replay);
}
