// The MTP head's ops, each in one call: mtp_head_input (its input, up to its decoder layer),
// mtp_head_output (after it: the final norm and the greedy pick of the LM head), and the
// drafter's chain (mtp_chain) and whole step (mtp_draft), which run the head -- mtp_head_input,
// decode_layer.cpp's attention_decode_layer, mtp_head_output -- step after step. The same
// kernels the modules call, so every bit is theirs (decode_layer.h: the products and checks).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "decode_layer.h"
#include "kernels.h"
#include "rows.h"

namespace pagedhybrid {

// shared with decode_stack.cpp (decode_layer.h)

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

namespace {

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
}

TORCH_LIBRARY_IMPL(PH_NS, CPU, m) {
  m.impl("mtp_head_input", &pagedhybrid::mtp_head_input);
  m.impl("mtp_head_output", &pagedhybrid::mtp_head_output);
  m.impl("mtp_chain", &pagedhybrid::mtp_chain_op);
  m.impl("mtp_draft", &pagedhybrid::mtp_draft_op);
}

// packed projection weights are MKLDNN tensors, which put their key in the call's dispatch set
TORCH_LIBRARY_IMPL(PH_NS, MkldnnCPU, m) {
  m.impl("mtp_head_input", &pagedhybrid::mtp_head_input);
  m.impl("mtp_head_output", &pagedhybrid::mtp_head_output);
  m.impl("mtp_chain", &pagedhybrid::mtp_chain_op);
  m.impl("mtp_draft", &pagedhybrid::mtp_draft_op);
}
