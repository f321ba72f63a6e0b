"""The packed paged hybrid decoder graph of a Qwen3.5 model, built with ``onnx_ir``.

``build_packed_model(config, options, weights)`` emits, for ``N`` packed tokens:

1. ``Gather(embed_tokens, input_ids)`` -> ``h [N, hidden]``; MRoPE cos/sin from ``position_ids``
   once (``full.rope_tables``).
2. Per decoder layer ``i`` (pre-norm residual, the partition is ``config.layer_types``):
   ``h = h + mixer(input_layernorm(h))``, ``h = h + mlp(post_attention_layernorm(h))`` (each
   residual add fused into the next norm, ``SkipSimplifiedLayerNormalization``) where the
   mixer is ``full.emit_full_attention`` (PagedAttention on the layer's page buffers) or
   ``linear.emit_gated_delta_net`` (varlen conv + GatedDeltaNet on the per-sequence states);
   the MLP is ``down(silu(gate(x)) · up(x))`` (gate|up as one MatMul), or in a
   mixture-of-experts model (``qwen3_5_moe_text``) ``moe.emit_moe``: one
   ``com.microsoft.MoE`` for the routed experts plus the gated shared expert
   (``emit_feed_forward`` picks).
3. With ``prune_logits`` the rows ``cumulative_sequence_lengths[1:] - 1`` are gathered (as the
   torch model does, before the row-wise final norm); final OffsetRMSNorm; ``lm_head`` (the
   transposed embedding when tied); ``Cast`` to float ->
   ``logits``.

With ``--weights`` every projection (the LM head included) is one ``com.microsoft.MatMulNBits``
(``export/nbits.py``).

Inputs and outputs are exactly ``PackedAbi.inputs()`` / ``.outputs()`` in that order;
``metadata_props`` record the ABI (block size, layer partition) and the runtime pins.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import PackedAbi, TensorSpec
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.export.full import PagedInputs, emit_full_attention, rope_tables
from pagedhybrid.export.linear import emit_gated_delta_net
from pagedhybrid.export.moe import emit_moe
from pagedhybrid.export.options import ExportOptions, check_export
from pagedhybrid.export.weights import WeightSource
from pagedhybrid.kvquant import KVScales
from pagedhybrid.models.qwen35.config import Qwen35Config

LayerCallback = Callable[[int, int], None]  # (layers done, layers total)


def emit_mlp(b: GraphBuilder, i: int, x: ir.Value, layer: str | None = None) -> ir.Value:
    """Layer ``i``'s MLP (checkpoint layer ``layer``, default ``model.layers.{i}``)."""
    layer = layer or f"model.layers.{i}"
    p = f"/model/layers.{i}/mlp" if layer == f"model.layers.{i}" else f"/{layer}/mlp"
    w = f"{layer}.mlp"
    inter = b.weights.shapes[f"{w}.up_proj.weight"][0]
    gate, up = b.fused_matmul(x, f"{w}.gate_up_proj.weight",
                              [f"{w}.gate_proj.weight", f"{w}.up_proj.weight"], [inter, inter],
                              f"{p}/gate_up_proj")  # [N, I] x2
    prod = b.op1("Mul", [b.silu(gate, f"{p}/act"), up], f"{p}/Mul")  # [N, I]
    return b.matmul(prod, f"{w}.down_proj.weight", f"{p}/down_proj")  # [N, hidden]


def emit_feed_forward(b: GraphBuilder, config: Qwen35Config, i: int, x: ir.Value,
                      layer: str | None = None) -> ir.Value:
    """Layer ``i``'s feed-forward: the MoE block of a mixture-of-experts model, else the MLP."""
    return emit_moe(b, config, i, x, layer) if config.is_moe else emit_mlp(b, i, x, layer)


def build_packed_model(config: Qwen35Config, options: ExportOptions, weights: WeightSource,
                       on_layer: LayerCallback | None = None,
                       kv_scales: dict[int, KVScales] | None = None) -> ir.Model:
    """The graph; ``kv_scales`` (every full layer's) are required with quantized pages."""
    check_export(config, options)
    if options.kv_cache_dtype and set(kv_scales or {}) != set(config.full_attention_layers):
        raise UnsupportedConfiguration(
            f"--kv-cache-dtype {options.kv_cache_dtype}: the KV scales of every full-attention "
            f"layer {list(config.full_attention_layers)} are needed (pagedhybrid calibrate-kv)")
    abi = PackedAbi(config, options)
    b = GraphBuilder(weights, options.onnx_dtype, options.weight_quant)
    for spec in abi.inputs():
        b.add_input(spec)
    inp = b.inputs
    paged = PagedInputs(inp[c.CU_SEQLENS], inp[c.PAST_SEQLENS], inp[c.BLOCK_TABLE],
                        inp[c.ATTENTION_METADATA])
    embed = b.weight("model.embed_tokens.weight")  # [V, hidden]
    h = b.op1("Gather", [embed, inp[c.INPUT_IDS]], "/model/embed_tokens/Gather")  # [N, hidden]
    rope = rope_tables(b, config, inp[c.POSITION_IDS])
    eps = config.rms_norm_eps
    full = set(config.full_attention_layers)
    n_layers = config.num_hidden_layers
    delta: ir.Value | None = None  # the previous MLP output, not yet added to h
    for i in range(n_layers):
        p, w = f"/model/layers.{i}", f"model.layers.{i}"
        if delta is None:
            x = b.offset_rms_norm(h, f"{w}.input_layernorm.weight", eps, f"{p}/input_layernorm")
        else:  # h += previous MLP output, fused with this layer's input norm
            x, h = b.skip_rms_norm(h, delta, f"{w}.input_layernorm.weight", eps,
                                   f"{p}/input_layernorm")
        if i in full:
            out = emit_full_attention(b, config, i, x, rope, paged, inp[c.PAST_KEY % i],
                                      inp[c.PAST_VALUE % i],
                                      (kv_scales or {}).get(i) if options.kv_cache_dtype
                                      else None)
        else:
            out = emit_gated_delta_net(
                b, config, i, x, inp[c.CU_SEQLENS], inp[c.PAST_CONV % i],
                inp[c.PAST_RECURRENT % i],
                (inp[c.STATE_UPDATE_CAPTURE_COUNT], inp[c.STATE_UPDATE_ACTIVE], abi.capacity)
                if abi.capacity else None)
        x, h = b.skip_rms_norm(h, out, f"{w}.post_attention_layernorm.weight", eps,
                               f"{p}/post_attention_layernorm")  # h += attention output
        delta = emit_feed_forward(b, config, i, x)  # [N, hidden]
        if on_layer is not None:
            on_layer(i + 1, n_layers)
    assert delta is not None
    # The last residual add stays a plain Add so that pruning can gather rows before the norm
    # and the pruned rows equal the unpruned ones.
    h = b.op1("Add", [h, delta], f"/model/layers.{n_layers - 1}/residual_mlp/Add")  # [N, hidden]
    if options.mtp:  # every row's final-norm hidden, for the MTP head (before any pruning)
        b.offset_rms_norm(h, "model.norm.weight", eps, "/model/norm_hidden",
                          output=c.HIDDEN_STATES)
    if options.prune_logits:
        ends = b.op1("Slice", [inp[c.CU_SEQLENS], b.const_i64([1]), b.const_i64([2**62]),
                               b.const_i64([0])], "/model/prune/Slice")  # [B] int32
        one = b.op1("Cast", [b.const_i64([1])], "/model/prune/One", {"to": ir.DataType.INT32})
        rows = b.op1("Sub", [ends, one], "/model/prune/Sub")  # [B]: cu[1:] - 1
        h = b.op1("Gather", [h, rows], "/model/prune/Gather", {"axis": 0})  # [B, hidden]
    h = b.offset_rms_norm(h, "model.norm.weight", eps, "/model/norm")  # [rows, hidden]
    emit_lm_head(b, config, embed, h)
    return b.model(named_outputs(b, abi.outputs()), abi.metadata_props())


def emit_lm_head(b: GraphBuilder, config: Qwen35Config, embed: ir.Value, h: ir.Value
                 ) -> ir.Value:
    """``logits`` (float ``[rows, V]``) of the normalised ``h``: the transposed embedding when
    tied, ``lm_head.weight`` otherwise; with ``--weights`` (unless ``--no-quantize-lm-head``)
    a MatMulNBits of its own codes (a tied head's quantised from the embedding table, which
    the ``Gather`` keeps reading in the activation dtype)."""
    quantize = b.nbits is not None and b.nbits.lm_head
    if config.tie_word_embeddings and not quantize:
        head = b.op1("Transpose", [embed], "/lm_head/TransposeEmbedding", {"perm": [1, 0]})
        logits = b.op1("MatMul", [h, head], "/lm_head/MatMul")  # [rows, V]
    else:
        tied = ["model.embed_tokens.weight"] if config.tie_word_embeddings else None
        logits = b.matmul(h, "lm_head.weight", "/lm_head", quantize=quantize,
                          sources=tied)  # [rows, V]
    return b.op1("Cast", [logits], "/lm_head/Cast", {"to": ir.DataType.FLOAT},
                 output=c.LOGITS)


def named_outputs(b: GraphBuilder, specs: list[TensorSpec]) -> list[ir.Value]:
    """The graph's values of ``specs`` (by name), typed and shaped as the ABI says."""
    by_name = {v.name: v for node in b.tape.nodes for v in node.outputs}
    outputs = [by_name[spec.name] for spec in specs]
    for spec, value in zip(specs, outputs, strict=True):
        value.type = ir.TensorType(b.value(spec).dtype)
        value.shape = ir.Shape(list(spec.shape))
    return outputs
