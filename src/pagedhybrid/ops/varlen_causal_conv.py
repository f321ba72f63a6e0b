"""``com.microsoft.VarlenCausalConvWithState``: packed depthwise causal conv with a carried state.

Algorithm. ``input`` holds the tokens of B sequences packed one after the other, ``[T, C]``
(token-major, channels-last); sequence b owns rows ``cu[b]:cu[b+1]`` of
``cumulative_sequence_length`` (int32 ``[B+1]``). Each channel c is convolved over time with its
own kernel ``weight[c, 0, :]`` of K taps (depthwise, ``[C, 1, K]``), causally and never across a
sequence boundary. Local token p of sequence b reads, for tap j, the sample at local position
``p - (K-1-j)*dilation``; positions before the first token come from the carry state:

    y[p, c] = bias[c] + sum_j weight[c, 0, j] * x_ext[L + p - (K-1-j)*dilation, c]
    out     = act(y)                      act in {none, silu, swish (== silu)}

where ``x_ext = concat(initial_state[b].T, x[cu[b]:cu[b+1]])`` and ``L = (K-1)*dilation``.

State layout. ``initial_state`` / ``final_state`` are ``[B, C, L]`` channels-first, in the
activation dtype: the raw input samples of the last L positions before / after the call (zeros at
sequence start). ``final_state[b] = x_ext[-L:].T``, so a sequence shorter than L keeps a suffix of
its initial state in front of its own tokens. ``output`` has the input's shape and dtype.

Contract decisions (ONNX Runtime 1.32, checked by running its CPU kernel):
* ``activation`` defaults to ``'none'`` in the schema (a Qwen3.5 layer passes ``'silu'``).
* ``initial_state`` is a required ORT input; the Python function accepts ``None`` as zeros for
  convenience (the ORT runner substitutes the zeros explicitly).
* Zero-length sequences: the schema says every sequence contributes at least one token; ORT's
  CPU kernel happens to accept them, but the CUDA/WebGPU kernels treat ``start >= end`` as
  malformed and leave that sequence's output unspecified. We follow the schema and reject them
  (``cumulative_sequence_length`` must be strictly increasing), so every implementation agrees.
* Compact state updates (ONNX Runtime 1.32's CPU kernel, checked by running it):
  ``state_update_capacity`` C in [0, 8]; ``capture_count`` (int32 ``[B]``) is given exactly when
  C > 0. Sequence b captures its first ``n_b = clamp(capture_count[b], 0, min(C, len_b))``
  tokens: the third output ``state_update [B, C, channels]`` (activation dtype) holds their raw
  input rows, ``state_update[b, t] = input[cu[b] + t]`` for t < n_b, zeros after. ``output`` and
  ``final_state`` are those of the call without capture. ``replay_state`` rebuilds the conv state
  after the first j_b <= n_b tokens from ``initial_state`` and ``state_update`` (speculative
  decoding keeps an accepted prefix of a verified draft without storing a state per token):
  ``new[b, c, p] = initial[b, c, p + j]`` for ``p + j < L``, else ``state_update[b, p + j - L, c]``.
* The CUDA dynamic mode (``kernel_delta``, ``previous_mask``) raises UnsupportedConfiguration.
* K = 1 (state length 0) and dilation >= 1 are supported.

Types: T is float / float16 / bfloat16 (ORT); pagedhybrid also accepts ``double`` (extension, for
tests). Arithmetic runs in float32 (float64 for double inputs); the output is cast back.

Calling convention: ``varlen_causal_conv`` and ``validate`` take ``SPEC.signature()`` (the 8
inputs in ORT order, then the attributes keyword-only); ``validate_call`` / ``reference`` work on
the ``BoundCall`` that ``SPEC.bind`` makes of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.ops.spec import (
    MAX_STATE_UPDATE_CAPACITY,
    Attribute,
    BoundCall,
    OpSpec,
    Port,
    TypeConstraint,
    check_cu_seqlens,
    check_shape,
)

_T = ("float", "float16", "bfloat16")

SPEC = OpSpec(
    domain="com.microsoft",
    name="VarlenCausalConvWithState",
    version=1,
    inputs=(
        Port("input", "T", ranks=(2,), shape="[total_tokens, channels]"),
        Port("weight", "T", ranks=(3,), shape="[channels, 1, kernel_size]"),
        Port("cumulative_sequence_length", "M", ranks=(1,), shape="[batch_size + 1]",
             doc="strictly increasing prefix sums (every sequence has >= 1 token)"),
        Port("bias", "T", optional=True, ranks=(1,), shape="[channels]"),
        Port("initial_state", "T", ranks=(3,), shape="[batch_size, channels, (K-1)*dilation]",
             doc="required by ORT; None in Python means zeros", none_means="zeros"),
        Port("capture_count", "M", optional=True, ranks=(1,), shape="[batch_size]",
             doc="tokens to capture per sequence; given exactly when state_update_capacity > 0"),
        Port("kernel_delta", "T", optional=True, shape="[total_tokens, taps, channels/group]",
             supported=False, doc="CUDA dynamic mode"),
        Port("previous_mask", "T", optional=True, shape="[total_tokens, 1]", supported=False,
             doc="CUDA dynamic mode"),
    ),
    outputs=(
        Port("output", "T", shape="[total_tokens, channels]"),
        Port("final_state", "T", shape="[batch_size, channels, (K-1)*dilation]"),
        Port("state_update", "T", optional=True,
             shape="[batch_size, state_update_capacity, channels]",
             doc="the captured tokens' input rows (present when state_update_capacity > 0)"),
    ),
    attributes=(
        Attribute("activation", "string", "none", choices=("none", "silu", "swish"),
                  doc="fused activation; swish == silu"),
        Attribute("dilation", "int", 1, doc="spacing of the kernel taps, >= 1"),
        Attribute("state_update_capacity", "int", 0,
                  choices=tuple(range(MAX_STATE_UPDATE_CAPACITY + 1)),
                  doc="compact state-update capture: tokens per sequence, [0, 8]"),
        Attribute("group_size", "int", 1, doc="CUDA dynamic mode only"),
        Attribute("delta_offset", "int", 0, doc="CUDA dynamic mode only"),
    ),
    type_constraints=(
        TypeConstraint("T", _T, extension=("double",)),
        TypeConstraint("M", ("int32",)),
    ),
    doc=__doc__ or "",
)


class ConvDims(NamedTuple):
    """Derived dimensions of one validated call."""

    total_tokens: int
    channels: int
    kernel_size: int
    dilation: int
    state_len: int  # (kernel_size - 1) * dilation
    batch: int
    cu_seqlens: tuple[int, ...]  # [B+1] host copy
    dtype: torch.dtype  # activation dtype (input, output and state)
    compute_dtype: torch.dtype  # float32, or float64 for double inputs
    attrs: dict[str, Any]  # resolved attributes
    captured: tuple[int, ...] = ()  # n_b: tokens captured per sequence (empty: no capture)

    @property
    def capacity(self) -> int:
        return int(self.attrs["state_update_capacity"])


def validate_call(call: BoundCall) -> ConvDims:
    """Check every port and attribute; derive the dims (``initial_state=None`` means zeros)."""
    SPEC.check_inputs(call.inputs)
    input, weight, cumulative_sequence_length, bias, initial_state = call.inputs[:5]
    a = call.attrs
    SPEC.check(a["dilation"] >= 1, "dilation", "must be >= 1", a["dilation"])
    SPEC.check(a["group_size"] == 1, "group_size",
               "must be 1 (values other than 1 need kernel_delta, CUDA dynamic mode)",
               a["group_size"])
    SPEC.check(a["delta_offset"] == 0, "delta_offset",
               "must be 0 (values other than 0 need kernel_delta, CUDA dynamic mode)",
               a["delta_offset"])

    total, channels = input.shape
    SPEC.check(channels > 0, "input", "must have at least one channel", list(input.shape))
    SPEC.check(weight.shape[0] == channels and weight.shape[1] == 1 and weight.shape[2] >= 1,
               "weight", f"must have shape [channels={channels}, 1, kernel_size>=1] (depthwise)",
               list(weight.shape))
    k = int(weight.shape[2])
    state_len = (k - 1) * a["dilation"]
    cu = check_cu_seqlens(SPEC, "cumulative_sequence_length", cumulative_sequence_length, total,
                          allow_empty_sequences=False)
    batch = len(cu) - 1
    if bias is not None:
        check_shape(SPEC, "bias", bias, [channels], "[channels]")
    if initial_state is not None:
        check_shape(SPEC, "initial_state", initial_state, [batch, channels, state_len],
                    "[batch_size, channels, (kernel_size-1)*dilation]")
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    capture_count = call.inputs[5]
    cap = a["state_update_capacity"]
    SPEC.check((capture_count is not None) == (cap > 0), "capture_count",
               "must be given exactly when state_update_capacity > 0",
               f"state_update_capacity={cap}, capture_count "
               f"{'given' if capture_count is not None else 'absent'}")
    captured: tuple[int, ...] = ()
    if capture_count is not None:
        check_shape(SPEC, "capture_count", capture_count, [batch], "[batch_size]")
        counts = capture_count.tolist()
        captured = tuple(max(0, min(int(n), cap, hi - lo))
                         for n, lo, hi in zip(counts, cu, cu[1:], strict=False))
    return ConvDims(total, channels, k, a["dilation"], state_len, batch, tuple(cu), input.dtype,
                    compute, a, captured)


validate = SPEC.define(validate_call, "validate")  # the same check, called like the op


def output_shapes(*inputs: torch.Tensor | None, **attrs: Any
                  ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of ``output``, ``final_state`` and, when capturing, ``state_update`` for
    these inputs and attributes."""
    d = validate(*inputs, **attrs)
    return (((d.total_tokens, d.channels), d.dtype),
            ((d.batch, d.channels, d.state_len), d.dtype),
            *([((d.batch, d.capacity, d.channels), d.dtype)] if d.capacity else []))


def _gather_index(d: ConvDims, offsets: torch.Tensor, seq: torch.Tensor,
                  local: torch.Tensor) -> torch.Tensor:
    """Rows of ``cat([state rows (B*L), input rows (T)])`` holding local position ``local +
    offsets`` of sequence ``seq``: negative positions index that sequence's state."""
    pos = local[:, None] + offsets[None, :]  # [N, K]
    starts = torch.tensor(d.cu_seqlens[:-1], dtype=torch.long)[seq]  # [N]
    from_input = d.batch * d.state_len + starts[:, None] + pos
    from_state = seq[:, None] * d.state_len + d.state_len + pos
    return torch.where(pos >= 0, from_input, from_state)  # [N, K]


def reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              initial_state: torch.Tensor | None, d: ConvDims
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv of a validated call, vectorised as a gather over ``[state rows; input rows]``."""
    ct = d.compute_dtype
    if initial_state is None:
        initial_state = torch.zeros(d.batch, d.channels, d.state_len, dtype=d.dtype)
    rows = torch.cat([initial_state.to(ct).permute(0, 2, 1).reshape(-1, d.channels),
                      input.to(ct)])  # [B*L + T, C]
    lens = torch.tensor([b - a for a, b in zip(d.cu_seqlens, d.cu_seqlens[1:], strict=False)])
    seq = torch.repeat_interleave(torch.arange(d.batch), lens)  # [T]
    local = torch.arange(d.total_tokens) - torch.tensor(d.cu_seqlens[:-1])[seq]  # [T]
    taps = (torch.arange(d.kernel_size) - (d.kernel_size - 1)) * d.dilation  # [K], <= 0
    window = rows[_gather_index(d, taps, seq, local)]  # [T, K, C]
    y = torch.einsum("tkc,ck->tc", window, weight.to(ct)[:, 0, :])  # [T, C]
    if bias is not None:
        y = y + bias.to(ct)
    if d.attrs["activation"] in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    # final state: local positions n_b - L .. n_b - 1 of every sequence
    tail = torch.arange(d.state_len) - d.state_len  # [L]
    bidx = torch.arange(d.batch)
    state_rows = rows[_gather_index(d, tail, bidx, lens)]  # [B, L, C]
    final = state_rows.permute(0, 2, 1).contiguous()  # [B, C, L]
    return y.to(d.dtype), final.to(d.dtype)


def state_update(input: torch.Tensor, d: ConvDims) -> torch.Tensor:
    """``[B, C, channels]`` (input dtype): the first ``n_b`` input rows of each sequence, zeros
    after (the module docstring's capture)."""
    out = torch.zeros(d.batch, d.capacity, d.channels, dtype=input.dtype)
    for b, n in enumerate(d.captured):
        out[b, :n] = input[d.cu_seqlens[b]:d.cu_seqlens[b] + n]
    return out


def with_capture(outputs: tuple[torch.Tensor, torch.Tensor], input: torch.Tensor, d: ConvDims
                 ) -> tuple[torch.Tensor, ...]:
    """``(output, final_state)``, and ``state_update`` when the call captures (C > 0)."""
    return (*outputs, state_update(input, d)) if d.capacity else outputs


def replay_state(initial_state: torch.Tensor, state_update: torch.Tensor,
                 accepted: Sequence[int], captured: Sequence[int] | None = None) -> torch.Tensor:
    """The conv state ``[B, C, L]`` after the first ``accepted[b]`` tokens of each sequence of a
    capturing call, from its ``initial_state`` and ``state_update`` (module docstring): what a
    call on those tokens alone leaves, exactly. ``captured``: the call's ``n_b`` (when given,
    each ``accepted[b]`` must be within it)."""
    op = f"{SPEC.qualname}.replay_state"
    b, c, length = initial_state.shape
    if state_update.dim() != 3 or state_update.shape[0] != b or state_update.shape[2] != c:
        raise ContractViolation(op, "state_update", f"must be [B={b}, capacity, C={c}]",
                                list(state_update.shape))
    if len(accepted) != b:
        raise ContractViolation(op, "accepted", f"must hold one count per sequence ({b})",
                                list(accepted))
    limits = captured if captured is not None else [state_update.shape[1]] * b
    for i, (j, n) in enumerate(zip(accepted, limits, strict=True)):
        if not 0 <= j <= n:
            raise ContractViolation(op, "accepted", f"[{i}] must be in [0, {n}] (the tokens "
                                    "that sequence captured)", j)
    out = initial_state.clone()
    for i, j in enumerate(accepted):
        if j:
            ext = torch.cat([initial_state[i], state_update[i, :j].to(out.dtype).t()], 1)
            out[i] = ext[:, j:j + length]
    return out


@SPEC.implement("reference")
def varlen_causal_conv(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Reference ``VarlenCausalConvWithState``: returns ``(output [T, C], final_state [B, C, L])``
    and, when ``state_update_capacity > 0``, ``state_update [B, capacity, C]``.

    ``initial_state=None`` means zeros (a Python convenience; ORT requires the input).
    """
    input, weight, _cu, bias, initial_state = call.inputs[:5]
    d = validate_call(call)
    return with_capture(reference(input, weight, bias, initial_state, d), input, d)


# -- conformance --------------------------------------------------------------------------------
def conformance_recipes() -> list[dict[str, Any]]:
    """Deterministic JSON-able cases covering the supported features."""

    def r(name: str, seq_lens: Sequence[int], channels: int, kernel_size: int, *,
          bias: bool = False, state: str = "random", capture: Sequence[int] | None = None,
          **attrs: Any) -> dict[str, Any]:
        dims = {"seq_lens": list(seq_lens), "channels": channels, "kernel_size": kernel_size,
                "bias": bias, "state": state}
        if capture is not None:
            dims["capture"] = list(capture)
        return {"name": name, "dims": dims, "attrs": attrs}

    return [
        r("k4_silu_prefill_unequal", [5, 1, 9, 3], 16, 4, activation="silu"),
        r("k4_none_bias", [4, 7], 8, 4, bias=True, activation="none"),
        r("k3_silu_bias", [6, 2, 3], 12, 3, bias=True, activation="silu"),
        r("k2_none", [3, 5], 8, 2, activation="none"),
        r("k1_pointwise_bias", [2, 3], 4, 1, bias=True, activation="silu"),
        r("decode_steps_with_state", [1, 1, 1, 1, 1], 16, 4, activation="silu"),
        r("short_seqs_keep_state_prefix", [1, 2, 2, 1], 8, 4, activation="silu"),
        r("dilation2_k3", [7, 2, 5], 8, 3, bias=True, activation="silu", dilation=2),
        r("swish_alias", [4, 4], 8, 4, activation="swish"),
        r("zero_initial_state", [5, 3], 8, 4, state="zeros", activation="silu"),
        r("single_long_sequence", [70], 8, 4, activation="silu"),
        r("qwen_like_qkv_channels", [6, 1, 3], 64, 4, activation="silu"),
        r("schema_default_activation", [3, 4], 8, 4, bias=True),
        # compact state updates: a verify step of drafts, counts clamped to the capacity and to
        # the sequence (9 -> 3, -1 -> 0), and a step that captures nothing
        r("capture_verify_step", [4, 1, 3, 2], 16, 4, activation="silu", capture=[4, 1, 2, 2],
          state_update_capacity=4),
        r("capture_clamped_dilation2", [5, 3, 1], 8, 3, bias=True, activation="silu",
          capture=[2, 9, -1], dilation=2, state_update_capacity=4),
        r("capture_none_capacity8", [3, 2], 8, 4, activation="silu", capture=[0, 0],
          state_update_capacity=8),
    ]


def make_inputs(recipe: dict[str, Any], dtype: torch.dtype, seed: int
                ) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Random inputs for a recipe: the 8 positional inputs (None when absent) and attributes."""
    d, attrs = recipe["dims"], dict(recipe["attrs"])
    gen = torch.Generator().manual_seed(seed)
    lens, c, k = d["seq_lens"], d["channels"], d["kernel_size"]
    total, b = sum(lens), len(lens)
    state_len = (k - 1) * attrs.get("dilation", 1)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x = randn(total, c, scale=0.5)  # [T, C]; small enough that fp16 outputs stay below ~2
    w = randn(c, 1, k, scale=k ** -0.5)  # [C, 1, K]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # [B+1]
    bias = randn(c, scale=0.5) if d["bias"] else None
    if d["state"] == "zeros":
        state = torch.zeros(b, c, state_len, dtype=dtype)
    else:
        state = randn(b, c, state_len, scale=0.5)  # [B, C, L]
    capture = (torch.tensor(d["capture"], dtype=torch.int32) if "capture" in d else None)  # [B]
    return [x, w, cu, bias, state, capture, None, None], attrs
