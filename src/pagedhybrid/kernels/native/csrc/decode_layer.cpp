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
// is written, so a refused call changes nothing. `quant`: the projections' tensors in the order of
// kernels/layer_spec.py (layer_spec.h's projection indices).
//
// The MTP head's ops (mtp_head.cpp) and DecodeStack (decode_stack.cpp) run these layers;
// decode_layer.h: what they share.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include "common.h"
#include "decode_layer.h"
#include "kernels.h"
#include "layer_spec.h"
#include "rows.h"

namespace pagedhybrid {

// shared with mtp_head.cpp and decode_stack.cpp (decode_layer.h)

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

at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm(x, w, out, eps, true);
  return out;
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

void check_h(const char* op, const at::Tensor& h) {
  check_tensor(op, "h", h, 2, h.scalar_type());
  PH_CHECK(h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16, op, "h",
           "dtype must be float32 or bfloat16 (got ", h.scalar_type(), ")");
}

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

}  // namespace

// the layer ops (kernels.h: mtp_head.cpp and decode_stack.cpp run them too)

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
    namespace p = attention::projection;
    check_quant(op, quant, attention::kProjections);
    const Proj q_p = proj(q_proj, quant, quant_bits, p::q_proj),
               k_p = proj(k_proj, quant, quant_bits, p::k_proj),
               v_p = proj(v_proj, quant, quant_bits, p::v_proj),
               o_p = proj(o_proj, quant, quant_bits, p::o_proj),
               gate_p = proj(gate_proj, quant, quant_bits, p::gate_proj),
               up_p = proj(up_proj, quant, quant_bits, p::up_proj),
               down_p = proj(down_proj, quant, quant_bits, p::down_proj);
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
    namespace p = gdn::projection;
    check_quant(op, quant, gdn::kProjections);
    const Proj qkv_p = proj(in_proj_qkv, quant, quant_bits, p::in_proj_qkv),
               z_p = proj(in_proj_z, quant, quant_bits, p::in_proj_z),
               b_p = proj(in_proj_b, quant, quant_bits, p::in_proj_b),
               a_p = proj(in_proj_a, quant, quant_bits, p::in_proj_a),
               out_p = proj(out_proj, quant, quant_bits, p::out_proj),
               gate_p = proj(gate_proj, quant, quant_bits, p::gate_proj),
               up_p = proj(up_proj, quant, quant_bits, p::up_proj),
               down_p = proj(down_proj, quant, quant_bits, p::down_proj);
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

}  // namespace pagedhybrid

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
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
}

// packed projection weights are MKLDNN tensors, which put their key in the call's dispatch set
TORCH_LIBRARY_IMPL(PH_NS, MkldnnCPU, m) {
  m.impl("attention_decode_layer", &pagedhybrid::attention_decode_layer);
  m.impl("gdn_decode_layer", &pagedhybrid::gdn_decode_layer);
}
