// A whole decoder layer of a decode step (one token per sequence) -- or of a step of decodes and
// speculative verify chunks (gdn_decode_mixer's cu_seqlens / verify / capsule) -- in one call:
// gdn_decode_layer (a Gated DeltaNet layer) and attention_decode_layer (a full-attention layer
// over bf16 / fp32 pages, the cache in the model dtype; quantized pages take the modules' path).
//
// The layer's order of operations is not written here: run_layer runs its kind's program,
// kernels/layer_spec.py's declaration (layer_spec.h's kProgram, generated from it), which the
// modules run too (models/qwen35/decoder.py DecoderLayer.forward). Each op of the program is one
// module call there and one native call here:
//
//   norm       rms_norm with the offset weight (the native rms_norm)
//   project    x @ W^T per projection (the native linear / at::linear, or the int8 / int4
//              kernel for all of the op's projections at once)
//   gdn_mixer  gdn_decode_mixer (conv, L2 norms, the gated delta rule, the gated norm)
//   attend     q = rope(rms_norm(query, q_norm)), k = rope(rms_norm(k, k_norm)) -- rope.py's
//              apply_rope, op for op; k, v written to their page slots; paged_attention(q) (the
//              native kernel) * sigmoid(gate)
//   add        h + o (a residual)
//   mlp        (silu(x @ gate^T) * (x @ up^T)) @ down^T
//
// The same checked kernels the modules call run (linear, rms_norm, gdn_decode_mixer,
// paged_attention) and every other step is the same ATen op (silu, sigmoid, mul, add, cat,
// index_copy_, casts), so every bit of the output, the pages and the state pools equals the
// layer's (tests/models/test_qwen35_packed.py). What a Python step spends between ~25 ops per
// layer (argument parsing, dispatch: ~5 us an op on a 2-core server) is gone.
//
// h [B, hidden] and every weight in the model dtype (float32 or bfloat16), the modules' own
// parameters (no stacked copies: a memory-mapped checkpoint stays the only copy); the pools,
// slots and fresh as gdn_decode_mixer takes them. Every shape is checked before a pool or a page
// is written, so a refused call changes nothing.
//
// The MTP head's ops (mtp_head.cpp) and DecodeStack (decode_stack.cpp) run these layers;
// decode_layer.h: what they share.
#include <ATen/ATen.h>
#include <omp.h>

#include <array>
#include <vector>
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
std::vector<at::Tensor> products(const at::Tensor& x, const std::vector<Proj>& ps,
                                 bool native_linear) {
  std::vector<at::Tensor> outs;
  if (!ps.front().codes) {
    for (const Proj& p : ps) outs.push_back(product(x, p, native_linear));
    return outs;
  }
  std::vector<QuantWeightRef> ws;
  for (const Proj& p : ps) {
    ws.push_back({*p.codes, *p.scales, p.zeros});
    outs.push_back(at::empty({x.size(0), p.rows()}, x.options()));
  }
  quant_linear_many(x.is_contiguous() ? x : x.contiguous(), ps.front().bits, ws, outs);
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

// Every weight of a layer checked before the program runs (a pool or a page is written only by
// its mixer op, which checks its own inputs first): the mixer's projections, then `out` [hidden,
// in_dim] (out_proj / o_proj), post_norm [hidden], gate / up [I, hidden], down [hidden, I] -- in
// h's dtype (the norm: float32 or bfloat16).
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

void check_gdn(const char* op, const at::Tensor& h, const LayerFields& L) {
  using namespace gdn;
  namespace p = gdn::projection;
  check_quant(op, L.quant, kProjections);
  const at::Tensor &pool = L.t[gdn::pool], &conv_weight = L.t[gdn::conv_weight];
  const int64_t hidden = h.size(1);
  const auto dt = h.scalar_type();
  check_tensor(op, "pool", pool, 4, at::kFloat);
  const int64_t hv = pool.size(1), vd = hv * pool.size(2);
  PH_CHECK(conv_weight.dim() == 2, op, "conv_weight", "must be [C, K] (got shape ",
           shape_of(conv_weight), ")");
  auto pr = [&](size_t t, size_t i) { return proj(L.t[t], L.quant, L.bits, i); };
  check_weight(op, "in_proj_qkv", pr(in_proj_qkv, p::in_proj_qkv), dt, conv_weight.size(0),
               "the channels of conv_weight", hidden, "the hidden size of h");
  check_weight(op, "in_proj_z", pr(in_proj_z, p::in_proj_z), dt, vd, "Hv Dv of pool", hidden,
               "the hidden size of h");
  check_weight(op, "in_proj_b", pr(in_proj_b, p::in_proj_b), dt, hv, "the value heads of pool",
               hidden, "the hidden size of h");
  check_weight(op, "in_proj_a", pr(in_proj_a, p::in_proj_a), dt, hv, "the value heads of pool",
               hidden, "the hidden size of h");
  check_tail(op, h, "out_proj", pr(out_proj, p::out_proj), vd, L.t[post_norm],
             pr(gate_proj, p::gate_proj), pr(up_proj, p::up_proj), pr(down_proj, p::down_proj));
}

void check_attention(const char* op, const at::Tensor& h, const LayerFields& L,
                     const StepArgs& s) {
  using namespace attention;
  namespace p = attention::projection;
  check_quant(op, L.quant, kProjections);
  const at::Tensor& key_cache = L.t[attention::key_cache];
  const int64_t n = h.size(0), hidden = h.size(1), heads = L.ints[attention::heads],
                kv_heads = L.ints[attention::kv_heads];
  const auto dt = h.scalar_type();
  PH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == dt, op, "key_cache",
           "must be [P, bs, Hkv, D] pages of h's dtype ", dt, " (got ", key_cache.scalar_type(),
           " ", shape_of(key_cache), ")");
  const int64_t hd = key_cache.size(3);
  PH_CHECK(heads >= 1 && kv_heads == key_cache.size(2) && heads % kv_heads == 0, op, "heads",
           "head ratio: heads (", heads, ") must be a multiple of the pages' KV heads (",
           key_cache.size(2), "), and kv_heads (", kv_heads, ") equal to them");
  auto pr = [&](size_t t, size_t i) { return proj(L.t[t], L.quant, L.bits, i); };
  check_weight(op, "q_proj", pr(q_proj, p::q_proj), dt, 2 * heads * hd,
               "2 heads D (query | gate)", hidden, "the hidden size of h");
  check_weight(op, "k_proj", pr(k_proj, p::k_proj), dt, kv_heads * hd, "kv_heads D", hidden,
               "the hidden size of h");
  check_weight(op, "v_proj", pr(v_proj, p::v_proj), dt, kv_heads * hd, "kv_heads D", hidden,
               "the hidden size of h");
  PH_CHECK(hd <= kMaxHead, op, "key_cache", "head size ", hd, " is over ", kMaxHead);
  const at::Tensor &cos = *s.cos, &sin = *s.sin;
  check_tensor(op, "cos", cos, 2, at::kFloat);
  check_tensor(op, "sin", sin, 2, at::kFloat);
  PH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes() && cos.size(1) <= hd &&
               cos.size(1) % 2 == 0, op, "cos",
           "cos and sin must be [N, rotary_dim] with an even rotary_dim <= D (got ",
           shape_of(cos), ", ", shape_of(sin), ")");
  check_norm_weight(op, "q_norm", L.t[q_norm], hd, "the head size D");
  check_norm_weight(op, "k_norm", L.t[k_norm], hd, "the head size D");
  check_tensor(op, "write_slots", *s.write_slots, 1, at::kLong);
  check_size(op, "write_slots", *s.write_slots, 0, n, "the token rows of h");
  check_tail(op, h, "o_proj", pr(o_proj, p::o_proj), heads * hd, L.t[post_norm],
             pr(gate_proj, p::gate_proj), pr(up_proj, p::up_proj), pr(down_proj, p::down_proj));
}

// The program's ops (layer_spec.py OPS), each reading its fields by their places in `st`.

// gdn_mixer(qkv, z, a, b; conv_weight, conv_pool, a_log, dt_bias, pool, gated_norm, key_heads,
// scale, l2_eps, gated_eps)
at::Tensor gdn_mixer_op(const Step& st, const at::Tensor* in, const LayerFields& L,
                        const StepArgs& s) {
  const int8_t* f = st.fields;
  const at::Tensor& pool = L.t[f[4]];
  at::Tensor y = at::empty({in[0].size(0), pool.size(1) * pool.size(2)}, in[0].options());
  gdn_decode_mixer(in[0], in[1], in[2], in[3], L.t[f[0]], L.t[f[1]], L.t[f[2]], L.t[f[3]], pool,
                   *s.slots, *s.fresh, L.t[f[5]], y, L.ints[f[6]], L.floats[f[7]],
                   L.floats[f[8]], L.floats[f[9]], s.gdn_cu_seqlens, s.verify, s.capsule_conv,
                   s.decay, s.key, s.delta);
  return y;
}

// attend(q | gate, k, v; q_norm, k_norm, key_cache, value_cache, heads, kv_heads, scale,
// rms_eps, split)
at::Tensor attend_op(const char* op, const Step& st, const at::Tensor* in, const LayerFields& L,
                     const StepArgs& s) {
  const int8_t* f = st.fields;
  const at::Tensor &q_norm = L.t[f[0]], &k_norm = L.t[f[1]];
  at::Tensor key_cache = L.t[f[2]], value_cache = L.t[f[3]];
  const int64_t heads = L.ints[f[4]], kv_heads = L.ints[f[5]], split = L.ints[f[8]];
  const double scale = L.floats[f[6]], rms_eps = L.floats[f[7]];
  const at::Tensor &cos = *s.cos, &sin = *s.sin, &write_slots = *s.write_slots;
  const int64_t n = in[0].size(0), hd = key_cache.size(3);
  const auto dt = in[0].scalar_type();
  const at::Tensor gate = in[0].view({n, heads, 2 * hd}).narrow(2, hd, hd)
                              .reshape({n, heads * hd});
  at::Tensor qf = at::empty({n, heads, hd}, in[0].options().dtype(at::kFloat));
  at::Tensor k = at::empty({n, kv_heads, hd}, in[0].options());
  const at::Tensor v = in[2].view({n, kv_heads, hd});
  if (dt == at::kFloat) {
    norm_rope<float, float>(in[0].data_ptr<float>(), 2 * heads * hd, 2 * hd, n, heads, hd,
                            q_norm, rms_eps, cos, sin, qf.data_ptr<float>());
    norm_rope<float, float>(in[1].data_ptr<float>(), kv_heads * hd, hd, n, kv_heads, hd, k_norm,
                            rms_eps, cos, sin, k.data_ptr<float>());
  } else {
    using B = c10::BFloat16;
    norm_rope<B, float>(in[0].data_ptr<B>(), 2 * heads * hd, 2 * hd, n, heads, hd, q_norm,
                        rms_eps, cos, sin, qf.data_ptr<float>());
    norm_rope<B, B>(in[1].data_ptr<B>(), kv_heads * hd, hd, n, kv_heads, hd, k_norm, rms_eps,
                    cos, sin, k.data_ptr<B>());
  }
  at::Tensor attn = at::empty({n, heads, hd}, in[0].options().dtype(at::kFloat));
  check_paged_attention(qf, key_cache, value_cache, *s.block_table, *s.cu_seqlens, *s.past_lens,
                        *s.seqs, attn, split);  // before a page is written
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    PH_CHECK(ws[i] >= 0 && ws[i] < slots, op, "write_slots", "write_slots[", i, "] = ", ws[i],
             " is outside the pages' ", slots, " slots");
  key_cache.view({-1, kv_heads, hd}).index_copy_(0, write_slots, k);
  value_cache.view({-1, kv_heads, hd}).index_copy_(0, write_slots, v);
  paged_attention(qf, key_cache, value_cache, *s.block_table, *s.cu_seqlens, *s.past_lens,
                  *s.seqs, attn, scale, split);
  return serial([&] { return at::mul(attn.to(dt).reshape({n, -1}), at::sigmoid(gate)); });
}

// The kind's program (layer_spec.h), h the layer's input and its output
struct Program {
  const Step* steps;
  size_t size;
  const int8_t* projection_of;  // a tensor field's place among the projections (or -1)
};
constexpr size_t kMaxRegisters = 16;
static_assert(gdn::kRegisters <= kMaxRegisters && attention::kRegisters <= kMaxRegisters);

at::Tensor run_layer(const char* op, const Program& program, const at::Tensor& h,
                     const LayerFields& L, const StepArgs& s) {
  std::array<at::Tensor, kMaxRegisters> r;
  r[0] = h;
  std::array<at::Tensor, kMaxIns> in;
  for (size_t i = 0; i < program.size; ++i) {
    const Step& st = program.steps[i];
    for (size_t j = 0; j < st.n_ins; ++j) in[j] = r[st.ins[j]];
    auto projection = [&](size_t j) {
      return proj(L.t[st.fields[j]], L.quant, L.bits, program.projection_of[st.fields[j]]);
    };
    at::Tensor& out = r[st.outs[0]];
    switch (st.op) {
      case OpCode::norm:
        out = norm(in[0], L.t[st.fields[0]], L.floats[st.fields[1]]);
        break;
      case OpCode::project: {
        std::vector<Proj> ps;
        for (size_t j = 0; j < st.n_fields; ++j) ps.push_back(projection(j));
        std::vector<at::Tensor> outs = products(in[0], ps, s.native);
        for (size_t j = 0; j < st.n_outs; ++j) r[st.outs[j]] = std::move(outs[j]);
        break;
      }
      case OpCode::gdn_mixer:
        out = gdn_mixer_op(st, in.data(), L, s);
        break;
      case OpCode::attend:
        out = attend_op(op, st, in.data(), L, s);
        break;
      case OpCode::add:
        out = serial([&] { return at::add(in[0], in[1]); });
        break;
      case OpCode::mlp: {
        const std::vector<at::Tensor> gu = products(in[0], {projection(0), projection(1)},
                                                    s.native);
        const at::Tensor m = serial([&] { return at::mul(at::silu(gu[0]), gu[1]); });
        out = product(m, projection(2), s.native);
        break;
      }
    }
  }
  return r[0];
}

}  // namespace

at::Tensor decode_layer(int64_t kind, const at::Tensor& h, const LayerFields& L,
                        const StepArgs& s) {
  const bool full = kind == attention::kKind;
  return naming(full ? "attention_decode_layer" : "gdn_decode_layer", [&](const char* op) {
    check_h(op, h);
    if (full) {
      check_attention(op, h, L, s);
      return run_layer(op, {attention::kProgram, attention::kSteps, attention::kProjectionOf}, h,
                       L, s);
    }
    check_gdn(op, h, L);
    return run_layer(op, {gdn::kProgram, gdn::kSteps, gdn::kProjectionOf}, h, L, s);
  });
}

// the registered layer ops (kernels.h: mtp_head.cpp runs attention_decode_layer too): their
// fields in the spec's order

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
  const std::array<at::Tensor, attention::kTensors> t{
      input_norm, q_proj, k_proj, v_proj, q_norm, k_norm, key_cache, value_cache, o_proj,
      post_norm, gate_proj, up_proj, down_proj};
  const std::array<int64_t, attention::kInts> ints{heads, kv_heads, split};
  const std::array<double, attention::kFloats> floats{scale, rms_eps};
  StepArgs s;
  s.native = native_linear;
  s.cos = &cos, s.sin = &sin, s.write_slots = &write_slots, s.block_table = &block_table;
  s.cu_seqlens = &cu_seqlens, s.past_lens = &past_lens, s.seqs = &seqs;
  return decode_layer(attention::kKind, h, LayerFields{t, quant, quant_bits, ints, floats}, s);
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
  const std::array<at::Tensor, gdn::kTensors> t{
      input_norm, in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv_weight, conv_pool, a_log,
      dt_bias, pool, gated_norm, out_proj, post_norm, gate_proj, up_proj, down_proj};
  const std::array<int64_t, gdn::kInts> ints{key_heads};
  const std::array<double, gdn::kFloats> floats{scale, l2_eps, gated_eps, rms_eps};
  StepArgs s;
  s.native = native_linear;
  s.slots = &slots, s.fresh = &fresh;
  s.gdn_cu_seqlens = cu_seqlens, s.verify = verify, s.capsule_conv = capsule_conv;
  s.decay = decay, s.key = key, s.delta = delta;
  return decode_layer(gdn::kKind, h, LayerFields{t, quant, quant_bits, ints, floats}, s);
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
