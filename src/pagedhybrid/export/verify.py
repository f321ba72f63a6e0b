"""Verify an exported packed paged hybrid package against its ABI, independently of the exporter.

``verify_package(out_dir)`` reads ``model.onnx`` (graph only; weights are not loaded),
``genai_config.json`` and the workflow metadata, and checks:

1. metadata: the ABI tag, block size, layer partition and runtime pins in ``metadata_props``;
   the partition is complete (``0..num_hidden_layers-1``) and disjoint;
2. graph inputs: exactly the shared packed inputs (names, dtypes, ranks, static dims), a
   ``past_key_values.{i}.key/.value`` page buffer ``[P, block_size, Hkv, hd]`` for each full layer
   and only those, ``conv_state [B, C, K-1]`` / float ``recurrent_state [B, Hv, Dv, Dk]`` for each
   linear layer; nothing else (no ``attention_mask``, no ``slot_mapping``);
3. graph outputs: float ``logits [N|B, vocab]`` and one ``present.*`` per state input with the same
   dtype and shape;
4. operators: one ``com.microsoft.PagedAttention`` per full layer with 17 inputs (8-13 empty,
   14/15 empty or -- quantized pages -- the layer's float ``k_scale``/``v_scale`` initializers
   of shape ``[1]`` (PER_TENSOR) / ``[Hkv, 1, hd]`` (PER_CHANNEL) with matching
   ``k_quant_type``/``v_quant_type``, 16 = ``attention_metadata``), operands 3/4 = the layer's
   page buffers and outputs 1/2 = its ``present`` names (the aliasing pairs), SEPARATE layout,
   RoPE outside, head counts; one
   ``VarlenCausalConvWithState`` and one ``GatedDeltaNet`` per linear layer on that layer's states,
   ``cumulative_sequence_lengths`` as boundaries, the Qwen gate attributes, q and k normalised
   before the op as HF does (``x * 1/sqrt(sum(x^2) + 1e-6)`` in float32, ``qk_l2_norm=0``: the
   op's own norm uses eps 1e-12), float ``A_log`` /
   ``dt_bias [Hv]``; conv weight ``[C, 1, K]`` and q/k/v head shapes consistent with the state
   shapes (which catches a K-major recurrent state or a channels-last conv state);
5. ``genai_config.json``: decoder input/output templates resolve to the graph's names, the three
   state groups carry exactly the partition, ``engine.dynamic_batching`` matches the graph's
   block size with one page budget, provider options name the export's EP,
   ``search.past_present_share_buffer`` is true, head/layer/vocab counts match the graph;
6. the workflow metadata lists the same three disciplines and layer ids;
7. a mixture-of-experts package: one MoE node per layer, its attributes and weights (moe.py);
8. a ``--weights`` package, in each graph: every MatMulNBits node's attributes and initializers
   against each other and the package's weight format, no projection left float (nbits.py);
   with ``checkpoint`` (``pagedhybrid verify --checkpoint MODEL_DIR``, the folder exported
   from) also K and N against the config's projection shapes and the codes, scales and zero
   points against ``weightquant.quantize`` of the checkpoint tensors, byte for byte.
Each check yields a ``Finding``; ``VerifyReport.ok`` is false if any failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import onnx_ir as ir

from pagedhybrid.errors import PagedHybridError
from pagedhybrid.export import constants as c
from pagedhybrid.export import ir_read as rd
from pagedhybrid.export.moe import verify_moe
from pagedhybrid.export.mtp import verify_mtp
from pagedhybrid.export.nbits import verify_nbits
from pagedhybrid.export.weights import CheckpointWeights
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.linear_attention import QK_L2_NORM_EPS

SHARED: dict[str, tuple[str, tuple[int | None, ...]]] = {  # name -> dtype, dims (None = dynamic)
    c.INPUT_IDS: ("int64", (None,)),
    c.POSITION_IDS: ("int64", (3, None)),
    c.BLOCK_TABLE: ("int32", (None, None)),
    c.CU_SEQLENS: ("int32", (None,)),
    c.PAST_SEQLENS: ("int32", (None,)),
    c.ATTENTION_METADATA: ("int32", (3,)),
}
QUANT_CACHE_DTYPES = ("int8", "float8e4m3fn")
QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
GDN_ATTRS = {"update_rule": "gated_delta", "beta_activation": "sigmoid", "qk_l2_norm": 0}
# HF l2norm, outermost node first


class Finding(NamedTuple):
    ok: bool
    check: str
    detail: str


class VerifyReport(NamedTuple):
    package: Path
    findings: list[Finding]

    @property
    def ok(self) -> bool:
        return bool(self.findings) and all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def format(self) -> str:
        lines = [f"pagedhybrid verify {self.package}"]
        lines += [f"  {'ok  ' if f.ok else 'FAIL'} {f.check}: {f.detail}" for f in self.findings]
        n = len(self.failures)
        lines.append(f"{len(self.findings) - n} checks passed, {n} failed")
        return "\n".join(lines)


class _Checker:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def __call__(self, cond: bool, check: str, detail: str) -> bool:
        self.findings.append(Finding(bool(cond), check, detail))
        return bool(cond)


def _layers(meta: dict[str, str], key: str) -> list[int] | None:
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        return [int(x) for x in raw.split(",") if x != ""]
    except ValueError:
        return None


def verify_package(out_dir: str | Path, checkpoint: str | Path | None = None) -> VerifyReport:
    out = Path(out_dir)
    chk = _Checker()
    paths = {name: out / name for name in (c.MODEL_FILE, c.GENAI_CONFIG_FILE, c.WORKFLOW_FILE)}
    for name, path in paths.items():
        chk(path.is_file(), "files", f"{name} {'present' if path.is_file() else 'missing'}")
    if not paths[c.MODEL_FILE].is_file() or not paths[c.GENAI_CONFIG_FILE].is_file():
        return VerifyReport(out, chk.findings)
    model = ir.load(paths[c.MODEL_FILE])
    try:
        genai = json.loads(paths[c.GENAI_CONFIG_FILE].read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        chk(False, "genai_config", f"not valid JSON: {exc}")
        return VerifyReport(out, chk.findings)
    wf = paths[c.WORKFLOW_FILE]
    workflow = json.loads(wf.read_text(encoding="utf-8")) if wf.is_file() else None
    _verify(model, genai, workflow, chk)
    verify_moe(model, genai, chk)
    mtp = dict(model.metadata_props).get(c.META_MTP) == "1" or "mtp" in genai.get("model", {})
    if mtp:
        verify_mtp(out, model, genai, chk)
    _verify_weights(out, model, mtp, checkpoint, chk)
    return VerifyReport(out, chk.findings)


def _verify_weights(out: Path, model: ir.Model, mtp: bool, checkpoint: str | Path | None,
                    chk: _Checker) -> None:
    """Check 8 on the main graph and the MTP head's (the checkpoint's tensors, if given)."""
    weights = None
    if checkpoint is not None:
        try:
            config = Qwen35Config.from_model_dir(checkpoint)
            weights = CheckpointWeights(checkpoint, config, "float16", mtp)
        except PagedHybridError as exc:
            chk(False, "checkpoint", f"{checkpoint}: {exc}")
    shapes = weights.shapes if weights is not None else None
    read = weights.read if weights is not None else None
    verify_nbits(model, chk, shapes, read)
    if mtp and (out / c.MTP_FILE).is_file():
        verify_nbits(ir.load(out / c.MTP_FILE), chk, shapes, read, c.MTP_FILE)


def _verify(model: ir.Model, genai: dict[str, Any], workflow: dict[str, Any] | None,
            chk: _Checker) -> None:
    graph = model.graph
    meta = dict(model.metadata_props)
    dec = genai.get("model", {}).get("decoder", {})
    # -- 1. metadata and partition ----------------------------------------------------------------
    checked = _verify_metadata(meta, dec, chk)
    if checked is None:
        return
    full, linear, block_size, io_dtype, kv_dtype, quant = checked
    # -- 2./3. graph inputs and outputs -----------------------------------------------------------
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    cap = _capacity(meta)
    updates_in, updates_out = _state_update_names(cap, linear)
    _verify_inputs(inputs, dec, full, linear, updates_in, block_size, io_dtype, kv_dtype, chk)
    logits = _verify_outputs(inputs, outputs, genai, meta, full, linear, updates_out, chk)
    for bad in ("attention_mask", "slot_mapping"):
        chk(bad not in inputs, "no dense inputs", f"{bad} absent")
    # -- 4. operators -----------------------------------------------------------------------------
    _verify_nodes(graph, dec, full, linear, inputs, quant, chk)
    _verify_state_updates(graph, dec, cap, linear, inputs, outputs, chk)
    # -- 5. genai_config --------------------------------------------------------------------------
    _verify_genai(genai, meta, full, linear, block_size, inputs, outputs, logits, chk)
    # -- 6. workflow ------------------------------------------------------------------------------
    if workflow is not None:
        _verify_workflow(workflow, full, linear, io_dtype, kv_dtype, quant, chk)


def _verify_metadata(meta: dict[str, str], dec: dict[str, Any], chk: _Checker
                     ) -> tuple[list[int], list[int], int, str, str, str] | None:
    """Check 1: ABI tag, runtime pins, layer partition, block size and dtypes; returns
    ``(full, linear, block_size, io_dtype, kv_dtype, quant)``, or None without a partition."""
    n_layers = int(dec.get("num_hidden_layers", -1))
    chk(meta.get(c.META_ABI) == c.ABI_NAME, "metadata abi", f"{meta.get(c.META_ABI)!r}")
    for key, pin in ((c.META_ORT, c.ONNXRUNTIME_PIN), (c.META_GENAI, c.ONNXRUNTIME_GENAI_PIN)):
        chk(meta.get(key) == pin, "metadata pins", f"{key}={meta.get(key)!r} (expected {pin})")
    full, linear = _layers(meta, c.META_FULL_LAYERS), _layers(meta, c.META_LINEAR_LAYERS)
    if not chk(full is not None and linear is not None, "metadata partition",
               f"full={meta.get(c.META_FULL_LAYERS)!r} linear={meta.get(c.META_LINEAR_LAYERS)!r}"):
        return None
    assert full is not None and linear is not None
    overlap = sorted(set(full) & set(linear))
    chk(not overlap, "partition disjoint", f"overlap {overlap}")
    chk(sorted(full + linear) == list(range(n_layers)), "partition complete",
        f"full {full} + linear {linear} vs num_hidden_layers={n_layers}")
    chk(len(full) >= 1, "partition", f"{len(full)} full-attention layers (need >= 1)")
    try:
        block_size = int(meta.get(c.META_BLOCK_SIZE, "0"))
    except ValueError:
        block_size = 0
    chk(block_size >= 16 and block_size & (block_size - 1) == 0, "metadata block size",
        f"{block_size} (power of two >= 16)")
    io_dtype = meta.get(c.META_DTYPE, "?")
    chk(io_dtype in ("float16", "bfloat16"), "metadata dtype", io_dtype)
    kv_dtype, quant = meta.get(c.META_KV_DTYPE, io_dtype), meta.get(c.META_KV_QUANT, "NONE")
    quantized = kv_dtype in QUANT_CACHE_DTYPES
    chk(kv_dtype in (io_dtype, *QUANT_CACHE_DTYPES) and quant in QUANT_TYPES
        and (quant != "NONE") == quantized, "metadata kv cache",
        f"kv_cache_dtype={kv_dtype}, kv_quant_type={quant} (activation {io_dtype})")
    return full, linear, block_size, io_dtype, kv_dtype, quant


def _verify_inputs(inputs: dict[str, ir.Value], dec: dict[str, Any], full: list[int],
                   linear: list[int], updates_in: set[str], block_size: int, io_dtype: str,
                   kv_dtype: str, chk: _Checker) -> None:
    """Check 2: the shared packed inputs, nothing extra, and each layer's state inputs."""
    for name, (dt, dims) in SHARED.items():
        v = inputs.get(name)
        if not chk(v is not None, "input", f"{name} present"):
            continue
        got = rd.dims(v)
        ok = rd.dtype(v) == dt and len(got) == len(dims) and all(
            e is None or e == g for e, g in zip(dims, got, strict=False))
        chk(ok, "input", f"{name} {rd.dtype(v)} {list(got)} (expected {dt} rank {len(dims)})")
    hkv, hd = dec.get("num_key_value_heads"), dec.get("head_size")
    expected_states: dict[str, tuple[int, str]] = {}
    for i in full:
        expected_states[c.PAST_KEY % i] = (i, "key")
        expected_states[c.PAST_VALUE % i] = (i, "value")
    for i in linear:
        expected_states[c.PAST_CONV % i] = (i, "conv_state")
        expected_states[c.PAST_RECURRENT % i] = (i, "recurrent_state")
    extra = sorted(set(inputs) - set(SHARED) - set(expected_states) - updates_in)
    chk(not extra, "inputs exact", f"unexpected inputs {extra}" if extra else "no extra inputs")
    for name, (_layer, kind) in expected_states.items():
        v = inputs.get(name)
        if not chk(v is not None, "state input", f"{name} present"):
            continue
        d = rd.dims(v)
        if kind in ("key", "value"):
            ok = (rd.dtype(v) == kv_dtype and len(d) == 4 and not isinstance(d[0], int)
                  and d[1] == block_size and d[2] == hkv and d[3] == hd)
            exp = f"{kv_dtype} [P, {block_size}, {hkv}, {hd}]"
        elif kind == "conv_state":
            ok = (rd.dtype(v) == io_dtype and len(d) == 3 and not isinstance(d[0], int)
                  and all(isinstance(x, int) for x in d[1:]))
            exp = f"{io_dtype} [B, conv_dim, K-1]"
        else:
            ok = (rd.dtype(v) == "float" and len(d) == 4 and not isinstance(d[0], int)
                  and all(isinstance(x, int) for x in d[1:]))
            exp = "float [B, Hv, Dv, Dk]"
        chk(ok, "state input", f"{name} {rd.dtype(v)} {list(d)} (expected {exp})")


def _verify_outputs(inputs: dict[str, ir.Value], outputs: dict[str, ir.Value],
                    genai: dict[str, Any], meta: dict[str, str], full: list[int],
                    linear: list[int], updates_out: set[str], chk: _Checker) -> ir.Value | None:
    """Check 3: float logits, nothing extra, one ``present.*`` per state input; returns the
    logits output (None when missing)."""
    logits = outputs.get(c.LOGITS)
    if chk(logits is not None, "output", f"{c.LOGITS} present"):
        assert logits is not None
        d = rd.dims(logits)
        chk(rd.dtype(logits) == "float" and len(d) == 2 and d[1] == genai.get("model", {}).get(
            "vocab_size"), "output", f"logits {rd.dtype(logits)} {list(d)} (float [rows, vocab])")
    present_of = {c.PAST_KEY % i: c.PRESENT_KEY % i for i in full}
    present_of |= {c.PAST_VALUE % i: c.PRESENT_VALUE % i for i in full}
    present_of |= {c.PAST_CONV % i: c.PRESENT_CONV % i for i in linear}
    present_of |= {c.PAST_RECURRENT % i: c.PRESENT_RECURRENT % i for i in linear}
    hidden = {c.HIDDEN_STATES} if meta.get(c.META_MTP) == "1" else set()  # (verify_mtp's)
    extra_out = sorted(set(outputs) - {c.LOGITS} - set(present_of.values()) - updates_out
                       - hidden)
    chk(not extra_out, "outputs exact",
        f"unexpected outputs {extra_out}" if extra_out else "no extra outputs")
    for past, present in present_of.items():
        pv, ov = inputs.get(past), outputs.get(present)
        if chk(ov is not None, "present output", f"{present} present") and pv is not None:
            assert ov is not None
            chk(rd.dtype(ov) == rd.dtype(pv) and rd.dims(ov) == rd.dims(pv), "present output",
                f"{present} {rd.dtype(ov)} {list(rd.dims(ov))} matches {past}")
    return logits


def _verify_workflow(workflow: dict[str, Any], full: list[int], linear: list[int],
                     io_dtype: str, kv_dtype: str, quant: str, chk: _Checker) -> None:
    """Check 6: the workflow metadata's state disciplines, layer ids and KV cache format."""
    found = {s.get("discipline"): s.get("layer_ids") for s in workflow.get("states", [])}
    want = {c.GROUP_PAGED_KV: full} | ({c.GROUP_FIXED_CONV: linear,
                                       c.GROUP_FIXED_RECURRENT: linear} if linear else {})
    chk(found == want, "workflow states", f"{found}")
    paged = next((s for s in workflow.get("states", [])
                  if s.get("discipline") == c.GROUP_PAGED_KV), {})
    chk(paged.get("element_type", io_dtype) == kv_dtype and
        paged.get("quantization", {}).get("type", "NONE") == quant, "workflow kv cache",
        f"element_type {paged.get('element_type')!r}, quantization "
        f"{paged.get('quantization')!r} vs {kv_dtype} {quant}")


def _capacity(meta: dict[str, str]) -> int:
    try:
        return int(meta.get(c.META_STATE_UPDATE, "0"))
    except ValueError:
        return -1


def _state_update_names(cap: int, linear: list[int]) -> tuple[set[str], set[str]]:
    """The graph inputs and outputs of compact state updates at capacity ``cap``."""
    if cap <= 0 or not linear:
        return set(), set()
    return ({c.STATE_UPDATE_CAPTURE_COUNT, c.STATE_UPDATE_ACTIVE},
            {t % i for i in linear for t in (c.STATE_UPDATE_CONV, c.STATE_UPDATE_RECURRENT)})


def _verify_state_updates(graph: ir.Graph, dec: dict[str, Any], cap: int, linear: list[int],
                          inputs: dict[str, ir.Value], outputs: dict[str, ir.Value],
                          chk: _Checker) -> None:
    """``--state-update-capacity``: the capture inputs, each linear layer's conv / GatedDeltaNet
    capacity, operands and ``state_update`` outputs (shapes from the layer's states), and the
    genai_config bindings onnxruntime-genai 0.18.0 reads."""
    chk(0 <= cap <= c.MAX_STATE_UPDATE_CAPACITY, "state_update capacity",
        f"{cap} (metadata {c.META_STATE_UPDATE}, 0..{c.MAX_STATE_UPDATE_CAPACITY})")
    on = cap > 0 and bool(linear)
    for name, dims in ((c.STATE_UPDATE_CAPTURE_COUNT, 1), (c.STATE_UPDATE_ACTIVE, 1)):
        v = inputs.get(name)
        chk((v is not None and rd.dtype(v) == "int32" and len(rd.dims(v)) == dims) == on,
            "state_update inputs", f"{name}: {'int32 rank 1' if on else 'absent'} expected")
    gin, gout = dec.get("inputs", {}), dec.get("outputs", {})
    bindings = {"state_update_capture_count": (gin, c.STATE_UPDATE_CAPTURE_COUNT),
                "state_update_active": (gin, c.STATE_UPDATE_ACTIVE),
                "state_update_conv_value_names": (gout, c.STATE_UPDATE_CONV),
                "state_update_recurrent_capsule_names": (gout, c.STATE_UPDATE_RECURRENT)}
    for key, (table, want) in bindings.items():
        chk(table.get(key) == (want if on else None), "genai state_update",
            f"{key} = {table.get(key)!r}")
    chk(dec.get("state_update_capacity", 0) == (cap if on else 0), "genai state_update",
        f"decoder.state_update_capacity = {dec.get('state_update_capacity')!r} (graph {cap})")
    for i in linear:
        for op, state, k_state, k_count, out_name in (
                (c.VARLEN_CONV, c.PAST_CONV % i, 4, 5, c.STATE_UPDATE_CONV % i),
                (c.GATED_DELTA_NET, c.PAST_RECURRENT % i, 6, 9, c.STATE_UPDATE_RECURRENT % i)):
            nodes = [n for n in rd.by_op(graph, op) if rd.name(rd.operand(n, k_state)) == state]
            if len(nodes) != 1:
                continue  # (counted by _verify_linear)
            n = nodes[0]
            outs = [rd.name(v) for v in n.outputs]
            got = (rd.attr(n, "state_update_capacity", 0), rd.name(rd.operand(n, k_count)),
                   outs[2] if len(outs) > 2 else "")
            want = ((cap, c.STATE_UPDATE_CAPTURE_COUNT, out_name) if on else (0, "", ""))
            active = rd.name(rd.operand(n, 10))
            ok = got == want and (op == c.VARLEN_CONV
                                  or active == (c.STATE_UPDATE_ACTIVE if on else ""))
            chk(ok, "state_update operands", f"layer {i} {op}: capacity, capture_count, output "
                f"{got} (expected {want})")
            v, s = outputs.get(out_name), inputs.get(state)
            if not on or v is None or s is None:
                continue
            d, sd = rd.dims(v), rd.dims(s)
            if op == c.VARLEN_CONV:
                ok = rd.dtype(v) == rd.dtype(s) and d[1:] == (cap, sd[1])
                exp = f"{rd.dtype(s)} [B, {cap}, {sd[1]}]"
            else:  # C (Hv + Hk Dk + Hv Dv), Hk from the graph's q|k heads (2 Hk of them)
                qk = rd.reshape_dims(rd.l2_normalized(rd.skip(rd.operand(n, 0), "Split"))[0])
                hk = qk[1] // 2 if qk and len(qk) == 3 else None
                width = cap * (sd[1] + (hk or 0) * sd[3] + sd[1] * sd[2]) if hk else None
                ok = rd.dtype(v) == "float" and len(d) == 2 and d[1] == width
                exp = f"float [B, {width}]"
                group = next((g for g in dec.get("state_groups", []) if isinstance(g, dict)
                              and g.get("kind") == c.GROUP_FIXED_RECURRENT), {})
                heads = group.get("state_update", {}).get("key_head_count")
                chk(heads == hk, "genai state_update", f"fixed_recurrent key_head_count "
                    f"{heads!r} (graph's key heads {hk})")
            chk(ok, "state_update outputs", f"{out_name} {rd.dtype(v)} {list(d)} (expected {exp})")


def _without_key_heads(groups: Any) -> Any:
    """``state_groups`` without the recurrent group's ``key_head_count`` (checked against the
    graph by ``_verify_state_updates``)."""
    if not isinstance(groups, list):
        return groups
    return [{**g, "state_update": {k: v for k, v in g["state_update"].items()
                                   if k != "key_head_count"}}
            if isinstance(g, dict) and isinstance(g.get("state_update"), dict) else g
            for g in groups]


def _verify_scales(graph: ir.Graph, n: ir.Node, i: int, quant: str, hkv: Any, hd: Any,
                   chk: _Checker) -> None:
    """Operands 14/15 and the quant attributes of layer ``i``'s PagedAttention."""
    names = [rd.name(rd.operand(n, k)) for k in c.PAGED_ATTENTION_SCALES]
    attrs = [rd.attr(n, "k_quant_type", "NONE"), rd.attr(n, "v_quant_type", "NONE")]
    if quant == "NONE":
        chk(names == ["", ""] and attrs == ["NONE", "NONE"], "PagedAttention kv scales",
            f"layer {i}: unquantized pages: k_scale/v_scale {names}, quant types {attrs}")
        return
    shape = [1] if quant == "PER_TENSOR" else [hkv, 1, hd]
    for name, want in zip(names, (c.K_SCALE % i, c.V_SCALE % i), strict=True):
        init = graph.initializers.get(name)
        ok = name == want and init is not None and rd.dtype(init) == "float" and \
            list(rd.dims(init)) == shape
        chk(ok, "PagedAttention kv scales", f"layer {i}: {name or '(empty)'} "
            f"{rd.dtype(init) if init is not None else 'not an initializer'} "
            f"{list(rd.dims(init)) if init is not None else ''} (expected {want} float {shape})")
    chk(attrs == [quant, quant], "PagedAttention kv scales",
        f"layer {i}: k_quant_type/v_quant_type {attrs} (expected {quant})")


def _verify_nodes(graph: ir.Graph, dec: dict[str, Any], full: list[int], linear: list[int],
                  inputs: dict[str, ir.Value], quant: str, chk: _Checker) -> None:
    producers = rd.producers(graph)
    shared = [c.CU_SEQLENS, c.PAST_SEQLENS, c.BLOCK_TABLE]
    pa_nodes = rd.by_op(graph, c.PAGED_ATTENTION)
    chk(len(pa_nodes) == len(full), "PagedAttention count",
        f"{len(pa_nodes)} nodes for {len(full)} full-attention layers")
    for i in full:
        found = rd.matching(pa_nodes, lambda n, i=i: rd.name(rd.operand(n, 3)) == c.PAST_KEY % i)
        if not chk(len(found) == 1, "PagedAttention", f"layer {i}: {len(found)} node(s) read "
                   f"{c.PAST_KEY % i}"):
            continue
        n = found[0]
        names = [rd.name(v) for v in n.inputs]
        chk(n.domain == c.MS_DOMAIN and len(names) == c.PAGED_ATTENTION_INPUTS,
            "PagedAttention operands", f"layer {i}: {n.domain}, {len(names)} inputs")
        if len(names) != c.PAGED_ATTENTION_INPUTS:
            continue
        ok = (names[4] == c.PAST_VALUE % i and names[5:8] == shared
              and all(names[k] == "" for k in c.PAGED_ATTENTION_EMPTY)
              and names[c.PAGED_ATTENTION_METADATA_INDEX] == c.ATTENTION_METADATA
              and all(names[k] for k in range(3)))
        chk(ok, "PagedAttention operands", f"layer {i}: {names}")
        _verify_scales(graph, n, i, quant, dec.get("num_key_value_heads"),
                       dec.get("head_size"), chk)
        outs = [rd.name(v) for v in n.outputs]
        chk(outs[1:3] == [c.PRESENT_KEY % i, c.PRESENT_VALUE % i], "cache aliasing",
            f"layer {i}: key_cache_out/value_cache_out = {outs[1:3]}")
        attrs = {k: rd.attr(n, k) for k in ("num_heads", "kv_num_heads")}
        layout = rd.attr(n, "kv_cache_layout", "SEPARATE")
        rotary = rd.attr(n, "do_rotary", 0)
        chk(attrs["num_heads"] == dec.get("num_attention_heads")
            and attrs["kv_num_heads"] == dec.get("num_key_value_heads")
            and layout == "SEPARATE" and rotary == 0, "PagedAttention attributes",
            f"layer {i}: {attrs}, kv_cache_layout={layout}, do_rotary={rotary}")
    conv_nodes, gdn_nodes = rd.by_op(graph, c.VARLEN_CONV), rd.by_op(graph, c.GATED_DELTA_NET)
    chk(len(conv_nodes) == len(linear) and len(gdn_nodes) == len(linear), "linear op counts",
        f"{len(conv_nodes)} {c.VARLEN_CONV}, {len(gdn_nodes)} {c.GATED_DELTA_NET} for "
        f"{len(linear)} linear layers")
    for i in linear:
        _verify_linear(i, conv_nodes, gdn_nodes, inputs, producers, chk)
    stray = [n.name for n in graph if any(rd.name(v) in ("attention_mask", "slot_mapping")
                                          for v in n.inputs)]
    chk(not stray, "no dense inputs", f"nodes reading attention_mask/slot_mapping: {stray}")


def _verify_linear(i: int, conv_nodes: list[ir.Node], gdn_nodes: list[ir.Node],
                   inputs: dict[str, ir.Value], producers: dict[str, ir.Node],
                   chk: _Checker) -> None:
    conv = rd.matching(conv_nodes, lambda n: rd.name(rd.operand(n, 4)) == c.PAST_CONV % i)
    if chk(len(conv) == 1, c.VARLEN_CONV, f"layer {i}: {len(conv)} node(s) read "
           f"{c.PAST_CONV % i}"):
        n = conv[0]
        outs = [rd.name(v) for v in n.outputs]
        chk(len(outs) >= 2 and outs[1] == c.PRESENT_CONV % i and n.domain == c.MS_DOMAIN,
            "cache aliasing", f"layer {i}: conv final_state = {outs[1:2]}")
        chk(rd.name(rd.operand(n, 2)) == c.CU_SEQLENS and rd.attr(n, "activation") == "silu",
            f"{c.VARLEN_CONV} operands", f"layer {i}: boundaries {rd.name(rd.operand(n, 2))!r}, "
            f"activation {rd.attr(n, 'activation')!r}")
        w = rd.operand(n, 1)
        wd = rd.dims(w) if w is not None else ()
        sd = rd.dims(inputs[c.PAST_CONV % i]) if c.PAST_CONV % i in inputs else ()
        chk(len(wd) == 3 and len(sd) == 3 and wd[1] == 1 and sd[1] == wd[0]
            and isinstance(wd[2], int) and sd[2] == wd[2] - 1, "conv state layout",
            f"layer {i}: weight {list(wd)} vs state {list(sd)} (expected [B, C, K-1])")
    gdn = rd.matching(gdn_nodes, lambda n: rd.name(rd.operand(n, 6)) == c.PAST_RECURRENT % i)
    if not chk(len(gdn) == 1, c.GATED_DELTA_NET, f"layer {i}: {len(gdn)} node(s) read "
               f"{c.PAST_RECURRENT % i}"):
        return
    n = gdn[0]
    outs = [rd.name(v) for v in n.outputs]
    chk(len(outs) >= 2 and outs[1] == c.PRESENT_RECURRENT % i and n.domain == c.MS_DOMAIN,
        "cache aliasing", f"layer {i}: recurrent final_state = {outs[1:2]}")
    attrs = {k: rd.attr(n, k) for k in ("update_rule", "gate_activation", "beta_activation",
                                         "qk_l2_norm")}
    chk(all(attrs[k] == v for k, v in GDN_ATTRS.items())
        and attrs["gate_activation"] in ("qwen", "softplus"), f"{c.GATED_DELTA_NET} attributes",
        f"layer {i}: {attrs}")
    chk(rd.name(rd.operand(n, 3)) == c.CU_SEQLENS
        and all(rd.operand(n, k) is not None for k in (4, 5)), f"{c.GATED_DELTA_NET} operands",
        f"layer {i}: cu_seqlens {rd.name(rd.operand(n, 3))!r}, raw a/b present")
    state = rd.dims(inputs[c.PAST_RECURRENT % i]) if c.PAST_RECURRENT % i in inputs else ()
    for k, label in ((7, "a_log"), (8, "dt_bias")):
        v = rd.operand(n, k)
        ok = (v is not None and v.const_value is not None and rd.dtype(v) == "float"
              and len(state) == 4 and rd.dims(v) == (state[1],))
        chk(ok, f"{c.GATED_DELTA_NET} gates", f"layer {i}: {label} "
            f"{rd.dtype(v) if v is not None else 'absent'} {list(rd.dims(v)) if v else []} "
            f"(float initializer [Hv])")
    normed = {role: rd.l2_normalized(rd.skip(rd.operand(n, k), "Split"))
              for k, role in ((0, "q"), (1, "k"))}
    chk(all(x is not None and eps is not None and abs(eps - QK_L2_NORM_EPS) <= 1e-12
            for x, eps in normed.values()), "q/k l2 norm",
        f"layer {i}: eps {[eps for _, eps in normed.values()]} (HF: x * 1/sqrt(sum(x^2) + "
        f"{QK_L2_NORM_EPS:g}) in float32 before {c.GATED_DELTA_NET}, qk_l2_norm=0)")
    q, val = rd.reshape_dims(normed["q"][0]), rd.reshape_dims(rd.skip_cast(rd.operand(n, 2)))
    ok = (q is not None and val is not None and len(q) == 3 and len(val) == 3 and len(state) == 4
          and list(state[1:]) == [val[1], val[2], q[2]])
    chk(ok, "recurrent state layout", f"layer {i}: state {list(state)}, q heads {q}, v heads {val} "
        "(expected V-major [B, Hv, Dv, Dk])")


def _verify_genai(genai: dict[str, Any], meta: dict[str, str], full: list[int],
                  linear: list[int], block_size: int, inputs: dict[str, ir.Value],
                  outputs: dict[str, ir.Value], logits: ir.Value | None, chk: _Checker) -> None:
    model = genai.get("model", {})
    dec = model.get("decoder", {})
    gin, gout = dec.get("inputs", {}), dec.get("outputs", {})
    for name in c.SHARED_INPUTS:
        chk(gin.get(name) == name and name in inputs, "genai inputs",
            f"{name} -> {gin.get(name)!r}")
    templates = [("past_key_names", c.PAST_KEY, full, gin, inputs),
                 ("past_value_names", c.PAST_VALUE, full, gin, inputs),
                 ("present_key_names", c.PRESENT_KEY, full, gout, outputs),
                 ("present_value_names", c.PRESENT_VALUE, full, gout, outputs)]
    if linear:
        templates += [("past_conv_names", c.PAST_CONV, linear, gin, inputs),
                      ("past_recurrent_names", c.PAST_RECURRENT, linear, gin, inputs),
                      ("present_conv_names", c.PRESENT_CONV, linear, gout, outputs),
                      ("present_recurrent_names", c.PRESENT_RECURRENT, linear, gout, outputs)]
    for key, want, layers, table, values in templates:
        t = table.get(key)
        ok = isinstance(t, str) and t == want and all((t % i) in values for i in layers)
        chk(ok, "genai state names", f"{key} = {t!r} (graph has {want})")
    chk(gout.get("logits") == c.LOGITS, "genai outputs", f"logits -> {gout.get('logits')!r}")
    groups = dec.get("state_groups")
    want_groups = [{"kind": c.GROUP_PAGED_KV, "layer_ids": full}]
    if linear:
        cap = _capacity(meta)
        update = {"state_update": {"capacity": cap}} if cap > 0 else {}
        want_groups += [{"kind": c.GROUP_FIXED_CONV, "layer_ids": linear, **update},
                        {"kind": c.GROUP_FIXED_RECURRENT, "layer_ids": linear, **update}]
    chk(_without_key_heads(groups) == want_groups, "genai state_groups", f"{groups}")
    dyn = genai.get("engine", {}).get("dynamic_batching", {})
    budget = [k for k in ("num_blocks", "gpu_utilization_factor") if k in dyn]
    chk(dyn.get("block_size") == block_size and isinstance(dyn.get("max_batch_size"), int)
        and len(budget) == 1, "genai dynamic_batching",
        f"{dyn} (block_size {block_size}, max_batch_size, one page budget)")
    ep = meta.get(c.META_EP)
    prov = dec.get("session_options", {}).get("provider_options", [])
    chk(isinstance(prov, list) and len(prov) == 1 and list(prov[0]) == [ep],
        "genai provider", f"{prov} (export EP {ep!r})")
    if ep != "cuda":
        chk("num_blocks" in dyn, "genai dynamic_batching",
            f"{ep}: num_blocks pinned ({dyn.get('num_blocks')})")
    chk(genai.get("search", {}).get("past_present_share_buffer") is True, "genai search",
        f"past_present_share_buffer = {genai.get('search', {}).get('past_present_share_buffer')}")
    if logits is not None:
        rows = rd.dims(logits)[0] if rd.dims(logits) else None
        pruned = meta.get(c.META_PRUNE_LOGITS) == "1"
        chk(rows == (c.DIM_BATCH if pruned else c.DIM_TOKENS), "logits rows",
            f"{rows} (prune_logits={pruned})")
    chk(dec.get("filename") == c.MODEL_FILE, "genai decoder", f"filename {dec.get('filename')!r}")
