"""Weights in 8 and 4 bits: the formats, round-to-nearest quantisation, and the one layout.

A ``WeightFormat`` is ``int8`` or ``int4`` with a block size along K (the input features) and
symmetric or asymmetric (zero points) codes; its spelling (``--quantization``, ``--weights``):

* ``int8`` -- per output channel, symmetric (one scale per row of the weight: llama.cpp's and
  vLLM's W8A8 CPU choice); ``int8:32`` / ``int8:128`` block-wise (as q8_0 / an ORT int8 package);
* ``int4`` = ``int4:32`` -- block-wise symmetric (llama.cpp's q4_0, ORT GenAI's default block);
  ``int4:128``; a trailing ``:asym`` adds a zero point per block (``int4:32:asym``, as q4_1).

Layout (``QuantizedWeight``): exactly ``com.microsoft.MatMulNBits``' ``B`` for a weight
``[N, K]``: ``codes`` uint8 ``[N, n_blocks, block * bits / 8]`` with K zero-padded to
``n_blocks * block``; 4-bit codes two to a byte, element ``2j`` in the low nibble and ``2j + 1``
in the high one; ``scales`` float16 ``[N, n_blocks]``; ``zeros`` uint8 ``[N, n_blocks]`` (one
unpacked zero point per block; None = symmetric, the implied ``2^(bits-1)``: 8 / 128). The value
is ``(code - zero) * scale``. The export writes these bytes (the 4-bit zero points packed two to
a byte as MatMulNBits wants) and the engine's kernels read the same codes and scales, so the
engine and an ONNX package compute from the same values.

The engine holds a weight whose N is a multiple of ``GROUP`` = 16 in groups of 16 rows
(``group_rows``; ``ungroup`` gives the layout above back, byte for byte): ``codes`` uint8
``[N / 16, n_blocks, L, 64]``, ``scales`` float16 and ``zeros`` uint8 ``[N / 16, n_blocks, 16]``
(row ``i`` of the group at index ``i``). Each 64-byte line holds the group's 16 rows' four bytes
(row ``i`` at bytes ``4i ..``), the order in which one vector instruction multiplies 16 rows by
four activation codes (``kernels/native/csrc/quant_gemm.cpp`` ``group_rows``): 8-bit line ``j`` of a
block = its elements ``4j .. 4j + 3`` (``L = block / 4``); 4-bit line ``j`` = its elements
``8j .. 8j + 7``, byte ``t`` holding element ``8j + t`` in the low nibble and ``8j + 4 + t`` in
the high one (``L = block / 8``).

Quantisation (round to nearest, ties to even; the scale rounded to float16 first and the codes
computed with the rounded scale, so ``dequantize`` is exactly what either runtime multiplies by):

* symmetric int4: ``scale = m / -8`` with ``m`` the block's element of largest magnitude (signed),
  ``code = clamp(round(w / scale) + 8, 0, 15)`` -- the largest element lands on code 0 exactly,
  all 16 levels used (llama.cpp's q4_0 rule);
* symmetric int8: ``scale = max|w| / 127``, ``code = round(w / scale) + 128`` (1..255);
* asymmetric: the range ``[min(w, 0), max(w, 0)]`` over ``2^bits - 1`` steps, ``zero =
  clamp(round(-lo / scale), 0, qmax)``, ``code = clamp(round(w / scale) + zero, 0, qmax)``.

A zero block has scale 0 and codes at the zero point. A scale beyond float16 is refused.

Activations (``quantize_rows``): the kernels multiply int8 codes of the activations, quantised
per row on the fly in sub-blocks of ``ACT_BLOCK`` = 32 (llama.cpp's q8 path): ``d = max|x| / 127``,
``q = round(x * (1 / d))`` (0 where ``d`` is 0). ``reference_linear`` is that product in float64
from the same activation codes and the dequantised weights: the kernels' sums are exact integer
dot products per sub-block, so they differ from it only by fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedhybrid.errors import ContractViolation

OP = "pagedhybrid.weightquant"
ACT_BLOCK = 32  # activation sub-block of the kernels (and the smallest weight block)
GROUP = 16  # rows of a group of the engine's codes (module docstring)
BLOCKS = (32, 64, 128, 256)
BITS = (4, 8)


@dataclass(frozen=True)
class WeightFormat:
    """``bits`` 4 | 8; ``block`` elements of K per scale (0: one block per output row, padded
    K); ``symmetric`` False: a zero point per block."""

    bits: int
    block: int = 32
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ContractViolation(OP, "bits", f"must be one of {list(BITS)}", self.bits)
        if self.block != 0 and self.block not in BLOCKS:
            raise ContractViolation(OP, "block", f"must be one of {list(BLOCKS)} or 0 "
                                    "(per output channel)", self.block)

    @property
    def name(self) -> str:
        block = "channel" if self.block == 0 else str(self.block)
        default = 0 if self.bits == 8 else 32
        s = f"int{self.bits}" + ("" if self.block == default else f":{block}")
        return s if self.symmetric else f"int{self.bits}:{block}:asym"

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1

    def block_for(self, k: int) -> int:
        """The block size used for ``k`` input features (per channel: ``k`` rounded up to a
        multiple of ``ACT_BLOCK``)."""
        return self.block or -(-k // ACT_BLOCK) * ACT_BLOCK

    @classmethod
    def parse(cls, spec: str, where: str = "quantization") -> WeightFormat:
        """``int8`` | ``int4`` [``:BLOCK`` | ``:channel``] [``:asym``] (module docstring)."""
        parts = str(spec).strip().lower().split(":")
        rule = ("must be int8 or int4, optionally :BLOCK (32, 64, 128, 256; channel = one "
                "block per output row) and :asym, e.g. int4:128 or int8:32:asym")
        if parts[0] not in ("int8", "int4") or len(parts) > 3:
            raise ContractViolation(OP, where, rule, spec)
        bits = int(parts[0][3:])
        block = 0 if bits == 8 else 32
        symmetric = True
        for p in parts[1:]:
            if p == "asym":
                symmetric = False
            elif p == "channel":
                block = 0
            elif p.isdigit() and int(p) in BLOCKS:
                block = int(p)
            else:
                raise ContractViolation(OP, where, rule, spec)
        return cls(bits, block, symmetric)


class QuantizedWeight(NamedTuple):
    """A ``[N, K]`` weight in a ``WeightFormat`` (module docstring: the MatMulNBits layout)."""

    codes: torch.Tensor  # uint8 [N, n_blocks, block * bits / 8] (grouped: group_rows)
    scales: torch.Tensor  # float16 [N, n_blocks] (grouped: [N / 16, n_blocks, 16])
    zeros: torch.Tensor | None  # uint8 as scales; None: symmetric (2^(bits-1))
    fmt: WeightFormat
    in_features: int  # K

    @property
    def grouped(self) -> bool:
        """In groups of ``GROUP`` rows (``group_rows``)."""
        return self.codes.dim() == 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * (GROUP if self.grouped else 1), self.in_features

    @property
    def block(self) -> int:
        return (self.codes.shape[2] * 32 if self.grouped else self.codes.shape[2] * 8) \
            // self.fmt.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros)
                   if t is not None)


def quantize(weight: torch.Tensor, fmt: WeightFormat, name: str = "weight") -> QuantizedWeight:
    """Round-to-nearest codes and float16 scales of ``weight [N, K]`` (module docstring)."""
    if weight.dim() != 2:
        raise ContractViolation(OP, name, "must be a [N, K] projection weight",
                                tuple(weight.shape))
    n, k = weight.shape
    block = fmt.block_for(k)
    nb = -(-k // block)
    w = torch.zeros(n, nb * block, dtype=torch.float32)
    w[:, :k] = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ContractViolation(OP, name, "must be finite to quantise")
    w = w.view(n, nb, block)
    if fmt.symmetric:
        if fmt.bits == 4:
            at = w.abs().argmax(dim=-1, keepdim=True)
            scale = (w.gather(-1, at).squeeze(-1) / -8.0)
        else:
            scale = w.abs().amax(dim=-1) / 127.0
        zero = torch.full((n, nb), 1 << (fmt.bits - 1), dtype=torch.float32)
    else:
        lo = w.amin(dim=-1).clamp(max=0.0)
        hi = w.amax(dim=-1).clamp(min=0.0)
        scale = (hi - lo) / fmt.qmax
    s16 = scale.to(torch.float16)
    if not torch.isfinite(s16).all():
        raise ContractViolation(OP, name, "has a block whose scale exceeds float16's range",
                                f"max |w| {w.abs().max().item():.4g}")
    s = s16.float()
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    if not fmt.symmetric:
        zero = torch.where(s != 0, torch.round(-lo * inv), torch.zeros_like(s)).clamp(0, fmt.qmax)
    q = (torch.round(w * inv[..., None]) + zero[..., None]).clamp(0, fmt.qmax).to(torch.uint8)
    if fmt.bits == 4:
        q = _nibbles(q)
    zeros = None if fmt.symmetric else zero.to(torch.uint8).contiguous()
    return QuantizedWeight(q.contiguous(), s16.contiguous(), zeros, fmt, k)


def quantized_nbytes(shape: tuple[int, int], fmt: WeightFormat) -> tuple[int, int, int]:
    """Bytes of the codes, scales and zero points (0: symmetric) of a ``[N, K]`` weight in
    ``fmt``, before it is quantised (either order)."""
    n, k = shape
    block = fmt.block_for(k)
    nb = -(-k // block)
    return n * nb * block * fmt.bits // 8, 2 * n * nb, 0 if fmt.symmetric else n * nb


def _elements(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Row-layout codes ``[N, n_blocks, block * bits / 8]`` as one uint8 per element."""
    if bits == 8:
        return codes
    return torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)


def _nibbles(elements: torch.Tensor) -> torch.Tensor:
    """4-bit codes one per element, two to a byte: element ``2j`` low, ``2j + 1`` high
    (``_elements`` undone)."""
    return elements[..., 0::2] | (elements[..., 1::2] << 4)


def group_rows(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` in groups of ``GROUP`` rows (module docstring), the engine's order; ``q`` itself
    when its N is not a multiple of ``GROUP`` or it is grouped already."""
    if q.grouped or q.codes.shape[0] % GROUP:
        return q
    n, nb, _ = q.codes.shape
    g, block = n // GROUP, q.block
    e = _elements(q.codes, q.fmt.bits).view(g, GROUP, nb, block)
    if q.fmt.bits == 8:  # [g, nb, block / 4, row, 4]
        lines = e.view(g, GROUP, nb, block // 4, 4).permute(0, 2, 3, 1, 4)
    else:  # byte t of row i, line j: element 8j + t low, 8j + 4 + t high
        e = e.view(g, GROUP, nb, block // 8, 2, 4)
        lines = (e[..., 0, :] | (e[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)

    def by_group(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(g, GROUP, nb).transpose(1, 2).contiguous()

    return q._replace(codes=lines.reshape(g, nb, -1, 4 * GROUP).contiguous(),
                      scales=by_group(q.scales), zeros=by_group(q.zeros))


def ungroup(q: QuantizedWeight) -> QuantizedWeight:
    """``q`` in MatMulNBits' row layout (``group_rows`` undone; ``q`` itself when it is in it)."""
    if not q.grouped:
        return q
    g, nb, lines, _ = q.codes.shape
    c = q.codes.view(g, nb, lines, GROUP, 4).permute(0, 3, 1, 2, 4)  # [g, row, nb, line, 4]
    if q.fmt.bits == 8:
        codes = c.reshape(g * GROUP, nb, lines * 4)
    else:  # back to elements, then two to a byte, 2j low
        codes = _nibbles(torch.stack((c & 0x0F, c >> 4), dim=-2).reshape(g * GROUP, nb,
                                                                           lines * 8))

    def by_row(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.transpose(1, 2).reshape(g * GROUP, nb).contiguous()

    return q._replace(codes=codes.contiguous(), scales=by_row(q.scales), zeros=by_row(q.zeros))


def unpack_codes(q: QuantizedWeight) -> torch.Tensor:
    """The codes as uint8 ``[N, n_blocks, block]`` in row order (4-bit ones unpacked)."""
    return _elements(ungroup(q).codes, q.fmt.bits)


def zero_points(q: QuantizedWeight) -> torch.Tensor:
    """float32 ``[N, n_blocks]`` zero points (the implied ones of a symmetric format)."""
    q = ungroup(q)
    if q.zeros is not None:
        return q.zeros.float()
    return torch.full(q.scales.shape, float(1 << (q.fmt.bits - 1)))


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(code - zero) * scale`` as ``[N, K]``: what either runtime multiplies by."""
    q = ungroup(q)
    codes = unpack_codes(q).float()
    w = (codes - zero_points(q)[..., None]) * q.scales.float()[..., None]
    return w.flatten(1)[:, :q.in_features].to(dtype).contiguous()


def quantize_rows(x: torch.Tensor, width: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation codes of ``x [M, K]``: (int8 ``[M, width]``, float32 scales
    ``[M, width / ACT_BLOCK]``), ``x`` zero-padded to ``width`` (default: K rounded up to
    ``ACT_BLOCK``)."""
    m, k = x.shape
    width = width or -(-k // ACT_BLOCK) * ACT_BLOCK
    xp = torch.zeros(m, width, dtype=torch.float32)
    xp[:, :k] = x.float()
    xb = xp.view(m, width // ACT_BLOCK, ACT_BLOCK)
    d = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(m, width), d


def reference_linear(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """``x [..., K] @ dequantize(q)^T`` with ``x`` quantised as the kernels quantise it
    (``quantize_rows``), in float64, rounded to ``x``'s dtype: the kernels' oracle, and the
    product of the bundles without a quantised kernel."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != q.in_features:
        raise ContractViolation(OP, "x", f"last dimension must equal the weight's K = "
                                f"{q.in_features}", tuple(x.shape))
    xq, d = quantize_rows(x.reshape(-1, k))
    xd = (xq.double().view(xq.shape[0], -1, ACT_BLOCK) * d.double()[..., None]).flatten(1)
    out = xd[:, :k] @ dequantize(q, torch.float64).T
    return out.to(x.dtype).view(*lead, q.shape[0])
