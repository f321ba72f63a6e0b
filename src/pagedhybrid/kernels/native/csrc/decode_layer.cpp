// A whole decoder layer of a decode step (one token per sequence) -- or of a step of decodes and
// speculative verify chunks (gdn_decode_mixer's cu_seqlens / verify / capsule) -- in one call.
//
// gdn_decode_layer -- a Gated DeltaNet layer:
//
//   x  = rms_norm(h, input_layernorm, offset)        y  = gdn_decode_mixer(qkv, z, a, b)
//   qkv, z, b, a = x @ in_proj_qkv / z / b / a^T      h2 = h + y @ out_proj^T
//   x2 = rms_norm(h2, post_attention_layernorm, offset)
//   g, u = x2 @ gate_proj^T, x2 @ up_proj^T           out = h2 + (silu(g) * u) @ down_proj^T
//
// attention_decode_layer -- a full-attention layer over bf16 / fp32 pages (the cache in the
// model dtype; quantized pages take the modules' path):
//
//   x = rms_norm(h, input_layernorm); x @ q_proj^T per head [query | gate]; k, v = x @ k/v_proj^T
//   q = rope(rms_norm(query, q_norm)), k = rope(rms_norm(k, k_norm)) -- rope.py's apply_rope,
//   op for op; k, v written to their page slots; a = paged_attention(q) (the native kernel);
//   h2 = h + (a * sigmoid(gate)) @ o_proj^T;  then the MLP as above.
//
// Each is exactly what the layer's modules compute one op at a time (models/qwen35/decoder.py,
// attention.py, linear_attention.py, layers.py, rope.py) when the bundle multiplies with the
// native `linear` kernel (`native_linear`) or with torch's (at::linear, as F.linear): the same
// checked kernels are called (linear, rms_norm, gdn_decode_mixer, paged_attention) and every
// other step is the same ATen op (silu, sigmoid, mul, add, neg, cat, index_copy_, casts), so
// every bit of the output, the pages and the state pools equals the layer's
// (tests/models/test_qwen35_packed.py).
// What a Python step spends between ~25 ops per layer (argument parsing, dispatch, the
// modules' glue: ~5 us an op on a 2-core server) is gone; the kernels are unchanged.
//
// h [B, hidden] and every weight in the model dtype (float32 or bfloat16), the modules' own
// parameters (no stacked copies: a memory-mapped checkpoint stays the only copy); the pools,
// slots and fresh as gdn_decode_mixer takes them. Every shape is checked before a pool or a page
// is written, so a refused call changes nothing.
#include <ATen/ATen.h>
#include <cstring>
#include <tuple>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "common.h"
#include "kernels.h"
#include "rows.h"

namespace pagedhybrid {
namespace {

// f() -- torch's pointwise ops -- on the calling thread alone. Above its grain (32768 elements)
// an ATen op opens an OpenMP region, after which the OpenMP worker spins for a while: on two
// cores that starves the native kernels' helper thread through the next projections (a
// 32-sequence bf16 decode step's MLP and residual ops did so 16 times a step: 62 -> 51 ms).
// The same kernels run, in one chunk (their chunks of [rows, intermediate] split at multiples
// of the vector width either way).
struct OneOmpThread {  // the calling thread's OpenMP regions at one thread, while in scope
  const int threads = omp_get_max_threads();
  OneOmpThread() { omp_set_num_threads(1); }
  ~OneOmpThread() { omp_set_num_threads(threads); }
};

template <class F>
at::Tensor serial(const F& f) {
  const OneOmpThread one;
  return f();
}

// One projection: its weight, or -- a model with int8 / int4 weights (`quant`, 3 tensors per
// projection in the layer's order: codes, scales, zeros (empty: symmetric); `bits`) -- its codes
// (which the Python side passes in the weight's argument).
struct Proj {
  const at::Tensor& w;
  const at::Tensor* codes = nullptr;
  const at::Tensor* scales = nullptr;
  c10::optional<at::Tensor> zeros;
  int64_t bits = 0;
  int64_t rows() const { return codes ? quant_weight_rows(*codes) : w.size(0); }
};

Proj proj(const at::Tensor& w, at::TensorList quant, int64_t bits, size_t i) {
  if (quant.empty()) return Proj{w};
  const at::Tensor& z = quant[3 * i + 2];
  return Proj{w, &quant[3 * i], &quant[3 * i + 1],
              z.numel() ? c10::optional<at::Tensor>(z) : c10::nullopt, bits};
}

// The number of quantised tensors a layer of `projections` needs (none, or 3 per projection).
void check_quant(const char* op, at::TensorList quant, size_t projections) {
  PH_CHECK(quant.empty() || quant.size() == 3 * projections, op, "quant",
           "must be empty or hold codes, scales, zeros for each of the layer's ", projections,
           " projections (got ", quant.size(), " tensors)");
}

at::Tensor product(const at::Tensor& x, const Proj& p, bool native_linear) {
  if (p.codes) {  // int8 / int4 weights: the integer kernel (decode-sized rows)
    at::Tensor out = at::empty({x.size(0), p.rows()}, x.options());
    quant_linear(x.is_contiguous() ? x : x.contiguous(), *p.codes, *p.scales, p.zeros, p.bits,
                 out);
    return out;
  }
  const at::Tensor& w = p.w;
  if (!native_linear) return at::linear(x, w);
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  linear(x, w, out);
  return out;
}

// x @ p^T for several projections of the same input: int8 / int4 ones in one call (x quantised
// once, one parallel step over all of their rows), the others one by one.
std::vector<at::Tensor> products(const at::Tensor& x, std::initializer_list<const Proj*> ps,
                                 bool native_linear) {
  std::vector<at::Tensor> outs;
  if (!(*ps.begin())->codes) {
    for (const Proj* p : ps) outs.push_back(product(x, *p, native_linear));
    return outs;
  }
  std::vector<QuantWeightRef> ws;
  for (const Proj* p : ps) {
    ws.push_back({*p->codes, *p->scales, p->zeros});
    outs.push_back(at::empty({x.size(0), p->rows()}, x.options()));
  }
  quant_linear_many(x.is_contiguous() ? x : x.contiguous(), (*ps.begin())->bits, ws, outs);
  return outs;
}

at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm(x, w, out, eps, true);
  return out;
}

constexpr int64_t kMaxHead = 256;  // the head sizes the native attention tile holds

// One token's heads of q or k: head h's row (src + h * ld_head, D = hd channels, the model
// dtype T) normalised with the offset weight w (attention.py's q_norm / k_norm: rows.h's
// norm_row, as the native rms_norm op computes it, rounded to T), then its first rd channels
// rotated as rope.py's apply_rope computes them op by op in fp32 -- x * cos and rotate_half(x)
// * sin each rounded, then their sum, rounded to T (the asm keeps the compiler from fusing a
// product into the add) -- the other channels passed through. Written to out (heads x hd) as T,
// or widened to float (O = float) for the attention kernel.
template <typename T, typename W, typename O>
void norm_rope_token(const T* src, int64_t ld_head, int64_t heads, int64_t hd, const W* w,
                     float eps, const float* cos, const float* sin, int64_t rd, O* out) {
  alignas(64) T row[kMaxHead];
  alignas(64) float xf[kMaxHead];
  const int64_t half = rd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    norm_row<Kind::kRms, T, W, T>(src + h * ld_head, nullptr, w, row, hd, eps, true);
    for (int64_t i = 0; i < rd; ++i) xf[i] = to_float(row[i]);
    O* o = out + h * hd;
    for (int64_t i = 0; i < rd; ++i) {
      float a = xf[i] * cos[i];
      float b = (i < half ? -xf[i + half] : xf[i - half]) * sin[i];
      asm("" : "+x"(a), "+x"(b));
      o[i] = static_cast<O>(to_float(from_float<T>(a + b)));
    }
    for (int64_t i = rd; i < hd; ++i) o[i] = static_cast<O>(to_float(row[i]));
  }
}

// norm_rope_token over n tokens (src rows ld_token apart), out [n, heads, hd] contiguous.
template <typename T, typename O>
void norm_rope(const T* src, int64_t ld_token, int64_t ld_head, int64_t n, int64_t heads,
               int64_t hd, const at::Tensor& w, double eps, const at::Tensor& cos,
               const at::Tensor& sin, O* out) {
  const int64_t rd = cos.size(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for (int64_t t = 0; t < n; ++t) {
    if (w.scalar_type() == at::kFloat) {
      norm_rope_token<T, float, O>(src + t * ld_token, ld_head, heads, hd, w.data_ptr<float>(),
                                   e, cp + t * rd, sp + t * rd, rd, out + t * heads * hd);
    } else {
      norm_rope_token<T, c10::BFloat16, O>(src + t * ld_token, ld_head, heads, hd,
                                           w.data_ptr<c10::BFloat16>(), e, cp + t * rd,
                                           sp + t * rd, rd, out + t * heads * hd);
    }
  }
}

// A projection weight [rows, cols] in the model dtype (or its codes holding rows x cols).
void check_weight(const char* op, const char* arg, const Proj& p, at::ScalarType dt,
                  int64_t rows, const char* rows_are, int64_t cols, const char* cols_are) {
  if (p.codes) {
    check_quant_weight(op, std::string(arg) + ".", *p.codes, *p.scales, p.zeros, p.bits, cols);
    PH_CHECK(p.rows() == rows, op, arg, "codes: the rows must equal ", rows_are, " = ", rows,
             " (got shape ", shape_of(*p.codes), ")");
    return;
  }
  check_tensor(op, arg, p.w, 2, dt);
  check_size(op, arg, p.w, 0, rows, rows_are);
  check_size(op, arg, p.w, 1, cols, cols_are);
}

// The weights used after the mixer has written its pages / pools, checked before it runs:
// out [hidden, in_dim] (out_proj / o_proj), post_norm [hidden], gate / up [I, hidden],
// down [hidden, I] -- in h's dtype (the norm: float32 or bfloat16).
void check_tail(const char* op, const at::Tensor& h, const char* out_name, const Proj& out,
                int64_t in_dim, const at::Tensor& post_norm, const Proj& gate, const Proj& up,
                const Proj& down) {
  const int64_t hidden = h.size(1);
  const auto dt = h.scalar_type();
  check_weight(op, out_name, out, dt, hidden, "the hidden size of h", in_dim,
               "the mixer's output width");
  check_norm_weight(op, "post_norm", post_norm, hidden, "the hidden size of h");
  PH_CHECK(down.codes || down.w.dim() == 2, op, "down", "must be [hidden, I] (got shape ",
           shape_of(down.w), ")");
  const int64_t inter = down.codes ? gate.rows() : down.w.size(1);
  check_weight(op, "down", down, dt, hidden, "the hidden size of h", inter, "down.size(1)");
  check_weight(op, "gate", gate, dt, inter, "down.size(1)", hidden, "the hidden size of h");
  check_weight(op, "up", up, dt, inter, "down.size(1)", hidden, "the hidden size of h");
}

// h2 + (silu(g) * u) @ down^T with g, u = x2 @ gate^T, x2 @ up^T, x2 = rms_norm(h2, post_norm)
// (layers.py MLP)
at::Tensor mlp_block(const at::Tensor& h2, const at::Tensor& post_norm, const Proj& gate,
                     const Proj& up, const Proj& down, double rms_eps, bool native_linear) {
  const at::Tensor x2 = norm(h2, post_norm, rms_eps);
  const std::vector<at::Tensor> gu = products(x2, {&gate, &up}, native_linear);
  const at::Tensor m = serial([&] { return at::mul(at::silu(gu[0]), gu[1]); });
  const at::Tensor d = product(m, down, native_linear);
  return serial([&] { return at::add(h2, d); });
}

void check_h(const char* op, const at::Tensor& h) {
  check_tensor(op, "h", h, 2, h.scalar_type());
  PH_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16, op, "h",
           "dtype must be float32 or bfloat16 (got ", h.scalar_type(), ")");
}

// A refusal by a kernel the layer calls names the layer op first:
// "pagedhybrid.gdn_decode_layer: in pagedhybrid.gdn_decode_mixer: slots: ...".
template <class F>
auto naming(const char* op, const F& f) -> decltype(f(op)) {
  try {
    return f(op);
  } catch (const c10::ValueError& e) {
    const std::string what = e.what_without_backtrace();
    if (what.rfind(std::string("pagedhybrid.") + op + ":", 0) == 0) throw;
    TORCH_CHECK_VALUE(false, "pagedhybrid.", op, ": in ", what);
  } catch (const c10::IndexError& e) {
    TORCH_CHECK_INDEX(false, "pagedhybrid.", op, ": in ", e.what_without_backtrace());
  }
}

at::Tensor attention_decode_layer(const at::Tensor& h, const at::Tensor& input_norm,
                                  const at::Tensor& q_proj, const at::Tensor& k_proj,
                                  const at::Tensor& v_proj, const at::Tensor& q_norm,
                                  const at::Tensor& k_norm, const at::Tensor& cos,
                                  const at::Tensor& sin, at::Tensor key_cache,
                                  at::Tensor value_cache, const at::Tensor& write_slots,
                                  const at::Tensor& block_table, const at::Tensor& cu_seqlens,
                                  const at::Tensor& past_lens, const at::Tensor& seqs,
                                  const at::Tensor& o_proj, const at::Tensor& post_norm,
                                  const at::Tensor& gate_proj, const at::Tensor& up_proj,
                                  const at::Tensor& down_proj, int64_t heads, int64_t kv_heads,
                                  double scale, double rms_eps, int64_t split,
                                  bool native_linear, at::TensorList quant, int64_t quant_bits) {
  return naming("attention_decode_layer", [&](const char* op) {
    check_h(op, h);
    check_quant(op, quant, 7);
    const Proj q_p = proj(q_proj, quant, quant_bits, 0), k_p = proj(k_proj, quant, quant_bits, 1),
               v_p = proj(v_proj, quant, quant_bits, 2), o_p = proj(o_proj, quant, quant_bits, 3),
               gate_p = proj(gate_proj, quant, quant_bits, 4),
               up_p = proj(up_proj, quant, quant_bits, 5),
               down_p = proj(down_proj, quant, quant_bits, 6);
    const int64_t n = h.size(0), hidden = h.size(1);
    const auto dt = h.scalar_type();
    PH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == dt, op, "key_cache",
             "must be [P, bs, Hkv, D] pages of h's dtype ", dt, " (got ", key_cache.scalar_type(),
             " ", shape_of(key_cache), ")");
    const int64_t hd = key_cache.size(3);
    PH_CHECK(heads >= 1 && kv_heads == key_cache.size(2) && heads % kv_heads == 0, op, "heads",
             "head ratio: heads (", heads, ") must be a multiple of the pages' KV heads (",
             key_cache.size(2), "), and kv_heads (", kv_heads, ") equal to them");
    check_weight(op, "q_proj", q_p, dt, 2 * heads * hd, "2 heads D (query | gate)", hidden,
                 "the hidden size of h");
    check_weight(op, "k_proj", k_p, dt, kv_heads * hd, "kv_heads D", hidden,
                 "the hidden size of h");
    check_weight(op, "v_proj", v_p, dt, kv_heads * hd, "kv_heads D", hidden,
                 "the hidden size of h");
    PH_CHECK(hd <= kMaxHead, op, "key_cache", "head size ", hd, " is over ", kMaxHead);
    check_tensor(op, "cos", cos, 2, at::kFloat);
    check_tensor(op, "sin", sin, 2, at::kFloat);
    PH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes() && cos.size(1) <= hd &&
                 cos.size(1) % 2 == 0, op, "cos",
             "cos and sin must be [N, rotary_dim] with an even rotary_dim <= D (got ",
             shape_of(cos), ", ", shape_of(sin), ")");
    check_norm_weight(op, "q_norm", q_norm, hd, "the head size D");
    check_norm_weight(op, "k_norm", k_norm, hd, "the head size D");
    check_tensor(op, "write_slots", write_slots, 1, at::kLong);
    check_size(op, "write_slots", write_slots, 0, n, "the token rows of h");
    check_tail(op, h, "o_proj", o_p, heads * hd, post_norm, gate_p, up_p, down_p);
    const at::Tensor x = norm(h, input_norm, rms_eps);
    const std::vector<at::Tensor> qkv = products(x, {&q_p, &k_p, &v_p}, native_linear);
    const at::Tensor gate = qkv[0].view({n, heads, 2 * hd}).narrow(2, hd, hd)
                                .reshape({n, heads * hd});
    at::Tensor qf = at::empty({n, heads, hd}, h.options().dtype(at::kFloat));
    at::Tensor k = at::empty({n, kv_heads, hd}, h.options());
    const at::Tensor v = qkv[2].view({n, kv_heads, hd});
    if (dt == at::kFloat) {
      norm_rope<float, float>(qkv[0].data_ptr<float>(), 2 * heads * hd, 2 * hd, n, heads, hd,
                              q_norm, rms_eps, cos, sin, qf.data_ptr<float>());
      norm_rope<float, float>(qkv[1].data_ptr<float>(), kv_heads * hd, hd, n, kv_heads, hd,
                              k_norm, rms_eps, cos, sin, k.data_ptr<float>());
    } else {
      using B = c10::BFloat16;
      norm_rope<B, float>(qkv[0].data_ptr<B>(), 2 * heads * hd, 2 * hd, n, heads, hd, q_norm,
                          rms_eps, cos, sin, qf.data_ptr<float>());
      norm_rope<B, B>(qkv[1].data_ptr<B>(), kv_heads * hd, hd, n, kv_heads, hd, k_norm, rms_eps,
                      cos, sin, k.data_ptr<B>());
    }
    at::Tensor attn = at::empty({n, heads, hd}, h.options().dtype(at::kFloat));
    check_paged_attention(qf, key_cache, value_cache, block_table, cu_seqlens, past_lens, seqs,
                          attn, split);  // before a page is written
    const int64_t slots = key_cache.size(0) * key_cache.size(1);
    const int64_t* ws = write_slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      PH_CHECK(ws[i] >= 0 && ws[i] < slots, op, "write_slots", "write_slots[", i, "] = ", ws[i],
               " is outside the pages' ", slots, " slots");
    key_cache.view({-1, kv_heads, hd}).index_copy_(0, write_slots, k);
    value_cache.view({-1, kv_heads, hd}).index_copy_(0, write_slots, v);
    paged_attention(qf, key_cache, value_cache, block_table, cu_seqlens, past_lens, seqs, attn,
                    scale, split);
    const at::Tensor gated =
        serial([&] { return at::mul(attn.to(dt).reshape({n, -1}), at::sigmoid(gate)); });
    const at::Tensor o = product(gated, o_p, native_linear);
    const at::Tensor h2 = serial([&] { return at::add(h, o); });
    return mlp_block(h2, post_norm, gate_p, up_p, down_p, rms_eps, native_linear);
  });
}

at::Tensor gdn_decode_layer(const at::Tensor& h, const at::Tensor& input_norm,
                            const at::Tensor& in_proj_qkv, const at::Tensor& in_proj_z,
                            const at::Tensor& in_proj_b, const at::Tensor& in_proj_a,
                            const at::Tensor& conv_weight, at::Tensor conv_pool,
                            const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor pool,
                            const at::Tensor& slots, const at::Tensor& fresh,
                            const at::Tensor& gated_norm, const at::Tensor& out_proj,
                            const at::Tensor& post_norm, const at::Tensor& gate_proj,
                            const at::Tensor& up_proj, const at::Tensor& down_proj,
                            int64_t key_heads, double scale, double l2_eps, double gated_eps,
                            double rms_eps, bool native_linear, at::TensorList quant,
                            int64_t quant_bits, const c10::optional<at::Tensor>& cu_seqlens,
                            const c10::optional<at::Tensor>& verify,
                            const c10::optional<at::Tensor>& capsule_conv,
                            const c10::optional<at::Tensor>& decay,
                            const c10::optional<at::Tensor>& key,
                            const c10::optional<at::Tensor>& delta) {
  return naming("gdn_decode_layer", [&](const char* op) {
    check_h(op, h);
    check_quant(op, quant, 8);
    const Proj qkv_p = proj(in_proj_qkv, quant, quant_bits, 0),
               z_p = proj(in_proj_z, quant, quant_bits, 1),
               b_p = proj(in_proj_b, quant, quant_bits, 2),
               a_p = proj(in_proj_a, quant, quant_bits, 3),
               out_p = proj(out_proj, quant, quant_bits, 4),
               gate_p = proj(gate_proj, quant, quant_bits, 5),
               up_p = proj(up_proj, quant, quant_bits, 6),
               down_p = proj(down_proj, quant, quant_bits, 7);
    const int64_t hidden = h.size(1);
    const auto dt = h.scalar_type();
    check_tensor(op, "pool", pool, 4, at::kFloat);
    const int64_t hv = pool.size(1), vd = hv * pool.size(2);
    PH_CHECK(conv_weight.dim() == 2, op, "conv_weight", "must be [C, K] (got shape ",
             shape_of(conv_weight), ")");
    check_weight(op, "in_proj_qkv", qkv_p, dt, conv_weight.size(0),
                 "the channels of conv_weight", hidden, "the hidden size of h");
    check_weight(op, "in_proj_z", z_p, dt, vd, "Hv Dv of pool", hidden,
                 "the hidden size of h");
    check_weight(op, "in_proj_b", b_p, dt, hv, "the value heads of pool", hidden,
                 "the hidden size of h");
    check_weight(op, "in_proj_a", a_p, dt, hv, "the value heads of pool", hidden,
                 "the hidden size of h");
    check_tail(op, h, "out_proj", out_p, vd, post_norm, gate_p, up_p, down_p);
    const at::Tensor x = norm(h, input_norm, rms_eps);
    at::Tensor y = at::empty({h.size(0), vd}, h.options());
    const std::vector<at::Tensor> in = products(x, {&qkv_p, &z_p, &a_p, &b_p}, native_linear);
    gdn_decode_mixer(in[0], in[1], in[2], in[3],
                     conv_weight, conv_pool, a_log, dt_bias, pool, slots, fresh, gated_norm, y,
                     key_heads, scale, l2_eps, gated_eps, cu_seqlens, verify, capsule_conv, decay,
                     key, delta);
    const at::Tensor o = product(y, out_p, native_linear);
    const at::Tensor h2 = serial([&] { return at::add(h, o); });
    return mlp_block(h2, post_norm, gate_p, up_p, down_p, rms_eps, native_linear);
  });
}

// mtp_head_input -- the MTP head's input (model.py forward_mtp, up to its decoder layer):
//   x = [rms_norm(embed[token_ids], norm_embedding) | rms_norm(hidden, norm_hidden)]
//   h = x @ fc^T
// token_ids int64 [N] in [0, V), hidden [N, H] and embed [V, H] in the model dtype (float32 or
// bfloat16), the norms' offset weights [H], fc [H, 2H] (or its int8 / int4 codes in `quant`:
// codes, scales, zeros) -- the same kernels the modules call, so every bit is theirs.
at::Tensor mtp_head_input(const at::Tensor& token_ids, const at::Tensor& hidden,
                          const at::Tensor& embed, const at::Tensor& norm_embedding,
                          const at::Tensor& norm_hidden, const at::Tensor& fc, double rms_eps,
                          bool native_linear, at::TensorList quant, int64_t quant_bits) {
  return naming("mtp_head_input", [&](const char* op) {
    check_tensor(op, "hidden", hidden, 2, hidden.scalar_type());
    const auto dt = hidden.scalar_type();
    PH_CHECK(dt == at::kFloat || dt == at::kBFloat16, op, "hidden",
             "dtype must be float32 or bfloat16 (got ", dt, ")");
    const int64_t n = hidden.size(0), width = hidden.size(1);
    check_tensor(op, "token_ids", token_ids, 1, at::kLong);
    check_size(op, "token_ids", token_ids, 0, n, "the rows of hidden");
    check_tensor(op, "embed", embed, 2, dt);
    check_size(op, "embed", embed, 1, width, "the hidden size of hidden");
    const int64_t vocab = embed.size(0);
    const int64_t* ids = token_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      PH_CHECK(ids[i] >= 0 && ids[i] < vocab, op, "token_ids", "token_ids[", i, "] = ", ids[i],
               " is outside the vocabulary [0, ", vocab, ")");
    check_norm_weight(op, "norm_embedding", norm_embedding, width, "the hidden size of hidden");
    check_norm_weight(op, "norm_hidden", norm_hidden, width, "the hidden size of hidden");
    check_quant(op, quant, 1);
    const Proj fc_p = proj(fc, quant, quant_bits, 0);
    check_weight(op, "fc", fc_p, dt, width, "the hidden size of hidden", 2 * width,
                 "twice the hidden size");
    at::Tensor e = at::empty({n, width}, hidden.options());
    const int64_t row = width * static_cast<int64_t>(e.element_size());
    const char* table = static_cast<const char*>(embed.data_ptr());
    char* ep = static_cast<char*>(e.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(ep + i * row, table + ids[i] * row, row);
    const at::Tensor x = at::cat({norm(e, norm_embedding, rms_eps),
                                  norm(hidden, norm_hidden, rms_eps)}, -1);
    return product(x, fc_p, native_linear);
  });
}

// mtp_head_output -- the MTP head after its decoder layer (model.py forward_mtp) for a drafter
// that wants the greedy pick alone: out = rms_norm(h, norm) (the head's hidden, [N, H]) and,
// for rows `picks` of it (all when None), the first maximum of their LM-head logits
// (lm_head [V, H] or its int8 / int4 codes in `quant`; the logits rounded to h's dtype, then
// widened, as the module's .float() does; greedy_rows: -1 for a row with a NaN or an infinity).
// Returns (out, ids int64 [R]).
// The final norm [H] and LM head [V, H] (or its codes) of the head's output, for h [N, H].
void check_head_output(const char* op, const at::Tensor& h, const at::Tensor& norm_w,
                       const Proj& lm) {
  const int64_t width = h.size(1);
  check_norm_weight(op, "norm", norm_w, width, "the hidden size of h");
  PH_CHECK(lm.codes || lm.w.dim() == 2, op, "lm_head", "must be [V, hidden] (got shape ",
           shape_of(lm.w), ")");
  check_weight(op, "lm_head", lm, h.scalar_type(), lm.rows(), "the vocabulary", width,
               "the hidden size of h");
}

std::tuple<at::Tensor, at::Tensor> mtp_head_output(const at::Tensor& h, const at::Tensor& norm_w,
                                                   double rms_eps,
                                                   const c10::optional<at::Tensor>& picks,
                                                   const at::Tensor& lm_head, bool native_linear,
                                                   at::TensorList quant, int64_t quant_bits) {
  return naming("mtp_head_output", [&](const char* op) -> std::tuple<at::Tensor, at::Tensor> {
    check_h(op, h);
    check_quant(op, quant, 1);
    const Proj lm = proj(lm_head, quant, quant_bits, 0);
    check_head_output(op, h, norm_w, lm);
    if (picks) {
      check_tensor(op, "picks", *picks, 1, at::kLong);
      const int64_t* pk = picks->data_ptr<int64_t>();
      for (int64_t i = 0; i < picks->size(0); ++i)
        PH_CHECK(pk[i] >= 0 && pk[i] < h.size(0), op, "picks", "picks[", i, "] = ", pk[i],
                 " is outside the rows of h [0, ", h.size(0), ")");
    }
    at::Tensor out = norm(h, norm_w, rms_eps);
    const at::Tensor rows = picks ? out.index_select(0, *picks) : out;
    if (rows.size(0) == 0)  // nothing drafted from (a catch-up alone): no product to run
      return {out, at::empty({0}, h.options().dtype(at::kLong))};
    const at::Tensor logits = product(rows, lm, native_linear).to(at::kFloat).contiguous();
    return {out, greedy_rows(logits, c10::nullopt)};
  });
}

// The MTP head's tensors for mtp_chain / mtp_draft (as mtp_head_input, attention_decode_layer
// and mtp_head_output take them) and one head step over packed rows.
struct Head {
  const at::Tensor &embed, &norm_embedding, &norm_hidden, &fc;
  at::TensorList fc_quant;
  const at::Tensor &input_norm, &q_proj, &k_proj, &v_proj, &q_norm, &k_norm;
  at::Tensor key_cache, value_cache;
  const at::Tensor &o_proj, &post_norm, &gate_proj, &up_proj, &down_proj;
  int64_t heads, kv_heads;
  double scale, rms_eps;
  int64_t split;
  at::TensorList quant;
  const at::Tensor &final_norm, &lm_head;
  at::TensorList lm_quant;
  int64_t quant_bits;
  bool native_linear;

  // Rows ids / hidden of the sequences (cu, past, table, seqs) at positions `at` (int64: the
  // rope rows), their K/V written at `write`: (the head's hidden, the picks of `picks`' rows).
  std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& ids, const at::Tensor& hidden,
                                          const at::Tensor& at, const at::Tensor& cos,
                                          const at::Tensor& sin, const at::Tensor& write,
                                          const at::Tensor& table, const at::Tensor& cu,
                                          const at::Tensor& past, const at::Tensor& seqs,
                                          const c10::optional<at::Tensor>& picks) const {
    const at::Tensor x = mtp_head_input(ids, hidden, embed, norm_embedding, norm_hidden, fc,
                                        rms_eps, native_linear, fc_quant, quant_bits);
    const at::Tensor out = attention_decode_layer(
        x, input_norm, q_proj, k_proj, v_proj, q_norm, k_norm, cos.index_select(0, at),
        sin.index_select(0, at), key_cache, value_cache, write, table, cu, past, seqs, o_proj,
        post_norm, gate_proj, up_proj, down_proj, heads, kv_heads, scale, rms_eps, split,
        native_linear, quant, quant_bits);
    return mtp_head_output(out, final_norm, rms_eps, picks, lm_head, native_linear, lm_quant,
                           quant_bits);
  }

  // The head's output weights (final norm, LM head), checked before any page is written.
  void check_output(const char* op, const at::Tensor& hidden) const {
    check_quant(op, lm_quant, 1);
    check_head_output(op, hidden, final_norm, proj(lm_head, lm_quant, quant_bits, 0));
  }

  // Checks before any page is written: every page sequence b reads or writes up to position
  // last[b] (table row b) mapped, and the rope table long enough.
  void check_pages(const char* op, const int32_t* bt, int64_t width, int64_t block_size,
                   const std::vector<int64_t>& last, const at::Tensor& cos) const {
    PH_CHECK(key_cache.dim() == 4, op, "key_cache", "must be [P, bs, Hkv, D] pages (got shape ",
             shape_of(key_cache), ")");
    PH_CHECK(block_size >= 1, op, "block_size", "must be >= 1 (got ", block_size, ")");
    check_tensor(op, "cos", cos, 2, at::kFloat);
    const int64_t pages = key_cache.size(0);
    for (size_t b = 0; b < last.size(); ++b) {
      if (last[b] < 0) continue;
      PH_CHECK(last[b] / block_size < width, op, "block_table", "sequence ", b,
               ": position ", last[b], " needs page ", last[b] / block_size, " of a table of ",
               width);
      PH_CHECK(last[b] < cos.size(0), op, "cos", "sequence ", b, ": position ", last[b],
               " is past the rope table's ", cos.size(0), " rows");
      for (int64_t i = 0; i <= last[b] / block_size; ++i)
        PH_CHECK(bt[b * width + i] >= 0 && bt[b * width + i] < pages, op, "block_table",
                 "sequence ", b, ": page ", i, " = ", bt[b * width + i],
                 " is outside the page pool [0, ", pages, ")");
    }
  }
};

void check_ids(const char* op, const at::Tensor& ids, int64_t vocab) {
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i)
    PH_CHECK(p[i] >= 0 && p[i] < vocab, op, "token_ids", "token_ids[", i, "] = ", p[i],
             " is outside the vocabulary [0, ", vocab, ")");
}

// The chain: row b starts from ids[b] (-1: no chain) and state row b at position pos[b] and runs
// st[b] one-token head steps on table row b, writing its picks into drafts row b from column
// col0 on (drafts [B, cols]); state ends as each chain's last hidden.
void chain(const Head& head, std::vector<int64_t> ids, at::Tensor& state, const int64_t* pos,
           const int64_t* st, const int32_t* bt, int64_t width, int64_t block_size,
           const at::Tensor& cos, const at::Tensor& sin, int64_t* drafts, int64_t cols,
           int64_t col0) {
  const int64_t batch = state.size(0);
  const auto i64 = at::TensorOptions().dtype(at::kLong), i32 = i64.dtype(at::kInt);
  for (int64_t j = 0;; ++j) {
    std::vector<int64_t> live;
    for (int64_t b = 0; b < batch; ++b)
      if (st[b] > j && ids[b] >= 0) live.push_back(b);
    if (live.empty()) return;
    const int64_t n = static_cast<int64_t>(live.size());
    at::Tensor rows = at::empty({n}, i64), tok = at::empty({n}, i64), write = at::empty({n}, i64);
    at::Tensor at_pos = at::empty({n}, i64), past = at::empty({n}, i32);
    at::Tensor cu = at::empty({n + 1}, i32), seqs = at::empty({n}, i32);
    at::Tensor table = at::empty({n, width}, i32);
    int64_t *rp = rows.data_ptr<int64_t>(), *tp = tok.data_ptr<int64_t>();
    int64_t *wp = write.data_ptr<int64_t>(), *ap = at_pos.data_ptr<int64_t>();
    int32_t *pp = past.data_ptr<int32_t>(), *cp = cu.data_ptr<int32_t>();
    int32_t *sp = seqs.data_ptr<int32_t>(), *tb = table.data_ptr<int32_t>();
    cp[0] = 0;
    for (int64_t l = 0; l < n; ++l) {
      const int64_t b = live[l], p = pos[b] + j;
      rp[l] = b;
      tp[l] = ids[b];
      ap[l] = p;
      pp[l] = static_cast<int32_t>(p);
      cp[l + 1] = static_cast<int32_t>(l + 1);
      sp[l] = static_cast<int32_t>(l);
      std::copy(bt + b * width, bt + (b + 1) * width, tb + l * width);
      wp[l] = static_cast<int64_t>(bt[b * width + p / block_size]) * block_size + p % block_size;
    }
    const auto [normed, picks] = head.step(tok, state.index_select(0, rows), at_pos, cos, sin,
                                           write, table, cu, past, seqs, c10::nullopt);
    state.index_copy_(0, rows, normed);
    const int64_t* pk = picks.data_ptr<int64_t>();
    for (int64_t l = 0; l < n; ++l) {
      ids[live[l]] = pk[l];
      if (pk[l] >= 0) drafts[live[l] * cols + col0 + j] = pk[l];
    }
  }
}

// The chain's per-sequence inputs: int64 [B] each (named), block_table int32 [B, M].
void check_chain_inputs(const char* op, int64_t batch, const at::Tensor& positions,
                        const at::Tensor& steps, const at::Tensor& block_table) {
  const std::array<std::pair<const char*, const at::Tensor*>, 2> per{
      {{"positions", &positions}, {"steps", &steps}}};
  for (const auto& [name, t] : per) {
    check_tensor(op, name, *t, 1, at::kLong);
    check_size(op, name, *t, 0, batch, "the chains");
  }
  check_tensor(op, "block_table", block_table, 2, at::kInt);
  check_size(op, "block_table", block_table, 0, batch, "the chains");
  const int64_t *pos = positions.data_ptr<int64_t>(), *st = steps.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    PH_CHECK(st[b] >= 0 && pos[b] >= 0, op, "steps", "sequence ", b,
             ": steps and positions must be >= 0 (got ", st[b], ", ", pos[b], ")");
}

// mtp_chain -- the MTP drafter's chain (engine/mtp.py) in one call: sequence b's chain starts
// from its first draft token_ids[b] and the head's hidden hidden[b] at position positions[b] and
// runs steps[b] one-token head steps, step j at position positions[b] + j on b's pages
// (block_table row b, block_size tokens a page; its K/V written there): mtp_head_input,
// attention_decode_layer (the head's layer; every sequence still going is one decode row of the
// step) and mtp_head_output, whose pick is the next draft and whose hidden the next step reads.
// cos / sin are rope tables [P, rotary_dim] indexed by position. A pick of -1 (non-finite
// logits) ends that chain. Returns (drafts int64 [B, max steps], -1 past each chain's end; the
// head's hidden after each chain's last step [B, H]). The products run in the forms the flags
// say (those of the chain's first step: a form change at fewer rows would change drafts only).
std::tuple<at::Tensor, at::Tensor> mtp_chain(const at::Tensor& token_ids,
                                             const at::Tensor& hidden,
                                             const at::Tensor& positions, const at::Tensor& steps,
                                             const at::Tensor& block_table, int64_t block_size,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             const Head& head) {
  return naming("mtp_chain", [&](const char* op) -> std::tuple<at::Tensor, at::Tensor> {
    check_h(op, hidden);
    check_tensor(op, "embed", head.embed, 2, hidden.scalar_type());
    const int64_t batch = hidden.size(0);
    check_tensor(op, "token_ids", token_ids, 1, at::kLong);
    check_size(op, "token_ids", token_ids, 0, batch, "the rows of hidden");
    check_chain_inputs(op, batch, positions, steps, block_table);
    check_ids(op, token_ids, head.embed.size(0));
    const int64_t *pos = positions.data_ptr<int64_t>(), *st = steps.data_ptr<int64_t>();
    std::vector<int64_t> last(static_cast<size_t>(batch));
    int64_t most = 0;
    for (int64_t b = 0; b < batch; ++b) {
      last[b] = st[b] > 0 ? pos[b] + st[b] - 1 : -1;
      most = std::max(most, st[b]);
    }
    head.check_output(op, hidden);
    head.check_pages(op, block_table.data_ptr<int32_t>(), block_table.size(1), block_size, last,
                     cos);
    PH_CHECK(sin.sizes() == cos.sizes(), op, "sin", "must have cos's shape");
    at::Tensor drafts = at::full({batch, most}, -1, positions.options());
    at::Tensor state = hidden.clone();
    chain(head, std::vector<int64_t>(token_ids.data_ptr<int64_t>(),
                                     token_ids.data_ptr<int64_t>() + batch),
          state, pos, st, block_table.data_ptr<int32_t>(), block_table.size(1), block_size, cos,
          sin, drafts.data_ptr<int64_t>(), most, 0);
    return {drafts, state};
  });
}

// mtp_draft -- the MTP drafter's whole step in one call: the catch-up, one head step over the
// last step's committed rows (token_ids / hidden [N]: sequence s's q_lens[s] rows from position
// past_lens[s] on, its pages catch_table row s), whose picks at rows `picks` [D] are each
// drafting sequence's first draft and whose hidden there the chain starts from; then mtp_chain
// over those D sequences (positions, steps, block_table [D]). Returns (drafts int64
// [D, 1 + max steps], -1 past each one's end; the head's hidden after each chain [D, H]).
std::tuple<at::Tensor, at::Tensor> mtp_draft(
    const at::Tensor& token_ids, const at::Tensor& hidden, const at::Tensor& q_lens,
    const at::Tensor& past_lens, const at::Tensor& catch_table, const at::Tensor& picks,
    const at::Tensor& positions, const at::Tensor& steps, const at::Tensor& block_table,
    int64_t block_size, const at::Tensor& cos, const at::Tensor& sin, const Head& head) {
  return naming("mtp_draft", [&](const char* op) -> std::tuple<at::Tensor, at::Tensor> {
    check_h(op, hidden);
    check_tensor(op, "embed", head.embed, 2, hidden.scalar_type());
    const int64_t rows = hidden.size(0), seqs = q_lens.size(0), drafting = picks.size(0);
    check_tensor(op, "token_ids", token_ids, 1, at::kLong);
    check_size(op, "token_ids", token_ids, 0, rows, "the rows of hidden");
    check_ids(op, token_ids, head.embed.size(0));
    check_tensor(op, "q_lens", q_lens, 1, at::kLong);
    check_tensor(op, "past_lens", past_lens, 1, at::kLong);
    check_size(op, "past_lens", past_lens, 0, seqs, "the sequences of q_lens");
    check_tensor(op, "catch_table", catch_table, 2, at::kInt);
    check_size(op, "catch_table", catch_table, 0, seqs, "the sequences of q_lens");
    check_tensor(op, "picks", picks, 1, at::kLong);
    check_chain_inputs(op, drafting, positions, steps, block_table);
    const int64_t *q = q_lens.data_ptr<int64_t>(), *past = past_lens.data_ptr<int64_t>();
    std::vector<int64_t> last(static_cast<size_t>(seqs));
    int64_t total = 0;
    for (int64_t s = 0; s < seqs; ++s) {
      PH_CHECK(q[s] >= 1 && past[s] >= 0, op, "q_lens", "sequence ", s,
               ": need q_lens >= 1 and past_lens >= 0 (got ", q[s], ", ", past[s], ")");
      last[s] = past[s] + q[s] - 1;
      total += q[s];
    }
    PH_CHECK(total == rows, op, "q_lens", "must sum to the rows of hidden (", rows, "; got ",
             total, ")");
    const int32_t* ct = catch_table.data_ptr<int32_t>();
    const int64_t cw = catch_table.size(1);
    head.check_output(op, hidden);
    head.check_pages(op, ct, cw, block_size, last, cos);
    const int64_t *pk = picks.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
    const int64_t* st = steps.data_ptr<int64_t>();
    std::vector<int64_t> chain_last(static_cast<size_t>(drafting));
    int64_t most = 0;
    for (int64_t d = 0; d < drafting; ++d) {
      PH_CHECK(pk[d] >= 0 && pk[d] < rows, op, "picks", "picks[", d, "] = ", pk[d],
               " is outside the rows of hidden [0, ", rows, ")");
      chain_last[d] = st[d] > 0 ? pos[d] + st[d] - 1 : -1;
      most = std::max(most, st[d]);
    }
    head.check_pages(op, block_table.data_ptr<int32_t>(), block_table.size(1), block_size,
                     chain_last, cos);
    PH_CHECK(sin.sizes() == cos.sizes(), op, "sin", "must have cos's shape");
    // the catch-up: one packed step of every sequence's committed rows
    const auto i64 = positions.options(), i32 = i64.dtype(at::kInt);
    at::Tensor at_pos = at::empty({rows}, i64), write = at::empty({rows}, i64);
    at::Tensor cu = at::empty({seqs + 1}, i32), past32 = at::empty({seqs}, i32);
    at::Tensor order = at::empty({seqs}, i32);
    int64_t *ap = at_pos.data_ptr<int64_t>(), *wp = write.data_ptr<int64_t>();
    int32_t *cp = cu.data_ptr<int32_t>(), *pp = past32.data_ptr<int32_t>();
    int32_t* op32 = order.data_ptr<int32_t>();
    cp[0] = 0;
    for (int64_t s = 0, r = 0; s < seqs; ++s) {
      cp[s + 1] = static_cast<int32_t>(cp[s] + q[s]);
      pp[s] = static_cast<int32_t>(past[s]);
      op32[s] = static_cast<int32_t>(s);
      for (int64_t t = past[s]; t < past[s] + q[s]; ++t, ++r) {
        ap[r] = t;
        wp[r] = static_cast<int64_t>(ct[s * cw + t / block_size]) * block_size + t % block_size;
      }
    }
    const auto [normed, first] = head.step(token_ids, hidden, at_pos, cos, sin, write,
                                           catch_table, cu, past32, order, picks);
    at::Tensor drafts = at::full({drafting, 1 + most}, -1, i64);
    int64_t* dp = drafts.data_ptr<int64_t>();
    const int64_t* fp = first.data_ptr<int64_t>();
    for (int64_t d = 0; d < drafting; ++d) dp[d * (1 + most)] = fp[d];
    at::Tensor state = normed.index_select(0, picks);
    chain(head, std::vector<int64_t>(fp, fp + drafting), state, pos, st,
          block_table.data_ptr<int32_t>(), block_table.size(1), block_size, cos, sin, dp,
          1 + most, 1);
    return {drafts, state};
  });
}

// The ops' flat argument lists (the schema's) into a Head.
#define PH_HEAD_ARGS                                                                            \
  const at::Tensor &embed, const at::Tensor &norm_embedding, const at::Tensor &norm_hidden,    \
      const at::Tensor &fc, at::TensorList fc_quant, const at::Tensor &input_norm,             \
      const at::Tensor &q_proj, const at::Tensor &k_proj, const at::Tensor &v_proj,            \
      const at::Tensor &q_norm, const at::Tensor &k_norm, at::Tensor key_cache,                \
      at::Tensor value_cache, const at::Tensor &o_proj, const at::Tensor &post_norm,           \
      const at::Tensor &gate_proj, const at::Tensor &up_proj, const at::Tensor &down_proj,     \
      int64_t heads, int64_t kv_heads, double scale, double rms_eps, int64_t split,            \
      at::TensorList quant, const at::Tensor &final_norm, const at::Tensor &lm_head,           \
      at::TensorList lm_quant, int64_t quant_bits, bool native_linear
#define PH_HEAD                                                                                \
  Head{embed,     norm_embedding, norm_hidden, fc,      fc_quant,   input_norm, q_proj,        \
       k_proj,    v_proj,         q_norm,      k_norm,  key_cache,  value_cache, o_proj,       \
       post_norm, gate_proj,      up_proj,     down_proj, heads,    kv_heads,   scale,         \
       rms_eps,   split,          quant,       final_norm, lm_head, lm_quant,   quant_bits,    \
       native_linear}

std::tuple<at::Tensor, at::Tensor> mtp_chain_op(
    const at::Tensor& token_ids, const at::Tensor& hidden, const at::Tensor& positions,
    const at::Tensor& steps, const at::Tensor& block_table, int64_t block_size,
    const at::Tensor& cos, const at::Tensor& sin, PH_HEAD_ARGS) {
  return mtp_chain(token_ids, hidden, positions, steps, block_table, block_size, cos, sin,
                   PH_HEAD);
}

std::tuple<at::Tensor, at::Tensor> mtp_draft_op(
    const at::Tensor& token_ids, const at::Tensor& hidden, const at::Tensor& q_lens,
    const at::Tensor& past_lens, const at::Tensor& catch_table, const at::Tensor& picks,
    const at::Tensor& positions, const at::Tensor& steps, const at::Tensor& block_table,
    int64_t block_size, const at::Tensor& cos, const at::Tensor& sin, PH_HEAD_ARGS) {
  return mtp_draft(token_ids, hidden, q_lens, past_lens, catch_table, picks, positions, steps,
                   block_table, block_size, cos, sin, PH_HEAD);
}

// DecodeStack -- a whole decode step of the model in one call: the embedding of the step's
// tokens, every decoder layer (gdn_decode_layer / attention_decode_layer, in the stack's order),
// the final norm and the LM head, exactly as forward_packed runs them one call each (the same
// functions on the same tensors, so every bit of the logits, the pages and the state pools is
// theirs). The model's tensors are bound once (the constructor; the Python side rebuilds it
// when a parameter or a pool is replaced); a step passes only its own: token ids, positions
// (rows of the rope tables), the state slots, the pages to write and read. What a Python step
// spends between the layers -- ~25-70 us a layer on a 2-core server, its frames and the ops'
// argument parsing on caches the weight stream has just evicted -- is gone.
//
// Bound per layer (kinds[l]: 0 Gated DeltaNet, 1 full attention), in `tensors`:
//   0: input_norm, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv_weight [C, K],
//      conv_pool, a_log, dt_bias, pool, gated_norm, out_proj, post_norm, gate, up, down (16)
//   1: input_norm, q_proj, k_proj, v_proj, q_norm, k_norm, key_cache, value_cache, o_proj,
//      post_norm, gate, up, down (13)
// `quant`: each layer's codes / scales / zeros (3 per projection: 8 for a GDN layer, 7 for an
// attention layer) when `quant_bits` is 8 or 4, none otherwise; `ints`: key_heads | heads,
// kv_heads, split; `floats`: scale, l2_eps, gated_eps, rms_eps | scale, rms_eps.
class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(std::vector<int64_t> kinds, std::vector<at::Tensor> tensors,
              std::vector<at::Tensor> quant, std::vector<int64_t> ints,
              std::vector<double> floats, int64_t quant_bits, at::Tensor embed,
              at::Tensor final_norm, double final_eps, at::Tensor lm_head,
              std::vector<at::Tensor> lm_quant, int64_t lm_bits)
      : embed_(std::move(embed)), final_norm_(std::move(final_norm)), final_eps_(final_eps),
        lm_head_(std::move(lm_head)), lm_quant_(std::move(lm_quant)), quant_bits_(quant_bits),
        lm_bits_(lm_bits) {
    const char* op = "DecodeStack";
    size_t t = 0, q = 0, i = 0, f = 0;
    for (const int64_t kind : kinds) {
      PH_CHECK(kind == 0 || kind == 1, op, "kinds", "must be 0 (Gated DeltaNet) or 1 (full "
               "attention) per layer (got ", kind, ")");
      const size_t nt = kind ? 13 : 16, nq = quant_bits ? 3 * (kind ? 7 : 8) : 0;
      const size_t ni = kind ? 3 : 1, nf = kind ? 2 : 4;
      PH_CHECK(t + nt <= tensors.size() && q + nq <= quant.size() && i + ni <= ints.size() &&
                   f + nf <= floats.size(), op, "tensors",
               "too few tensors, quantised tensors, ints or floats for layer ", layers_.size());
      layers_.push_back(Layer{kind == 1,
                              {tensors.begin() + t, tensors.begin() + t + nt},
                              {quant.begin() + q, quant.begin() + q + nq},
                              {ints.begin() + i, ints.begin() + i + ni},
                              {floats.begin() + f, floats.begin() + f + nf}});
      t += nt, q += nq, i += ni, f += nf;
    }
    PH_CHECK(t == tensors.size() && q == quant.size() && i == ints.size() && f == floats.size(),
             op, "tensors", "more tensors, quantised tensors, ints or floats than the ",
             kinds.size(), " layers take");
    check_tensor(op, "embed", embed_, 2, embed_.scalar_type());
  }

  // (logits float32 [R, V] of rows `logits_rows` (every row when absent); the final-norm
  // hidden [N, H] when `want_hidden`, else empty). `native` / `lm_native`: the products' form
  // (the native kernel or torch's GEMM) at N rows and at the LM head's R rows.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor ids, at::Tensor positions,
                                         at::Tensor cos_table, at::Tensor sin_table,
                                         at::Tensor slots, at::Tensor fresh,
                                         at::Tensor write_slots, at::Tensor block_table,
                                         at::Tensor cu_seqlens, at::Tensor past_lens,
                                         at::Tensor seqs, c10::optional<at::Tensor> logits_rows,
                                         bool native, bool lm_native, bool want_hidden) {
    return naming("decode_stack", [&](const char* op) -> std::tuple<at::Tensor, at::Tensor> {
      check_tensor(op, "input_ids", ids, 1, at::kLong);
      check_tensor(op, "positions", positions, 1, at::kLong);
      check_size(op, "positions", positions, 0, ids.size(0), "the token rows");
      check_tensor(op, "cos_table", cos_table, 2, at::kFloat);
      PH_CHECK(sin_table.sizes() == cos_table.sizes(), op, "sin_table", "must have cos_table's "
               "shape");
      const int64_t* pp = positions.data_ptr<int64_t>();
      for (int64_t r = 0; r < positions.size(0); ++r)
        PH_CHECK(pp[r] >= 0 && pp[r] < cos_table.size(0), op, "positions", "positions[", r,
                 "] = ", pp[r], " is outside the rope table's ", cos_table.size(0), " rows");
      const int64_t vocab = embed_.size(0);
      const int64_t* ip = ids.data_ptr<int64_t>();
      for (int64_t r = 0; r < ids.size(0); ++r)
        PH_CHECK(ip[r] >= 0 && ip[r] < vocab, op, "input_ids", "input_ids[", r, "] = ", ip[r],
                 " is outside the vocabulary [0, ", vocab, ")");
      const at::Tensor cos = cos_table.index_select(0, positions);
      const at::Tensor sin = sin_table.index_select(0, positions);
      at::Tensor h = embed_.index_select(0, ids);
      for (const Layer& l : layers_) {
        const std::vector<at::Tensor>& w = l.t;
        if (l.full) {
          h = attention_decode_layer(h, w[0], w[1], w[2], w[3], w[4], w[5], cos, sin, w[6], w[7],
                                     write_slots, block_table, cu_seqlens, past_lens, seqs, w[8],
                                     w[9], w[10], w[11], w[12], l.ints[0], l.ints[1], l.floats[0],
                                     l.floats[1], l.ints[2], native, l.quant, quant_bits_);
        } else {
          h = gdn_decode_layer(h, w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9],
                               slots, fresh, w[10], w[11], w[12], w[13], w[14], w[15], l.ints[0],
                               l.floats[0], l.floats[1], l.floats[2], l.floats[3], native, l.quant,
                               quant_bits_, c10::nullopt, c10::nullopt, c10::nullopt,
                               c10::nullopt, c10::nullopt, c10::nullopt);
        }
      }
      check_quant(op, lm_quant_, 1);
      const Proj lm = proj(lm_head_, lm_quant_, lm_bits_, 0);
      check_head_output(op, h, final_norm_, lm);
      const at::Tensor hidden = want_hidden ? norm(h, final_norm_, final_eps_) : at::Tensor();
      if (logits_rows) {
        check_tensor(op, "logits_rows", *logits_rows, 1, at::kLong);
        const int64_t* lr = logits_rows->data_ptr<int64_t>();
        for (int64_t r = 0; r < logits_rows->size(0); ++r)
          PH_CHECK(lr[r] >= 0 && lr[r] < h.size(0), op, "logits_rows", "logits_rows[", r,
                   "] = ", lr[r], " is outside the token rows [0, ", h.size(0), ")");
        h = h.index_select(0, *logits_rows);
      }
      const at::Tensor logits = product(norm(h, final_norm_, final_eps_), lm, lm_native)
                                    .to(at::kFloat);
      return {logits, want_hidden ? hidden : at::empty({0}, h.options())};
    });
  }

 private:
  struct Layer {
    bool full;
    std::vector<at::Tensor> t, quant;
    std::vector<int64_t> ints;
    std::vector<double> floats;
  };
  std::vector<Layer> layers_;
  at::Tensor embed_, final_norm_;
  double final_eps_;
  at::Tensor lm_head_;
  std::vector<at::Tensor> lm_quant_;
  int64_t quant_bits_, lm_bits_;
};

}  // namespace
}  // namespace pagedhybrid

// the head's arguments of mtp_chain / mtp_draft (PH_HEAD_ARGS) and their results
#define PH_HEAD_SCHEMA                                                                         \
  "Tensor embed, Tensor norm_embedding, Tensor norm_hidden, Tensor fc, Tensor[] fc_quant, "    \
  "Tensor input_norm, Tensor q_proj, Tensor k_proj, Tensor v_proj, Tensor q_norm, "            \
  "Tensor k_norm, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor o_proj, "               \
  "Tensor post_norm, Tensor gate_proj, Tensor up_proj, Tensor down_proj, int heads, "          \
  "int kv_heads, float scale, float rms_eps, int split, Tensor[] quant, Tensor final_norm, "   \
  "Tensor lm_head, Tensor[] lm_quant, int quant_bits, bool native_linear) -> (Tensor, Tensor)"

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.class_<pagedhybrid::DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<double>, int64_t, at::Tensor,
                       at::Tensor, double, at::Tensor, std::vector<at::Tensor>, int64_t>())
      .def("run", &pagedhybrid::DecodeStack::run);
  m.def(
      "mtp_chain(Tensor token_ids, Tensor hidden, Tensor positions, Tensor steps, "
      "Tensor block_table, int block_size, Tensor cos, Tensor sin, "
      PH_HEAD_SCHEMA);
  m.def(
      "mtp_draft(Tensor token_ids, Tensor hidden, Tensor q_lens, Tensor past_lens, "
      "Tensor catch_table, Tensor picks, Tensor positions, Tensor steps, Tensor block_table, "
      "int block_size, Tensor cos, Tensor sin, "
      PH_HEAD_SCHEMA);
  m.def(
      "mtp_head_output(Tensor h, Tensor norm, float rms_eps, Tensor? picks, Tensor lm_head, "
      "bool native_linear, Tensor[] quant, int quant_bits) -> (Tensor, Tensor)");
  m.def(
      "mtp_head_input(Tensor token_ids, Tensor hidden, Tensor embed, Tensor norm_embedding, "
      "Tensor norm_hidden, Tensor fc, float rms_eps, bool native_linear, Tensor[] quant, "
      "int quant_bits) -> Tensor");
  m.def(
      "attention_decode_layer(Tensor h, Tensor input_norm, Tensor q_proj, Tensor k_proj, "
      "Tensor v_proj, Tensor q_norm, Tensor k_norm, Tensor cos, Tensor sin, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor write_slots, Tensor block_table, "
      "Tensor cu_seqlens, Tensor past_lens, Tensor seqs, Tensor o_proj, Tensor post_norm, "
      "Tensor gate_proj, Tensor up_proj, Tensor down_proj, int heads, int kv_heads, "
      "float scale, float rms_eps, int split, bool native_linear, Tensor[] quant, "
      "int quant_bits) -> Tensor");
  m.def(
      "gdn_decode_layer(Tensor h, Tensor input_norm, Tensor in_proj_qkv, Tensor in_proj_z, "
      "Tensor in_proj_b, Tensor in_proj_a, Tensor conv_weight, Tensor(a!) conv_pool, "
      "Tensor a_log, Tensor dt_bias, Tensor(b!) pool, Tensor slots, Tensor fresh, "
      "Tensor gated_norm, Tensor out_proj, Tensor post_norm, Tensor gate_proj, Tensor up_proj, "
      "Tensor down_proj, int key_heads, float scale, float l2_eps, float gated_eps, "
      "float rms_eps, bool native_linear, Tensor[] quant, int quant_bits, "
      "Tensor? cu_seqlens=None, Tensor? verify=None, Tensor(c!)? capsule_conv=None, "
      "Tensor(d!)? decay=None, Tensor(e!)? key=None, Tensor(f!)? delta=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("attention_decode_layer", &pagedhybrid::attention_decode_layer);
  m.impl("gdn_decode_layer", &pagedhybrid::gdn_decode_layer);
  m.impl("mtp_head_input", &pagedhybrid::mtp_head_input);
  m.impl("mtp_head_output", &pagedhybrid::mtp_head_output);
  m.impl("mtp_chain", &pagedhybrid::mtp_chain_op);
  m.impl("mtp_draft", &pagedhybrid::mtp_draft_op);
}

// packed projection weights are MKLDNN tensors, which put their key in the call's dispatch set
TORCH_LIBRARY_IMPL(PH_NS, MkldnnCPU, m) {
  m.impl("attention_decode_layer", &pagedhybrid::attention_decode_layer);
  m.impl("gdn_decode_layer", &pagedhybrid::gdn_decode_layer);
  m.impl("mtp_head_input", &pagedhybrid::mtp_head_input);
  m.impl("mtp_head_output", &pagedhybrid::mtp_head_output);
  m.impl("mtp_chain", &pagedhybrid::mtp_chain_op);
  m.impl("mtp_draft", &pagedhybrid::mtp_draft_op);
}
