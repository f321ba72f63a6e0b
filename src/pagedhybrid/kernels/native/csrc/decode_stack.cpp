// DecodeStack: a whole decode step of the model in one native call, the layers
// (decode_layer.cpp) one after the other between the embedding and the LM head.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "decode_layer.h"
#include "kernels.h"
#include "layer_spec.h"

namespace pagedhybrid {
namespace {

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
// Bound per layer (kinds[l]: gdn::kKind or attention::kKind), in `tensors`, `ints` and `floats`:
// its fields of each type in the order of kernels/layer_spec.py (layer_spec.h, generated from
// it, names their places and counts); `quant`: each projection's codes / scales / zeros in the
// layer's order when `quant_bits` is 8 or 4, none otherwise.
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
      PH_CHECK(kind == gdn::kKind || kind == attention::kKind, op, "kinds", "must be ",
               gdn::kKind, " (Gated DeltaNet) or ", attention::kKind, " (full attention) per "
               "layer (got ", kind, ")");
      const bool full = kind == attention::kKind;
      const size_t nt = full ? attention::kTensors : gdn::kTensors;
      const size_t nq = quant_bits ? 3 * (full ? attention::kProjections : gdn::kProjections) : 0;
      const size_t ni = full ? attention::kInts : gdn::kInts;
      const size_t nf = full ? attention::kFloats : gdn::kFloats;
      PH_CHECK(t + nt <= tensors.size() && q + nq <= quant.size() && i + ni <= ints.size() &&
                   f + nf <= floats.size(), op, "tensors",
               "too few tensors, quantised tensors, ints or floats for layer ", layers_.size());
      layers_.push_back(Layer{kind,
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
      StepArgs s;  // every layer's part of the step
      s.native = native;
      s.cos = &cos, s.sin = &sin, s.write_slots = &write_slots, s.block_table = &block_table;
      s.cu_seqlens = &cu_seqlens, s.past_lens = &past_lens, s.seqs = &seqs;
      s.slots = &slots, s.fresh = &fresh;
      for (const Layer& l : layers_)
        h = decode_layer(l.kind, h, LayerFields{l.t, l.quant, quant_bits_, l.ints, l.floats}, s);
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
    int64_t kind;
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

TORCH_LIBRARY_FRAGMENT(PH_NS, m) {
  m.class_<pagedhybrid::DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<int64_t>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<double>, int64_t, at::Tensor,
                       at::Tensor, double, at::Tensor, std::vector<at::Tensor>, int64_t>())
      .def("run", &pagedhybrid::DecodeStack::run);
}
