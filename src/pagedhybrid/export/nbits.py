"""Projections in 8 / 4 bits (``--weights``): one ``com.microsoft.MatMulNBits`` per projection,
its initializers exactly ``pagedhybrid.weightquant``'s codes and scales, and its verification.

What is quantised is what the engine's ``Qwen35ForCausalLM.quantize`` quantises: every
projection the graph multiplies by (``GraphBuilder.matmul`` / ``fused_matmul``: q|k|v, o, the
linear layers' qkv|z|b|a and out, gate|up and down, a shared expert's, the MTP head's ``fc``)
and the LM head (a tied head gets its own codes of the embedding table; ``--no-quantize-lm-head``
keeps it float) -- not the embedding table (a plain ``Gather``), the norms, the convolution, a
mixture of experts' router gates (``mlp.gate``, ``mlp.shared_expert_gate``: one float MatMul)
or its routed experts (``com.microsoft.MoE`` has no block-quantised weights).

Node (``GraphBuilder.matmul`` emits it): ``MatMulNBits(A [N_tok, K], B, scales[, zero_points];
K, N, bits, block_size, accuracy_level)`` -> ``[N_tok, N]`` in the activation type, named
``<projection>/MatMulNBits``, with the node metadata ``pagedhybrid.projections`` = the checkpoint
tensors whose rows ``B`` holds, in order (several for a fused projection: quantisation is per
row, so the fused codes are the parts' codes concatenated). Initializers ``<base>.codes``,
``<base>.scales``, ``<base>.zero_points``:

* ``B`` uint8 ``[N, n_blocks, block * bits / 8]`` = ``QuantizedWeight.codes`` byte for byte
  (K zero-padded to ``n_blocks * block``: a block size that does not divide K is fine, the
  padding codes sit at the zero point and the kernels stop at K);
* ``scales`` float16 ``[N, n_blocks]`` = ``QuantizedWeight.scales`` (MatMulNBits takes the scales
  in A's type: the export is float16);
* ``zero_points`` (asymmetric formats only; symmetric ones use the op's default ``2^(bits-1)``,
  weightquant's implied zero point) uint8 ``[N, ceil(n_blocks * bits / 8)]``: 4-bit ones packed
  two per byte, block ``2j`` in the low nibble (``pack_zero_points``); 8-bit ones one per byte.

``com.microsoft.MatMulNBits`` in onnxruntime 1.32.0 -- what was established, and how:

* Schema (``onnxruntime.capi._pybind_state.get_all_operator_schema()`` of the installed 1.32.0,
  the registry ``docs/ContribOperators.md`` is generated from): inputs ``A`` (T1), ``B`` uint8
  ``(N, k_blocks, blob_size)`` with ``k_blocks = ceil(K / block_size)``, ``blob_size =
  block_size * bits / 8``, "the first 4 bits stored in the lower 4 bits of a byte";
  ``scales`` T1 ``(N, k_blocks)`` (2-D, not flattened); ``zero_points`` optional, uint8 packed
  ``(N, ceil(k_blocks * bits / 8))`` "with the same bit-packing as B" or unpacked in T1
  ``(N, k_blocks)``, default ``2^(bits - 1)``; ``g_idx`` (deprecated), ``bias``. Attributes ``K``,
  ``N``, ``block_size`` (required; "a power of two and >= 16"), ``bits`` (default 4; 2, 4, 8),
  ``accuracy_level`` (default 0: A is not quantised; 4: "A can be quantized with the same
  block_size to int8"). T1 = float, float16, bfloat16.
* Kernels (one-node models, each format x T1 x accuracy level 0 / 4, K 96 and 64..2048;
  ``tests/export/test_export_weights.py`` keeps the matrix live): the CPU EP runs float and
  float16 with 4 and 8 bits, symmetric and asymmetric, block sizes 32..2048 (one block per row
  included); bfloat16: "Could not find an implementation for MatMulNBits(1)". The WebGPU plugin
  (onnxruntime-ep-webgpu 0.4.0, ``session.disable_cpu_ep_fallback=1`` so the node ran there) runs
  float and float16 with 4 and 8 bits likewise; bfloat16 has no kernel (the node gets no
  provider). CUDA registers float, float16 and bfloat16 with 4- and 8-bit kernels
  (microsoft/onnxruntime ``onnxruntime/contrib_ops/cuda/quantization/matmul_nbits.cc`` and
  ``matmul_8bits_*.cu``; not run here: no CUDA device). So no execution provider of the export
  lacks an 8-bit kernel and none is refused ``--weights int8:*``.
* Accuracy level: 4 quantises A to int8 per ``block_size`` elements on the CPU (max error 2e-2
  against the float product of the same weights, vs 1e-6 at level 0, K 96); the WebGPU float16
  kernel gives the same result at 0 and 4. The default is onnxruntime-genai 0.18.0's builder's
  (``models/quantization/quant_config.py``: ``accuracy_level`` 4 "if execution_provider in
  ('cpu', 'webgpu') else 0"): 4 on ``--ep webgpu`` -- where the CPU EP also runs nodes the
  WebGPU EP does not take, and where level 4 is the engine's own activation rounding (int8 per
  32 elements for the 32-element blocks) -- and 0 on ``--ep cuda``.

Refusals (before anything is written; ``check_weight_options`` and ``matmul_block``):
``--weights`` with ``--dtype bf16`` (the scales would be float16 values rounded to bfloat16,
so the package would not compute from weightquant's scales; the CPU and WebGPU EPs have no
bfloat16 kernel either); per-channel ``int8`` where a projection's K rounded up to 32 is not a
power of two (MatMulNBits' ``block_size`` rule: one block per row needs ``block_size`` = the
padded K). ``--accuracy-level`` / ``--no-quantize-lm-head`` without ``--weights`` are refused
rather than ignored.

``verify_nbits`` is ``pagedhybrid verify``'s part: every MatMulNBits node's attributes against
its initializers and the package's weight format, no projection left as a float MatMul, and --
given the checkpoint (``pagedhybrid verify --checkpoint``) -- K and N against the config's
projection shapes and the codes, scales and zero points byte for byte against
``weightquant.quantize`` of the checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export import ir_read as rd
from pagedhybrid.weightquant import QuantizedWeight, WeightFormat, quantize

ACCURACY_LEVELS = range(5)  # 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8
GENAI_ACCURACY_LEVEL = {"webgpu": 4, "cpu": 4}  # onnxruntime-genai 0.18.0's builder; else 0
CODES, SCALES, ZERO_POINTS = ".codes", ".scales", ".zero_points"  # initializer suffixes
B, SCALE, ZERO_POINT = 1, 2, 3  # MatMulNBits operand indices


@dataclass(frozen=True)
class NBitsWeights:
    """The projections' format in an export (``ExportOptions.weight_quant``)."""

    fmt: WeightFormat
    accuracy_level: int
    lm_head: bool = True  # the LM head too (the engine's choice)


def genai_accuracy_level(ep: str) -> int:
    """onnxruntime-genai's builder default ``accuracy_level`` for ``ep`` (module docstring)."""
    return GENAI_ACCURACY_LEVEL.get(ep, 0)


def parse_format(spec: str) -> WeightFormat:
    """``--weights SPEC`` as a ``WeightFormat``; a bad spelling is refused naming the option."""
    try:
        return WeightFormat.parse(spec, "weights")
    except ContractViolation as exc:
        raise UnsupportedConfiguration(f"--weights {spec!r}: {exc.rule}") from exc


def check_weight_options(weights: str | None, dtype: str, accuracy_level: int | None,
                         quantize_lm_head: bool) -> None:
    """The option-level refusals (module docstring)."""
    if weights is None:
        if accuracy_level is not None or not quantize_lm_head:
            raise UnsupportedConfiguration(
                "--accuracy-level / --no-quantize-lm-head apply to MatMulNBits projections: "
                "pass --weights int4|int8[:BLOCK][:asym] with them, or leave them out")
        return
    fmt = parse_format(weights)
    if dtype != "fp16":
        raise UnsupportedConfiguration(
            f"--weights {fmt.name} with --dtype {dtype}: com.microsoft.MatMulNBits takes its "
            "scales in the activation type, so a bfloat16 graph would round the float16 scales "
            "the codes were computed with (and onnxruntime's CPU and WebGPU MatMulNBits have no "
            "bfloat16 kernel); export quantized weights with --dtype fp16")
    if accuracy_level is not None and (isinstance(accuracy_level, bool)
                                       or accuracy_level not in ACCURACY_LEVELS):
        raise UnsupportedConfiguration(
            f"--accuracy-level {accuracy_level}: MatMulNBits' accuracy_level is 0 (unset), "
            "1 (fp32), 2 (fp16), 3 (bf16) or 4 (int8)")


def matmul_block(fmt: WeightFormat, k: int, name: str) -> int:
    """MatMulNBits' ``block_size`` for a projection of ``k`` input features: the format's block,
    or per channel ``k`` rounded up to 32 -- refused where that is not a power of two."""
    block = fmt.block_for(k)
    if block < 16 or block & (block - 1):
        raise UnsupportedConfiguration(
            f"--weights {fmt.name}: per-output-channel int8 makes one block of the padded K = "
            f"{block} for {name} (K {k}), and com.microsoft.MatMulNBits needs block_size a "
            "power of two >= 16; use block-wise --weights int8:32 or int8:128")
    return block


class NBitsLayout(NamedTuple):
    """Shapes of one MatMulNBits projection ``[n, k]`` (module docstring)."""

    n: int
    k: int
    block: int
    codes: tuple[int, int, int]
    scales: tuple[int, int]
    zero_points: tuple[int, int] | None  # None: symmetric


def layout(fmt: WeightFormat, n: int, k: int, name: str) -> NBitsLayout:
    block = matmul_block(fmt, k, name)
    nb = -(-k // block)
    zp = None if fmt.symmetric else (n, -(-nb * fmt.bits // 8))
    return NBitsLayout(n, k, block, (n, nb, block * fmt.bits // 8), (n, nb), zp)


def pack_zero_points(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``[N, n_blocks]`` -> MatMulNBits' ``[N, ceil(n_blocks * bits / 8)]`` (4 bits: two
    per byte, the even block in the low nibble)."""
    if bits == 8:
        return zeros.contiguous()
    if zeros.shape[1] % 2:
        zeros = torch.cat([zeros, torch.zeros_like(zeros[:, :1])], dim=1)
    return (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).contiguous()


def unpack_zero_points(packed: torch.Tensor, bits: int, n_blocks: int) -> torch.Tensor:
    """The inverse of ``pack_zero_points``: uint8 ``[N, n_blocks]``."""
    if bits == 8:
        return packed
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(1)[:, :n_blocks]


def quantize_projection(parts: Sequence[torch.Tensor], fmt: WeightFormat, name: str
                        ) -> QuantizedWeight:
    """``weightquant.quantize`` of the parts' rows concatenated (each part as stored)."""
    weight = parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts])
    return quantize(weight, fmt, name)


def node_attributes(fmt: WeightFormat, lay: NBitsLayout, accuracy_level: int) -> dict[str, int]:
    return {"K": lay.k, "N": lay.n, "bits": fmt.bits, "block_size": lay.block,
            "accuracy_level": accuracy_level}


def weight_metadata(nbits: NBitsWeights | None) -> dict[str, str]:
    """The package metadata of the projections' format (read back by ``verify_nbits``)."""
    if nbits is None:
        return {c.META_WEIGHT_FORMAT: "none"}
    return {c.META_WEIGHT_FORMAT: nbits.fmt.name,
            c.META_ACCURACY_LEVEL: str(nbits.accuracy_level),
            c.META_QUANTIZED_LM_HEAD: "1" if nbits.lm_head else "0"}


# -- verify ---------------------------------------------------------------------------------------
Check = Callable[[bool, str, str], bool]  # verify._Checker
Read = Callable[[str], torch.Tensor]  # a checkpoint tensor by name, as stored


def _init(node: ir.Node, k: int) -> ir.Value | None:
    v = rd.operand(node, k)
    return v if v is not None and v.const_value is not None else None


def _shape(v: ir.Value | None) -> tuple[Any, ...] | None:
    return None if v is None or v.shape is None else tuple(v.shape)


def _dtype(v: ir.Value | None) -> str:
    return "absent" if v is None or v.dtype is None else v.dtype.name.lower()


def _node_problems(node: ir.Node, fmt: WeightFormat, level: str | None, io_dtype: str,
                   shapes: Mapping[str, tuple[int, ...]] | None) -> list[str]:
    """What is wrong with one MatMulNBits node (empty: nothing), each naming the attribute or
    operand."""
    attrs = {a: rd.attr(node, a) for a in ("K", "N", "bits", "block_size", "accuracy_level")}
    bad = [f"{a} missing" for a, v in attrs.items() if not isinstance(v, int)]
    if bad:
        return bad
    k, n = attrs["K"], attrs["N"]
    if node.domain != c.MS_DOMAIN:
        bad.append(f"domain {node.domain!r} (expected {c.MS_DOMAIN})")
    if attrs["bits"] != fmt.bits:
        bad.append(f"bits {attrs['bits']} (package weight format {fmt.name})")
    try:
        want = layout(fmt, n, k, node.name or "?")
    except UnsupportedConfiguration as exc:
        return [*bad, f"block_size: {exc.reason}"]
    if attrs["block_size"] != want.block:
        bad.append(f"block_size {attrs['block_size']} (expected {want.block} for {fmt.name}, "
                   f"K {k})")
    if level is not None and str(attrs["accuracy_level"]) != level:
        bad.append(f"accuracy_level {attrs['accuracy_level']} (package metadata {level})")
    operands = {"B": (_init(node, B), "uint8", want.codes),
                "scales": (_init(node, SCALE), io_dtype, want.scales)}
    if want.zero_points is not None:
        operands["zero_points"] = (_init(node, ZERO_POINT), "uint8", want.zero_points)
    elif len(node.inputs) > ZERO_POINT and node.inputs[ZERO_POINT] is not None:
        bad.append(f"zero_points present for symmetric {fmt.name}")
    for port, (v, dtype, dims) in operands.items():
        if v is None or _dtype(v) != dtype or _shape(v) != dims:
            bad.append(f"{port} {_dtype(v)} {list(_shape(v) or [])} (expected a {dtype} "
                       f"initializer {list(dims)})")
    if any(v is not None for v in node.inputs[ZERO_POINT + 1:]):
        bad.append("g_idx / bias present (expected absent)")
    parts = _parts(node)
    if not parts:
        bad.append(f"metadata {c.META_PROJECTIONS} missing")
    elif shapes is not None:
        unknown = [p for p in parts if len(shapes.get(p, ())) != 2]
        if unknown:
            bad.append(f"{c.META_PROJECTIONS} names {unknown}, not projections of the config")
        else:
            rows, ks = sum(shapes[p][0] for p in parts), {shapes[p][1] for p in parts}
            if rows != n or ks != {k}:
                bad.append(f"K {k}, N {n} vs the config's {parts}: K {sorted(ks)}, N {rows}")
    return bad


def _parts(node: ir.Node) -> list[str]:
    raw = node.metadata_props.get(c.META_PROJECTIONS, "")
    return [p for p in raw.split(",") if p]


def _weights_problems(node: ir.Node, fmt: WeightFormat, read: Read) -> list[str]:
    """The node's codes / scales / zero points against ``weightquant.quantize`` of each part."""
    codes = torch.from_numpy(np.array(node.inputs[B].const_value.numpy()))
    scales = torch.from_numpy(np.array(node.inputs[SCALE].const_value.numpy()))
    zp = _init(node, ZERO_POINT)
    zeros = None if zp is None else unpack_zero_points(
        torch.from_numpy(np.array(zp.const_value.numpy())), fmt.bits, scales.shape[1])
    bad, row = [], 0
    for part in _parts(node):
        q = quantize(read(part), fmt, part)
        rows = slice(row, row + q.codes.shape[0])
        row += q.codes.shape[0]
        for port, got, want in (("B", codes[rows], q.codes), ("scales", scales[rows], q.scales),
                                ("zero_points", None if zeros is None else zeros[rows],
                                 q.zeros)):
            if got is None or want is None or got.shape != want.shape:
                if got is not None or want is not None:
                    bad.append(f"{port} of {part}: shape {None if got is None else list(got.shape)}"
                               f" (weightquant: {None if want is None else list(want.shape)})")
                continue
            differ = (got.view(torch.uint8) != want.view(torch.uint8)).flatten(1).any(1)
            if differ.any():
                first = int(differ.nonzero()[0])
                bad.append(f"{port} row {rows.start + first} ({int(differ.sum())} of {part}'s "
                           f"rows {rows.start}:{rows.stop}) differs from weightquant.quantize"
                           f"({fmt.name})")
    return bad


def _float_projections(graph: ir.Graph, lm_head_float: bool) -> list[str]:
    """MatMul nodes still multiplying by a transposed checkpoint projection (router gates and,
    with ``--no-quantize-lm-head``, the LM head excepted)."""
    left = []
    for n in graph:
        w = n.inputs[1] if n.op_type == "MatMul" and len(n.inputs) > 1 else None
        name = (w.name or "") if w is not None and w.const_value is not None else ""
        if not name.endswith(".transpose") or name.endswith(c.ROUTER_WEIGHT + ".transpose"):
            continue
        if lm_head_float and name.startswith("lm_head."):
            continue
        left.append(n.name or name)
    return left


def verify_nbits(model: ir.Model, chk: Check, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 read: Read | None = None, graph_name: str = c.MODEL_FILE) -> None:
    """The MatMulNBits part of ``pagedhybrid verify`` for one graph (module docstring);
    ``shapes`` (the config's checkpoint shapes) and ``read`` (its tensors) when the checkpoint is
    given."""
    meta = dict(model.metadata_props)
    nodes = [n for n in model.graph if n.op_type == c.MATMUL_NBITS]
    spec = meta.get(c.META_WEIGHT_FORMAT, "none")
    if spec == "none":
        chk(not nodes, "MatMulNBits", f"{graph_name}: {len(nodes)} nodes in a package without "
            "--weights (expected 0)")
        return
    try:
        fmt = WeightFormat.parse(spec)
    except ContractViolation as exc:
        chk(False, "weight format", f"{graph_name}: metadata {c.META_WEIGHT_FORMAT} = {spec!r}: "
            f"{exc.rule}")
        return
    io_dtype = meta.get(c.META_DTYPE, "?")
    level = meta.get(c.META_ACCURACY_LEVEL)
    chk(level is not None and level.isdigit() and int(level) in ACCURACY_LEVELS,
        "weight format", f"{graph_name}: {fmt.name}, accuracy_level {level!r}, "
        f"{len(nodes)} MatMulNBits nodes")
    left = _float_projections(model.graph, meta.get(c.META_QUANTIZED_LM_HEAD) == "0")
    chk(not left and bool(nodes), "MatMulNBits coverage",
        f"{graph_name}: float MatMul projections {left}" if left else
        f"{graph_name}: every projection is a MatMulNBits node ({len(nodes)})")
    for node in nodes:
        bad = _node_problems(node, fmt, level, io_dtype, shapes)
        chk(not bad, "MatMulNBits node", f"{node.name}: " + ("; ".join(bad) if bad else
            f"K {rd.attr(node, 'K')}, N {rd.attr(node, 'N')}, bits {fmt.bits}, block_size "
            f"{rd.attr(node, 'block_size')}"))
        if read is not None and not bad:
            wrong = _weights_problems(node, fmt, read)
            chk(not wrong, "MatMulNBits weights", f"{node.name}: " + ("; ".join(wrong) if wrong
                else f"{_parts(node)} equal weightquant.quantize ({fmt.name})"))
