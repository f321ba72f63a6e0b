"""The MTP head as its own graph (``--mtp``): ``mtp.onnx`` beside the main graph, in the layout
onnxruntime-genai 0.18.0's Qwen3.5 builder writes (its ``model.mtp`` config section).

* The main graph also outputs ``hidden_states [N, hidden]``: the final-norm hidden of every row,
  before any logits pruning (``model.decoder.outputs.hidden_states``).
* ``mtp.onnx`` (``build_mtp_model``), over the same packed step inputs (``input_ids`` holds, for
  each row, the token after its position): ``Gather(embed_tokens, input_ids)`` ->
  ``pre_fc_norm_embedding``; ``hidden_states`` -> ``pre_fc_norm_hidden``; ``Concat`` -> ``fc``;
  one full-attention decoder layer (``mtp.layers.0``: PagedAttention on the head's own page
  buffers ``past_key_values.0.key / .value``, activation dtype, never quantized; the MLP, or
  a mixture-of-experts model's MoE block) ->
  ``mtp.norm`` = ``hidden_states_out`` (fed back for the next draft of a chain) -> the LM head
  -> ``logits [N, vocab]``. ``mtp.onnx.data`` holds the head's ``mtp.*`` weights and its own
  copy of the embedding (and of an untied LM head): the graphs share no initializer file.
* ``genai_mtp_section`` is ``model.mtp``: ``enabled``, ``filename``, ``num_hidden_layers = 1``,
  the head's ``num_key_value_heads`` / ``head_size``, ``main_hidden_states``, and the head
  graph's ``inputs`` (the keys 0.18.0 parses there: ``input_ids``, ``position_ids``,
  ``hidden_states``, the page templates; the paged step inputs keep the decoder's names) and
  ``outputs`` names; beside it ``speculative.max_draft_tokens`` (the capture capacity less the
  verified last token: a hybrid's drafts are verified by the linear layers' compact state
  updates, so ``--mtp`` needs ``--state-update-capacity`` >= 2).
* ``verify_mtp`` is ``pagedhybrid verify``'s part for both graphs' MTP bindings.

The math is the engine's ``MtpHead`` (``models/qwen35/model.py``), which tests compare with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir

from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import PackedAbi, TensorSpec
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.export.full import PagedInputs, emit_full_attention, rope_tables
from pagedhybrid.export.graph import emit_feed_forward, emit_lm_head, named_outputs
from pagedhybrid.export.nbits import CODES
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.weights import WeightSource
from pagedhybrid.models.qwen35.config import Qwen35Config

LAYER = "mtp.layers.0"


def build_mtp_model(config: Qwen35Config, options: ExportOptions, weights: WeightSource
                    ) -> ir.Model:
    """The MTP head graph (module docstring); ``weights`` must hold the ``mtp.*`` tensors."""
    abi = PackedAbi(config, options)
    b = GraphBuilder(weights, options.onnx_dtype, options.weight_quant)
    for spec in abi.mtp_inputs():
        b.add_input(spec)
    inp, eps, i = b.inputs, config.rms_norm_eps, c.MTP_LAYER
    paged = PagedInputs(inp[c.CU_SEQLENS], inp[c.PAST_SEQLENS], inp[c.BLOCK_TABLE],
                        inp[c.ATTENTION_METADATA])
    embed = b.weight("model.embed_tokens.weight")  # [V, hidden]
    e = b.op1("Gather", [embed, inp[c.INPUT_IDS]], "/mtp/embed_tokens/Gather")  # [N, hidden]
    e = b.offset_rms_norm(e, "mtp.pre_fc_norm_embedding.weight", eps,
                          "/mtp/pre_fc_norm_embedding")
    hn = b.offset_rms_norm(inp[c.HIDDEN_STATES], "mtp.pre_fc_norm_hidden.weight", eps,
                           "/mtp/pre_fc_norm_hidden")
    x = b.op1("Concat", [e, hn], "/mtp/fc/Concat", {"axis": -1})  # [N, 2 hidden]
    h = b.matmul(x, "mtp.fc.weight", "/mtp/fc")  # [N, hidden]
    rope = rope_tables(b, config, inp[c.POSITION_IDS])
    x = b.offset_rms_norm(h, f"{LAYER}.input_layernorm.weight", eps, f"/{LAYER}/input_layernorm")
    out = emit_full_attention(b, config, i, x, rope, paged, inp[c.PAST_KEY % i],
                              inp[c.PAST_VALUE % i], None, LAYER)
    x, h = b.skip_rms_norm(h, out, f"{LAYER}.post_attention_layernorm.weight", eps,
                           f"/{LAYER}/post_attention_layernorm")
    h = b.op1("Add", [h, emit_feed_forward(b, config, i, x, LAYER)],
              f"/{LAYER}/residual_mlp/Add")
    hs = b.offset_rms_norm(h, "mtp.norm.weight", eps, "/mtp/norm", output=c.HIDDEN_STATES_OUT)
    emit_lm_head(b, config, embed, hs)
    return b.model(named_outputs(b, abi.mtp_outputs()), abi.metadata_props())


def genai_mtp_section(num_key_value_heads: int, head_size: int) -> dict[str, Any]:
    """``model.mtp`` of genai_config.json (module docstring)."""
    return {
        "enabled": True,
        "filename": c.MTP_FILE,
        "num_hidden_layers": 1,
        "num_key_value_heads": num_key_value_heads,
        "head_size": head_size,
        "main_hidden_states": c.HIDDEN_STATES,
        # (0.18.0 knows only these keys here: the paged step inputs keep the decoder's names)
        "inputs": {"input_ids": c.INPUT_IDS, "position_ids": c.POSITION_IDS,
                   "hidden_states": c.HIDDEN_STATES, "past_key_names": c.PAST_KEY,
                   "past_value_names": c.PAST_VALUE},
        "outputs": {"logits": c.LOGITS, "hidden_states": c.HIDDEN_STATES_OUT,
                    "present_key_names": c.PRESENT_KEY, "present_value_names": c.PRESENT_VALUE},
    }


def _spec_of(v: ir.Value) -> TensorSpec:
    dims = tuple(d if isinstance(d, int) else str(d) for d in (v.shape or ()))
    dtype = v.dtype.name.lower() if v.dtype is not None else "?"
    return TensorSpec(v.name or "", {"float32": "float"}.get(dtype, dtype), dims)


def verify_mtp(out: Path, main: ir.Model, genai: dict[str, Any],
               chk: Callable[[bool, str, str], bool]) -> None:
    """Both graphs' MTP bindings, from the package alone: the main graph's ``hidden_states``
    output, ``mtp.onnx``'s inputs and outputs exactly as ``PackedAbi.mtp_inputs`` /
    ``mtp_outputs`` lay them out (dims from genai_config.json and the main graph), its one
    PagedAttention (SEPARATE) on its own pages, the ``mtp.*`` weights it reads, and ``model.mtp``
    / ``model.decoder.outputs.hidden_states`` of genai_config.json."""
    model = genai.get("model", {})
    dec = model.get("decoder", {})
    io = dict(main.metadata_props).get(c.META_DTYPE, "?")  # (the head's pages: unquantized)
    hidden = TensorSpec(c.HIDDEN_STATES, io, (c.DIM_TOKENS, dec.get("hidden_size")))
    outputs = {v.name: v for v in main.graph.outputs}
    got = outputs.get(c.HIDDEN_STATES)
    chk(got is not None and _spec_of(got) == hidden, "mtp main output",
        f"{c.HIDDEN_STATES}: {None if got is None else _spec_of(got)} (expected {hidden})")
    chk(dec.get("outputs", {}).get("hidden_states") == c.HIDDEN_STATES, "genai mtp",
        f"model.decoder.outputs.hidden_states -> {dec.get('outputs', {}).get('hidden_states')!r}")
    hkv, hd = dec.get("num_key_value_heads"), dec.get("head_size")
    section = model.get("mtp")
    chk(isinstance(hkv, int) and isinstance(hd, int) and section == genai_mtp_section(hkv, hd),
        "genai mtp", f"model.mtp = {section}")
    meta = dict(main.metadata_props)
    cap = int(meta.get(c.META_STATE_UPDATE, "0") or 0)
    drafts = genai.get("speculative", {}).get("max_draft_tokens")
    chk(drafts == cap - 1 and (cap >= 2 or not meta.get(c.META_LINEAR_LAYERS)), "genai mtp",
        f"speculative.max_draft_tokens = {drafts!r} (state-update capacity {cap}: the last "
        "token and capacity - 1 drafts; >= 2 on a hybrid)")
    bs = genai.get("engine", {}).get("dynamic_batching", {}).get("block_size")
    shared = {v.name: _spec_of(v) for v in main.graph.inputs if v.name in c.SHARED_INPUTS}

    def page(name: str) -> TensorSpec:
        return TensorSpec(name, io, (c.DIM_BLOCKS, bs, hkv, hd))

    layer = c.MTP_LAYER
    want_in = [*(shared.get(n) for n in c.SHARED_INPUTS), hidden, page(c.PAST_KEY % layer),
               page(c.PAST_VALUE % layer)]
    want_out = [TensorSpec(c.LOGITS, "float", (c.DIM_TOKENS, model.get("vocab_size"))),
                hidden._replace(name=c.HIDDEN_STATES_OUT), page(c.PRESENT_KEY % layer),
                page(c.PRESENT_VALUE % layer)]
    path = out / c.MTP_FILE
    if not chk(path.is_file(), "files",
               f"{c.MTP_FILE} {'present' if path.is_file() else 'missing'}"):
        return
    head = ir.load(path)
    g = head.graph
    for kind, values, specs in (("inputs", g.inputs, want_in), ("outputs", g.outputs, want_out)):
        have = [_spec_of(v) for v in values]
        chk(have == specs, f"mtp graph {kind}",
            "exact" if have == specs else f"{have} (expected {specs})")
    paged = [n for n in g if n.op_type == c.PAGED_ATTENTION]
    ok = len(paged) == 1 and paged[0].attributes.get("kv_cache_layout") is not None and \
        paged[0].attributes["kv_cache_layout"].as_string() == "SEPARATE"
    chk(ok, "mtp graph nodes", f"{len(paged)} PagedAttention (expected 1, SEPARATE)")
    if paged:
        ins = [v.name if v is not None else "" for v in paged[0].inputs]
        chk(ins[3:5] == [c.PAST_KEY % c.MTP_LAYER, c.PAST_VALUE % c.MTP_LAYER],
            "mtp graph nodes", f"PagedAttention pages {ins[3:5]}")
    names = {t.name for t in g.initializers.values()}
    quantized = dict(head.metadata_props).get(c.META_WEIGHT_FORMAT, "none") != "none"
    need = ["mtp.fc.weight" + (CODES if quantized else ".transpose"), "mtp.norm.weight.offset",
            "mtp.pre_fc_norm_hidden.weight.offset", "mtp.pre_fc_norm_embedding.weight.offset",
            f"{LAYER}.input_layernorm.weight.offset"]
    missing = [n for n in need if n not in names]
    chk(not missing, "mtp graph weights", f"missing {missing}" if missing else
        f"{len(names)} initializers, the head's mtp.* among them")
