// What the fused decode ops share -- the layers (decode_layer.cpp), the MTP head (mtp_head.cpp)
// and the whole step (decode_stack.cpp): a projection (its weight or its int8 / int4 codes) and
// its product, the norm, the checks of the weights, and `naming`. decode_layer.cpp defines them
// (check_head_output: mtp_head.cpp). Hidden visibility, as kernels.h's: every CPU form's
// library has its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

#include "kernels.h"

namespace pagedhybrid {

// One layer's fields (kernels/layer_spec.py), each list in the spec's order (layer_spec.h's
// indices): its tensors (weights, projections' weights or codes, cache pools), its projections'
// int8 / int4 tensors (`quant`, `bits`), its ints and floats.
struct PH_LOCAL LayerFields {
  at::TensorList t, quant;
  int64_t bits;
  at::IntArrayRef ints;
  at::ArrayRef<double> floats;
};

// What a step gives each layer: the products' form (`native`: the native linear, else torch's);
// a full-attention layer's rope rows (cos, sin [N, rotary_dim]) and pages (the slots its K/V
// are written to, the sequences' tables and lengths); a Gated DeltaNet layer's state slots and
// fresh flags and gdn_decode_mixer's verify-step arguments (absent in a decode step).
struct PH_LOCAL StepArgs {
  bool native = true;
  const at::Tensor *cos = nullptr, *sin = nullptr, *write_slots = nullptr,
                   *block_table = nullptr, *cu_seqlens = nullptr, *past_lens = nullptr,
                   *seqs = nullptr;
  const at::Tensor *slots = nullptr, *fresh = nullptr;
  c10::optional<at::Tensor> gdn_cu_seqlens, verify, capsule_conv, decay, key, delta;
};

// A decoder layer of `kind` (gdn::kKind or attention::kKind): its fields checked, then its
// program run (decode_layer.cpp run_layer). The registered gdn_decode_layer /
// attention_decode_layer ops and DecodeStack call it.
PH_LOCAL at::Tensor decode_layer(int64_t kind, const at::Tensor& h, const LayerFields& L,
                                 const StepArgs& s);

// One projection: its weight, or -- a model with int8 / int4 weights (`quant`, 3 tensors per
// projection in the layer's order: codes, scales, zeros (empty: symmetric); `bits`) -- its codes
// (which the Python side passes in the weight's argument).
struct PH_LOCAL Proj {
  const at::Tensor& w;
  const at::Tensor* codes = nullptr;
  const at::Tensor* scales = nullptr;
  c10::optional<at::Tensor> zeros;
  int64_t bits = 0;
  int64_t rows() const { return codes ? quant_weight_rows(*codes) : w.size(0); }
};

// Projection i of a layer: its weight w, or its codes in `quant` (when not empty)
PH_LOCAL Proj proj(const at::Tensor& w, at::TensorList quant, int64_t bits, size_t i);
// The number of quantised tensors a layer of `projections` needs (none, or 3 per projection).
PH_LOCAL void check_quant(const char* op, at::TensorList quant, size_t projections);
// x @ p^T: the integer kernel (int8 / int4 codes), the native `linear` or at::linear
PH_LOCAL at::Tensor product(const at::Tensor& x, const Proj& p, bool native_linear);
// rms_norm(x, w) with the offset weight (1 + w)
PH_LOCAL at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps);
// A projection weight [rows, cols] in the model dtype (or its codes holding rows x cols).
PH_LOCAL void check_weight(const char* op, const char* arg, const Proj& p, at::ScalarType dt,
                           int64_t rows, const char* rows_are, int64_t cols,
                           const char* cols_are);
// h [B, hidden], float32 or bfloat16
PH_LOCAL void check_h(const char* op, const at::Tensor& h);
// The final norm [H] and LM head [V, H] (or its codes) of the head's output, for h [N, H]
// (mtp_head.cpp).
PH_LOCAL void check_head_output(const char* op, const at::Tensor& h, const at::Tensor& norm_w,
                                const Proj& lm);

namespace {  // internal linkage: every CPU form's library has its own copy

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

}  // namespace
}  // namespace pagedhybrid
