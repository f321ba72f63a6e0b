// The checked entry points one op file calls in another (decode_layer.cpp, mtp_head.cpp and
// decode_stack.cpp compose them), with hidden visibility: every CPU form's library has its own,
// never another's.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

#define PH_LOCAL __attribute__((visibility("hidden")))

namespace pagedhybrid {

// linear.cpp: out [M, N] = x [M, K] @ w [N, K]^T (the fast form)
PH_LOCAL void linear(const at::Tensor& x, const at::Tensor& w, at::Tensor out);

// quant.cpp: out [M, N] = x [M, K] @ dequant(codes, scales, zeros)^T (int8 / int4 weights,
// activations quantised per row; the batch-invariant integer form), and its weight checks with
// every argument named `name` + "codes" / "scales" / "zeros"
PH_LOCAL void quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& zeros, int64_t bits, at::Tensor out);
// ... and several weights of one format by the same activations in one call (x quantised once,
// one parallel step): outs[j] [M, N_j] = x @ dequant(ws[j])^T
struct QuantWeightRef {
  const at::Tensor& codes;
  const at::Tensor& scales;
  const c10::optional<at::Tensor>& zeros;
};
PH_LOCAL void quant_linear_many(const at::Tensor& x, int64_t bits,
                                const std::vector<QuantWeightRef>& ws,
                                const std::vector<at::Tensor>& outs);
// the rows N of a weight's codes (in rows [N, nb, bytes] or in groups of 16 [N / 16, nb, L, 64])
PH_LOCAL int64_t quant_weight_rows(const at::Tensor& codes);
PH_LOCAL void check_quant_weight(const char* op, const std::string& name,
                                 const at::Tensor& codes, const at::Tensor& scales,
                                 const c10::optional<at::Tensor>& zeros, int64_t bits, int64_t k);

// norms.cpp: out = x * rsqrt(mean(x^2) + eps) * (offset ? 1 + w : w), rows of x [R, D]
PH_LOCAL void rms_norm(const at::Tensor& x, const at::Tensor& w, at::Tensor out, double eps,
                       bool offset);

// sampling.cpp: int64 [R], the first maximum of each row of fp32 logits [R, V] (-1: a row with
// a NaN or an infinity)
PH_LOCAL at::Tensor greedy_rows(const at::Tensor& logits,
                                const c10::optional<at::Tensor>& allowed);
PH_LOCAL void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& allowed);
// the k best of each of `rows` rows (no NaN): fp32 values and int64 ids [len(rows), k], by value
// then id
PH_LOCAL std::tuple<at::Tensor, at::Tensor> top_rows(const at::Tensor& logits,
                                                     at::IntArrayRef rows, int64_t k);

// paged_attention.cpp: out float32 [N, Hq, D] = attention of q float32 over the pages (causal
// unless is_causal is false; a local window where local_window_size > 0)
PH_LOCAL void paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_table,
                              const at::Tensor& cu_seqlens, const at::Tensor& past_lens,
                              const at::Tensor& seqs, at::Tensor out, double scale,
                              int64_t split, int64_t local_window_size = -1,
                              bool is_causal = true);

// paged_attention's checks alone (before a caller writes the step's K/V into the pages)
PH_LOCAL void check_paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& block_table,
                                    const at::Tensor& cu_seqlens, const at::Tensor& past_lens,
                                    const at::Tensor& seqs, const at::Tensor& out,
                                    int64_t split);

// gdn_mixer.cpp: the Gated DeltaNet mixer of a decode step (or of decodes and verify chunks)
PH_LOCAL void gdn_decode_mixer(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& a,
                               const at::Tensor& b, const at::Tensor& conv_weight,
                               at::Tensor conv_pool, const at::Tensor& a_log,
                               const at::Tensor& dt_bias, at::Tensor pool,
                               const at::Tensor& slots, const at::Tensor& fresh,
                               const at::Tensor& norm_weight, at::Tensor out, int64_t key_heads,
                               double scale, double l2_eps, double norm_eps,
                               const c10::optional<at::Tensor>& cu_seqlens,
                               const c10::optional<at::Tensor>& verify,
                               const c10::optional<at::Tensor>& capsule_conv,
                               const c10::optional<at::Tensor>& decay,
                               const c10::optional<at::Tensor>& key,
                               const c10::optional<at::Tensor>& delta);

// decode_layer.cpp: a whole decoder layer of a decode step (or of decodes and verify chunks) in
// one call, h [B, hidden] -> the layer's output (mtp_head.cpp's head and decode_stack.cpp's
// DecodeStack run them)
PH_LOCAL at::Tensor attention_decode_layer(
    const at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& q_proj,
    const at::Tensor& k_proj, const at::Tensor& v_proj, const at::Tensor& q_norm,
    const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_cache,
    at::Tensor value_cache, const at::Tensor& write_slots, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens, const at::Tensor& past_lens, const at::Tensor& seqs,
    const at::Tensor& o_proj, const at::Tensor& post_norm, const at::Tensor& gate_proj,
    const at::Tensor& up_proj, const at::Tensor& down_proj, int64_t heads, int64_t kv_heads,
    double scale, double rms_eps, int64_t split, bool native_linear, at::TensorList quant,
    int64_t quant_bits);
PH_LOCAL at::Tensor gdn_decode_layer(
    const at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& in_proj_qkv,
    const at::Tensor& in_proj_z, const at::Tensor& in_proj_b, const at::Tensor& in_proj_a,
    const at::Tensor& conv_weight, at::Tensor conv_pool, const at::Tensor& a_log,
    const at::Tensor& dt_bias, at::Tensor pool, const at::Tensor& slots, const at::Tensor& fresh,
    const at::Tensor& gated_norm, const at::Tensor& out_proj, const at::Tensor& post_norm,
    const at::Tensor& gate_proj, const at::Tensor& up_proj, const at::Tensor& down_proj,
    int64_t key_heads, double scale, double l2_eps, double gated_eps, double rms_eps,
    bool native_linear, at::TensorList quant, int64_t quant_bits,
    const c10::optional<at::Tensor>& cu_seqlens, const c10::optional<at::Tensor>& verify,
    const c10::optional<at::Tensor>& capsule_conv, const c10::optional<at::Tensor>& decay,
    const c10::optional<at::Tensor>& key, const c10::optional<at::Tensor>& delta);

}  // namespace pagedhybrid
