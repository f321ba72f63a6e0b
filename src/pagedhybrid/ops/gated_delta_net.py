"""``com.microsoft.GatedDeltaNet``: packed (varlen) gated delta rule with an explicit FP32 state.

Algorithm (the per-token recurrence; ONNX Runtime 1.32 semantics, checked by running its CPU
kernel). Per value head h (key/query head ``hk = h // (Hv/Hk)``, inverse GQA via
repeat_interleave) with the state ``S`` of size ``[Dk x Dv]``:

    S <- exp(g_t) * S              gated rules; per-key-dim decay scales row d by exp(g_t[d])
    r  = S^T k_t                   delta rules (retrieval from the decayed state)
    u  = beta_t * (v_t - r)        delta rules;  u = v_t for 'linear' / 'gated' (no beta)
    S <- S + k_t u^T
    o_t = scale * S^T q_t          scale = 1/sqrt(Dk) when the attribute is 0

``update_rule``: 'linear' (no decay, no retrieval), 'gated' (decay only), 'delta' (retrieval
only), 'gated_delta' (both). ``decay`` is present exactly for the gated rules and ``beta`` exactly
for the delta rules (ORT rejects anything else).

Gates, in float32 whatever the input type (the ``decay`` input is log-space):
* ``gate_activation='none'``: g = decay.
* ``'softplus'`` (alias ``'qwen'``): g = -exp(a_log) * softplus(decay + dt_bias), softplus(x) =
  log1p(exp(x)) (x for x > 20).
* ``'sigmoid'`` (alias ``'kda'``): g = gate_lower_bound * sigmoid(exp(a_log) * (decay + dt_bias)).
* ``beta_activation='sigmoid'``: beta = sigmoid(beta), as 1/(1+e) for x >= 0 and e/(1+e) below,
  e = exp(-|x|).
* ``qk_l2_norm=1``: x <- x * rsqrt(sum(x^2) + eps) per q/k head; ORT's eps is 1e-12, but 1e-6
  with the sigmoid/kda gate (both measured; HF's ``l2norm`` uses 1e-6).

Float32 arithmetic (ORT's CPU kernel, matched bit for bit by ``reference``, checked by running
it): exp and log1p are the C library's ``expf`` / ``log1pf`` (``pagedhybrid.ops.libm``); sums over
Dk (sum x^2, S^T k, S^T q) run left to right; every product and sum is rounded on its own (no
fused multiply-add): ``S <- (exp(g) * S) + (k u^T)``. The fast kernels use torch's vectorised
forms and agree within rounding.

Layouts (head counts come from shapes, not attributes):
* separate, rank 3: query/key ``[T, Hk, Dk]`` (Hq == Hk), value ``[T, Hv, Dv]``; decay ``[T, Hv]``
  or ``[T, Hv, Dk]``; beta ``[T, Hv]``; output ``[T, Hv, Dv]``.
* separate, rank 4: ``[B, S, H, D]`` (uniform packing; ``cu_seqlens`` must be absent); decay /
  beta get the same ``[B, S]`` prefix; output ``[B, S, Hv, Dv]``.
* packed QKV: key and value absent, query ``[T, 2*Hk*Dk + Hv*Dv]`` (or ``[B, S, ...]``) split in
  the order q, k, v; Hv, Dv, Dk come from ``initial_state`` (then required) and
  ``Hk = (W - Hv*Dv) / (2*Dk)``.
* ``cu_seqlens`` int32 ``[B+1]``, non-decreasing from 0 to T; zero-length sequences are allowed
  (their state passes through). Absent: uniform packing with B from ``initial_state`` (rank 3 /
  packed rank 2) or from the leading axis (rank 4 / packed rank 3).

State layout: ``initial_state`` / ``final_state`` are ``[B, Hv, Dv, Dk]`` (V-major, the transpose
of HF's ``[B, Hv, Dk, Dv]``), float32 always; ``initial_state=None`` means zeros.
``a_log`` is ``[Hv]``; ``dt_bias`` is ``[Hv]`` or, with per-key-dim decay, ``[Hv, Dk]`` /
``[Hv*Dk]``; both float32, required with a fused gate and forbidden without one.

Types: T (q/k/v, output) float / float16 / bfloat16; TG (decay, beta) float or T's type; TS
(state, a_log, dt_bias) float. Extension: ``double`` for everything (then TS is double too), for
tests. The reference computes in float32 (float64 for double inputs) and casts the output back.
``chunk_size`` is a tuning hint with no effect on results. Deviation: ``qk_l2_norm`` must be 0 or
1 (ORT treats any non-zero value as 1).

Compact state updates (ONNX Runtime 1.32's CPU kernel, checked by running it):
``state_update_capacity`` C in [0, 8]; ``capture_count`` (int32 ``[B]``) is given exactly when
C > 0; ``state_update_active`` (int32 ``[1]``, optional) = [0] captures nothing (absent: on).
Sequence b captures its first ``n_b = clamp(capture_count[b], 0, min(C, len_b))`` tokens into
row b of the third output ``state_update [B, C*(W + Hk*Dk + Hv*Dv)]`` (TS), three sections
each C slots long, slot t of a section at ``t * width``, slots from n_b on zero:
``[decay exp(g_t): C x W | key k_t (L2-normalised when asked, not scaled): C x Hk*Dk |
delta u_t: C x Hv*Dv]``, W = Hv, or Hv*Dk with per-key-dim decay. For the rules without decay
exp(g) is 1, for those without retrieval u = v. ``output`` and ``final_state`` are those of the
call without capture. ``replay_state`` rebuilds the state after the first j_b <= n_b tokens from
``initial_state`` and ``state_update`` by the recurrence's own update, token by token:
``S <- (decay * S) + (k u^T)`` (value head h reading key head h // (Hv/Hk)), so it equals, bit
for bit, the ``final_state`` of a call on those tokens alone (speculative decoding keeps an
accepted prefix of a verified draft without storing a state per token).

Calling convention: ``gated_delta_net`` and ``validate`` take ``SPEC.signature()`` (the 11 inputs
in ORT order, then the attributes keyword-only); ``validate_call`` works on the ``BoundCall`` that
``SPEC.bind`` makes of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any, NamedTuple

import torch

from pagedhybrid.dtypes import describe
from pagedhybrid.errors import ContractViolation
from pagedhybrid.ops import libm
from pagedhybrid.ops._gated_delta_net_recipes import (  # re-exported
    _DELTA,
    _GATED,
    conformance_recipes,
    make_inputs,
)
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

__all__ = ["SPEC", "GdnDims", "conformance_recipes", "gated_delta_net", "make_inputs",
           "output_shapes", "prepare", "recurrent", "replay_state", "state_update",
           "validate", "validate_call", "with_capture"]

L2_NORM_EPS = 1e-12  # ORT CPU 1.32 (measured: x * rsqrt(sum x^2 + 1e-12))
L2_NORM_EPS_SIGMOID_GATE = 1e-6  # ... but this with gate_activation sigmoid / kda (measured)
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it (any bound in [16, 88] rounds alike)
_T = ("float", "float16", "bfloat16")
_FUSED_GATES = ("softplus", "qwen", "sigmoid", "kda")

SPEC = OpSpec(
    domain="com.microsoft",
    name="GatedDeltaNet",
    version=1,
    inputs=(
        Port("query", "T", ranks=(2, 3, 4),
             shape="[T, Hq, Dk] | [B, S, Hq, Dk] | packed [T, 2*Hq*Dk + Hv*Dv] | [B, S, W]"),
        Port("key", "T", optional=True, ranks=(3, 4), shape="[T, Hk, Dk] | [B, S, Hk, Dk]"),
        Port("value", "T", optional=True, ranks=(3, 4), shape="[T, Hv, Dv] | [B, S, Hv, Dv]"),
        Port("cu_seqlens", "TI", optional=True, ranks=(1,), shape="[B+1]",
             doc="non-decreasing prefix sums; absent = uniform packing"),
        Port("decay", "TG", optional=True, ranks=(2, 3, 4),
             shape="[...tokens, Hv] | [...tokens, Hv, Dk]", doc="log-space decay"),
        Port("beta", "TG", optional=True, ranks=(2, 3), shape="[...tokens, Hv]"),
        Port("initial_state", "TS", optional=True, ranks=(4,), shape="[B, Hv, Dv, Dk]",
             doc="V-major float32 state; None means zeros"),
        Port("a_log", "TS", optional=True, ranks=(1,), shape="[Hv]"),
        Port("dt_bias", "TS", optional=True, ranks=(1, 2), shape="[Hv] | [Hv, Dk] | [Hv*Dk]"),
        Port("capture_count", "TI", optional=True, ranks=(1,), shape="[B]",
             doc="tokens to capture per sequence; given exactly when state_update_capacity > 0"),
        Port("state_update_active", "TI", optional=True, ranks=(1,), shape="[1]",
             doc="[0] captures nothing; absent means capture"),
    ),
    outputs=(
        Port("output", "T", shape="[T, Hv, Dv] | [B, S, Hv, Dv]"),
        Port("final_state", "TS", optional=True, shape="[B, Hv, Dv, Dk]"),
        Port("state_update", "TS", optional=True, shape="[B, C*(decay_width + Hk*Dk + Hv*Dv)]",
             doc="the captured tokens' decay, key and delta (present when "
                 "state_update_capacity > 0)"),
    ),
    attributes=(
        Attribute("update_rule", "string", "gated_delta",
                  choices=("linear", "gated", "delta", "gated_delta")),
        Attribute("gate_activation", "string", "none", choices=("none", *_FUSED_GATES)),
        Attribute("beta_activation", "string", "none", choices=("none", "sigmoid")),
        Attribute("qk_l2_norm", "int", 0, choices=(0, 1)),
        Attribute("scale", "float", 0.0, doc="0 means 1/sqrt(Dk)"),
        Attribute("gate_lower_bound", "float", -5.0, doc="finite and negative; sigmoid gate"),
        Attribute("chunk_size", "int", 64, doc="tuning hint, positive"),
        Attribute("state_update_capacity", "int", 0,
                  choices=tuple(range(MAX_STATE_UPDATE_CAPACITY + 1)),
                  doc="compact state-update capture: tokens per sequence, [0, 8]"),
    ),
    type_constraints=(
        TypeConstraint("T", _T, extension=("double",)),
        TypeConstraint("TS", ("float",), extension=("double",)),
        TypeConstraint("TG", _T, extension=("double",)),
        TypeConstraint("TI", ("int32",)),
    ),
    doc=__doc__ or "",
)


class GdnDims(NamedTuple):
    """Derived dimensions of one validated call."""

    packed_qkv: bool
    token_rank: int  # 1: [T, ...] spelling; 2: [B, S, ...] spelling
    total_tokens: int
    batch: int
    num_heads_qk: int  # Hq == Hk
    num_heads_v: int
    head_size_qk: int
    head_size_v: int
    per_key_decay: bool
    cu_seqlens: tuple[int, ...]  # [B+1] host copy (uniform packing filled in)
    output_shape: tuple[int, ...]
    dtype: torch.dtype  # T: query/key/value/output
    compute_dtype: torch.dtype  # float32, float64 for double inputs
    state_dtype: torch.dtype  # float32, float64 for double inputs
    scale: float  # effective scale
    attrs: dict[str, Any]  # resolved attributes
    captured: tuple[int, ...] = ()  # n_b: tokens captured per sequence (empty: no capture)

    @property
    def capacity(self) -> int:
        return int(self.attrs["state_update_capacity"])

    @property
    def decay_width(self) -> int:
        """W, a captured token's decay values: Hv, or Hv*Dk with per-key-dim decay."""
        return self.num_heads_v * (self.head_size_qk if self.per_key_decay else 1)


def validate_call(call: BoundCall) -> GdnDims:
    """Check every port and attribute against ORT's rules and derive the dimensions."""
    SPEC.check_inputs(call.inputs)
    (query, key, value, cu_seqlens, decay, beta, initial_state, a_log,
     dt_bias) = call.inputs[:9]
    a = call.attrs
    state_dtype = _check_dtypes(a, query, decay, beta, initial_state, a_log, dt_bias)
    packed, hq, hv, dk, dv, lead, token_rank, total = _check_geometry(query, key, value,
                                                                       initial_state)
    batch, cu = _check_packing(cu_seqlens, initial_state, query, lead, token_rank, total, hv, dv,
                               dk)
    per_key = _check_gates(a, decay, beta, a_log, dt_bias, lead, hv, dk)
    capture_count, active = call.inputs[9:11]
    captured = _check_state_updates(a, capture_count, active, batch, cu)

    out_shape = (*lead, hv, dv)
    scale = a["scale"] if a["scale"] != 0.0 else 1.0 / math.sqrt(dk)
    return GdnDims(packed, token_rank, total, batch, hq, hv, dk, dv, per_key, tuple(cu),
                   out_shape, query.dtype, state_dtype, state_dtype, scale, a, captured)


def _check_dtypes(a: dict[str, Any], query: torch.Tensor, decay: torch.Tensor | None,
                  beta: torch.Tensor | None, initial_state: torch.Tensor | None,
                  a_log: torch.Tensor | None, dt_bias: torch.Tensor | None) -> torch.dtype:
    """The numeric attributes (gate lower bound, chunk size) and the float ports' element
    types; returns the state dtype (float32, float64 with double inputs)."""
    chk = SPEC.check
    glb = a["gate_lower_bound"]
    chk(math.isfinite(glb) and glb < 0, "gate_lower_bound", "must be finite and negative", glb)
    chk(0 < a["chunk_size"] <= 2**31 - 1, "chunk_size", "must be positive and fit in int32",
        a["chunk_size"])
    wide = query.dtype == torch.float64
    state_dtype = torch.float64 if wide else torch.float32
    for name, t in (("initial_state", initial_state), ("a_log", a_log), ("dt_bias", dt_bias)):
        chk(t is None or t.dtype == state_dtype, name,
            f"must be {'double (double extension)' if wide else 'float'}",
            None if t is None else describe(t.dtype))
    for name, t in (("decay", decay), ("beta", beta)):
        chk(t is None or t.dtype in (torch.float32, query.dtype), name,
            "must be float or the query element type",
            None if t is None else describe(t.dtype))
    return state_dtype


def _check_geometry(query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                    initial_state: torch.Tensor | None
                    ) -> tuple[bool, int, int, int, int, tuple[int, ...], int, int]:
    """Layout (separate or packed QKV) and head geometry; returns ``(packed, Hq, Hv, Dk, Dv,
    token axes, token rank, total tokens)``."""
    chk = SPEC.check
    chk((key is None) == (value is None), "value" if value is None else "key",
        "key and value must both be present or both be absent (absent = packed QKV)", "one")
    packed = key is None
    if packed:
        chk(query.dim() in (2, 3), "query",
            "packed QKV (key/value absent) must be rank 2 [T, W] or 3 [B, S, W]", query.dim())
        chk(initial_state is not None, "initial_state",
            "is required for packed QKV (it gives Hv, Dv and Dk)", None)
        hv, dv, dk = (int(x) for x in initial_state.shape[1:])
        chk(min(hv, dv, dk) > 0, "initial_state", "must have positive Hv, Dv, Dk",
            list(initial_state.shape))
        width = int(query.shape[-1])
        rest = width - hv * dv
        chk(rest > 0 and rest % (2 * dk) == 0, "query",
            f"packed QKV last dimension must be 2*Hq*Dk + Hv*Dv with Hq >= 1 (Hv={hv}, "
            f"Dv={dv}, Dk={dk} from initial_state)", width)
        hq = rest // (2 * dk)
        lead = tuple(query.shape[:-1])
    else:
        chk(query.dim() in (3, 4), "query",
            "must be rank 3 [T, Hq, Dk] or 4 [B, S, Hq, Dk] when key/value are given "
            "(rank 2 means packed QKV)", query.dim())
        for name, t in (("key", key), ("value", value)):
            chk(t.dim() == query.dim(), name, "must have the same rank as query", t.dim())
            chk(t.shape[:-2] == query.shape[:-2], name,
                "must agree with query on the token axes", list(t.shape))
        hq, dk = int(query.shape[-2]), int(query.shape[-1])
        chk(int(key.shape[-1]) == dk, "key", f"head_size must equal query's ({dk})",
            list(key.shape))
        chk(int(key.shape[-2]) == hq, "key", f"num_heads_k must equal num_heads_q ({hq})",
            list(key.shape))
        hv, dv = int(value.shape[-2]), int(value.shape[-1])
        chk(min(hq, dk, hv, dv) > 0, "value", "head counts and head sizes must be positive",
            [list(query.shape), list(value.shape)])
        lead = tuple(query.shape[:-2])
    chk(hv % hq == 0, "query" if packed else "value",
        f"num_heads_v ({hv}) must be a positive multiple of num_heads_q ({hq})", hv)
    token_rank = len(lead)
    total = math.prod(lead)
    chk(total > 0, "query", "must hold at least one token", list(query.shape))
    return packed, hq, hv, dk, dv, lead, token_rank, total


def _check_packing(cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None,
                   query: torch.Tensor, lead: tuple[int, ...], token_rank: int, total: int,
                   hv: int, dv: int, dk: int) -> tuple[int, list[int]]:
    """Sequence packing (``cu_seqlens``, ``[B, S, ...]`` or uniform) and the state's shape;
    returns ``(batch, cu_seqlens)``."""
    chk = SPEC.check
    if cu_seqlens is not None:
        chk(token_rank == 1, "cu_seqlens",
            "describes ragged packing, so query must use the [T, ...] spelling (rank 3, or "
            "rank 2 packed)", list(query.shape))
        cu = check_cu_seqlens(SPEC, "cu_seqlens", cu_seqlens, total)
        batch = len(cu) - 1
    else:
        if token_rank == 2:
            batch = lead[0]
        else:
            chk(initial_state is not None, "initial_state",
                "is required when cu_seqlens is absent and query is [T, ...] (it gives B)", None)
            batch = int(initial_state.shape[0])
            chk(batch > 0 and total % batch == 0, "initial_state",
                f"batch size must divide total_tokens ({total}) for uniform packing", batch)
        step = total // batch
        cu = [i * step for i in range(batch + 1)]
    if initial_state is not None:
        check_shape(SPEC, "initial_state", initial_state, [batch, hv, dv, dk],
                    "[B, Hv, Dv, Dk] (V-major)")
    return batch, cu


def _check_gates(a: dict[str, Any], decay: torch.Tensor | None, beta: torch.Tensor | None,
                 a_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                 lead: tuple[int, ...], hv: int, dk: int) -> bool:
    """``decay``/``beta`` against the update rule, ``a_log``/``dt_bias`` against the gate
    activation; returns whether the decay is per key dimension."""
    chk = SPEC.check
    rule = a["update_rule"]
    for name, t, need in (("decay", decay, rule in _GATED), ("beta", beta, rule in _DELTA)):
        chk((t is not None) == need, name,
            f"is {'required' if need else 'forbidden'} for update_rule='{rule}'",
            "present" if t is not None else "absent")
    per_key = False
    if decay is not None:
        per_key = decay.shape == (*lead, hv, dk)
        chk(per_key or decay.shape == (*lead, hv), "decay",
            f"must be {[*lead, hv]} (per head) or {[*lead, hv, dk]} (per key dim)",
            list(decay.shape))
    if beta is not None:
        check_shape(SPEC, "beta", beta, [*lead, hv], "[...tokens, Hv]")
    fused = a["gate_activation"] in _FUSED_GATES
    for name, t in (("a_log", a_log), ("dt_bias", dt_bias)):
        if fused:
            chk(t is not None, name,
                f"is required for gate_activation='{a['gate_activation']}'", None)
        else:
            chk(t is None, name, "requires gate_activation softplus/qwen or sigmoid/kda",
                "present")
    if fused:
        check_shape(SPEC, "a_log", a_log, [hv], "[Hv]")
        ok = dt_bias.shape == (hv,) or (per_key and dt_bias.shape in ((hv, dk), (hv * dk,)))
        chk(ok, "dt_bias",
            f"must be [{hv}]" + (f", [{hv}, {dk}] or [{hv * dk}]" if per_key else
                                 " (the [Hv, Dk] forms need per-key-dim decay)"),
            list(dt_bias.shape))
    return per_key


def _check_state_updates(a: dict[str, Any], capture_count: torch.Tensor | None,
                         active: torch.Tensor | None, batch: int,
                         cu: list[int]) -> tuple[int, ...]:
    """Compact state updates: ``capture_count``/``state_update_active`` against
    ``state_update_capacity``; returns the captured token count of each sequence."""
    chk = SPEC.check
    cap = a["state_update_capacity"]
    chk((capture_count is not None) == (cap > 0), "capture_count",
        "must be given exactly when state_update_capacity > 0",
        f"state_update_capacity={cap}, capture_count "
        f"{'given' if capture_count is not None else 'absent'}")
    if active is not None:
        check_shape(SPEC, "state_update_active", active, [1], "[1]")
    captured: tuple[int, ...] = ()
    if capture_count is not None:
        check_shape(SPEC, "capture_count", capture_count, [batch], "[B]")
        on = active is None or int(active[0]) != 0
        captured = tuple(max(0, min(int(n), cap, hi - lo)) if on else 0
                         for n, (lo, hi) in zip(capture_count.tolist(), pairwise(cu), strict=True))
    return captured


validate = SPEC.define(validate_call, "validate")  # the same check, called like the op


def output_shapes(*inputs: torch.Tensor | None, **attrs: Any
                  ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of ``output``, ``final_state`` and, when capturing, ``state_update``."""
    d = validate(*inputs, **attrs)
    row = d.capacity * (d.decay_width + d.num_heads_qk * d.head_size_qk
                        + d.num_heads_v * d.head_size_v)
    return ((d.output_shape, d.dtype),
            ((d.batch, d.num_heads_v, d.head_size_v, d.head_size_qk), d.state_dtype),
            *([((d.batch, row), d.state_dtype)] if d.capacity else []))


def _sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis left to right, each addition rounded (ORT's CPU loops)."""
    acc = x[..., 0]
    for j in range(1, x.shape[-1]):
        acc = acc + x[..., j]
    return acc


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """ORT's float32 sigmoid: 1/(1+e) for x >= 0, e/(1+e) below, e = expf(-|x|)."""
    e = libm.expf(-x.abs())
    return torch.where(x >= 0, 1 / (1 + e), e / (1 + e))


def prepare(d: GdnDims, inputs: Sequence[torch.Tensor | None], exact: bool = False,
            rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                       torch.Tensor | None]:
    """The recurrence's operands for token ``rows`` (int64 ``[n]``; all T tokens when None), in
    the compute dtype: q, k ``[n, Hk, Dk]`` (L2-normalised when asked), v ``[n, Hv, Dv]``, the
    effective log-decay g ``[n, Hv(, Dk)]`` and the update rate beta ``[n, Hv]`` (activated).

    ``exact``: ORT's float32 arithmetic bit for bit (libm's expf / log1pf, sums in order; slow,
    module docstring); otherwise torch's vectorised functions.
    """
    query, key, value, _cu, decay, beta, _state, a_log, dt_bias = inputs[:9]
    ct, t = d.compute_dtype, d.total_tokens
    hq, hv, dk, dv = d.num_heads_qk, d.num_heads_v, d.head_size_qk, d.head_size_v

    def tokens(x: torch.Tensor, *shape: int) -> torch.Tensor:
        x = x.reshape(t, *shape)  # [T, *shape]
        return (x if rows is None else x[rows]).to(ct)

    if d.packed_qkv:
        q, k, v = tokens(query, -1).split([hq * dk, hq * dk, hv * dv], dim=-1)
    else:
        assert key is not None and value is not None
        q, k, v = tokens(query, -1), tokens(key, -1), tokens(value, -1)
    q, k, v = q.reshape(-1, hq, dk), k.reshape(-1, hq, dk), v.reshape(-1, hv, dv)
    a = d.attrs
    if a["qk_l2_norm"]:
        eps = L2_NORM_EPS_SIGMOID_GATE if a["gate_activation"] in ("sigmoid", "kda") \
            else L2_NORM_EPS
        total = _sum_in_order if exact else (lambda x: x.sum(-1))
        q = q * torch.rsqrt(total(q * q) + eps)[..., None]  # [n, Hk, Dk]
        k = k * torch.rsqrt(total(k * k) + eps)[..., None]  # [n, Hk, Dk]
    exp = libm.expf if exact else torch.exp
    sigmoid = _sigmoid if exact else torch.sigmoid
    g = None if decay is None else tokens(decay, hv, dk) if d.per_key_decay else tokens(decay, hv)
    if g is not None and a["gate_activation"] != "none":
        dt = dt_bias.to(ct)
        if d.per_key_decay:
            dt = dt.reshape(hv, dk) if dt.numel() == hv * dk else dt[:, None]  # [Hv, Dk|1]
        rate = exp(a_log.to(ct))  # [Hv]
        rate = rate[:, None] if d.per_key_decay else rate
        x = g + dt  # [n, Hv(, Dk)]
        if a["gate_activation"] in ("softplus", "qwen"):
            soft = (torch.where(x > SOFTPLUS_THRESHOLD, x, libm.log1pf(libm.expf(x))) if exact
                    else torch.nn.functional.softplus(x, threshold=SOFTPLUS_THRESHOLD))
            g = -rate * soft
        else:
            g = a["gate_lower_bound"] * sigmoid(rate * x)
    b = None if beta is None else tokens(beta, hv)
    if b is not None and a["beta_activation"] == "sigmoid":
        b = sigmoid(b)
    return q, k, v, g, b


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor | None,
              beta: torch.Tensor | None, state: torch.Tensor, cu_seqlens: Sequence[int],
              scale: float, deltas: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence on prepared inputs of the compute dtype, in ORT's order of
    operations (module docstring): given ORT's gates, ORT's float32 results bit for bit.

    q, k ``[T, Hv, Dk]`` (heads already repeated to Hv), v ``[T, Hv, Dv]``, decay ``[T, Hv]`` or
    ``[T, Hv, Dk]`` (the multiplier exp(g); None: no decay), beta ``[T, Hv]`` (None: no
    retrieval, u = v), state ``[B, Hv, Dv, Dk]``. Steps all sequences together, one local
    position at a time. ``deltas`` ``[T, Hv, Dv]``, when given, receives every token's u.
    Returns (o ``[T, Hv, Dv]``, final state ``[B, Hv, Dv, Dk]``).
    """
    starts = torch.tensor(cu_seqlens[:-1])  # [B]
    lens = torch.tensor(cu_seqlens[1:]) - starts  # [B]
    s = state.clone()  # [B, Hv, Dv, Dk]
    out = torch.zeros_like(v)  # [T, Hv, Dv]
    for step in range(int(lens.max()) if len(lens) else 0):
        active = lens > step  # [B]
        idx = torch.where(active, starts + step, 0)  # [B]
        kt = k[idx][:, :, None, :]  # [B, Hv, 1, Dk]
        new = s
        if decay is not None:
            a = decay[idx]  # [B, Hv] or [B, Hv, Dk]
            new = new * (a[..., None, None] if a.dim() == 2 else a[:, :, None, :])
        u = v[idx]  # [B, Hv, Dv]
        if beta is not None:
            u = beta[idx][..., None] * (u - _sum_in_order(new * kt))  # r = S^T k
        new = new + kt * u[..., None]  # [B, Hv, Dv, Dk]
        o = scale * _sum_in_order(new * q[idx][:, :, None, :])  # [B, Hv, Dv]
        s = torch.where(active[:, None, None, None], new, s)
        out[idx[active]] = o[active]
        if deltas is not None:
            deltas[idx[active]] = u[active]
    return out, s


def _run(d: GdnDims, inputs: Sequence[torch.Tensor | None], rows: torch.Tensor | None = None,
         cu_seqlens: Sequence[int] | None = None, deltas: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The exact recurrence over token ``rows`` packed as ``cu_seqlens`` (default: the call's):
    (o ``[n, Hv, Dv]``, final state, the keys ``[n, Hk, Dk]``, the decay multipliers)."""
    q, k, v, g, b = prepare(d, inputs, exact=True, rows=rows)
    r = d.num_heads_v // d.num_heads_qk
    decay = None if g is None else libm.expf(g)
    state = inputs[6]
    s0 = (state.to(d.compute_dtype) if state is not None else torch.zeros(
        d.batch, d.num_heads_v, d.head_size_v, d.head_size_qk, dtype=d.compute_dtype))
    o, s = recurrent(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, decay, b, s0,
                     d.cu_seqlens if cu_seqlens is None else cu_seqlens, d.scale, deltas)
    return o, s, k, decay


def state_update(inputs: Sequence[torch.Tensor | None], d: GdnDims) -> torch.Tensor:
    """``[B, C*(W + Hk*Dk + Hv*Dv)]`` (TS): the capture of the module docstring, each
    sequence's first ``n_b`` tokens run exactly (ORT's bits) from ``initial_state``."""
    hv, hk, dk, dv, c = (d.num_heads_v, d.num_heads_qk, d.head_size_qk, d.head_size_v,
                         d.capacity)
    sections = [torch.zeros(d.batch, c, w, dtype=d.state_dtype)
                for w in (d.decay_width, hk * dk, hv * dv)]  # decay, key, delta: [B, C, w]
    rows = [d.cu_seqlens[b] + j for b, n in enumerate(d.captured) for j in range(n)]
    if rows:
        seq = [b for b, n in enumerate(d.captured) for _ in range(n)]
        slot = [j for n in d.captured for j in range(n)]
        deltas = torch.empty(len(rows), hv, dv, dtype=d.compute_dtype)  # [n, Hv, Dv]
        _, _, k, decay = _run(d, inputs, torch.tensor(rows), (0, *accumulate(d.captured)),
                              deltas)
        decay = torch.ones(len(rows), d.decay_width) if decay is None else decay
        for section, x in zip(sections, (decay, k, deltas), strict=True):
            section[seq, slot] = x.reshape(len(rows), -1).to(d.state_dtype)
    return torch.cat([x.flatten(1) for x in sections], 1)


def with_capture(outputs: tuple[torch.Tensor, torch.Tensor],
                 inputs: Sequence[torch.Tensor | None], d: GdnDims
                 ) -> tuple[torch.Tensor, ...]:
    """``(output, final_state)``, and ``state_update`` when the call captures (C > 0)."""
    return (*outputs, state_update(inputs, d)) if d.capacity else outputs


def replay_state(initial_state: torch.Tensor, state_update: torch.Tensor,
                 accepted: Sequence[int], captured: Sequence[int] | None = None, *,
                 num_heads_k: int, capacity: int, per_key_decay: bool = False) -> torch.Tensor:
    """The recurrent state ``[B, Hv, Dv, Dk]`` after the first ``accepted[b]`` tokens of each
    sequence of a capturing call, from its ``initial_state`` and ``state_update`` (module
    docstring): what a call on those tokens alone leaves, bit for bit. The call's geometry:
    ``num_heads_k`` (Hk), ``capacity`` (C), ``per_key_decay``. ``captured``: the call's ``n_b``
    (when given, each ``accepted[b]`` must be within it)."""
    op = f"{SPEC.qualname}.replay_state"
    if initial_state.dim() != 4:
        raise ContractViolation(op, "initial_state", "must be [B, Hv, Dv, Dk]",
                                list(initial_state.shape))
    b, hv, dv, dk = initial_state.shape
    width = hv * dk if per_key_decay else hv
    if num_heads_k < 1 or hv % num_heads_k:
        raise ContractViolation(op, "num_heads_k", f"must divide Hv={hv}", num_heads_k)
    row = capacity * (width + num_heads_k * dk + hv * dv)
    if tuple(state_update.shape) != (b, row):
        raise ContractViolation(op, "state_update", f"must be [B={b}, C*(W + Hk*Dk + Hv*Dv)="
                                f"{row}]", list(state_update.shape))
    if len(accepted) != b:
        raise ContractViolation(op, "accepted", f"must hold one count per sequence ({b})",
                                list(accepted))
    limits = captured if captured is not None else [capacity] * b
    for i, (j, n) in enumerate(zip(accepted, limits, strict=True)):
        if not 0 <= j <= min(n, capacity):
            raise ContractViolation(op, "accepted", f"[{i}] must be in [0, {min(n, capacity)}] "
                                    "(the tokens that sequence captured)", j)
    u = state_update.to(initial_state.dtype)
    decay, key, delta = u.split([capacity * w for w in (width, num_heads_k * dk, hv * dv)], 1)
    decay = decay.reshape(b, capacity, hv, 1, width // hv)  # [B, C, Hv, 1, 1|Dk]
    key = key.reshape(b, capacity, num_heads_k, 1, dk).repeat_interleave(
        hv // num_heads_k, 2)  # [B, C, Hv, 1, Dk]
    delta = delta.reshape(b, capacity, hv, dv, 1)  # [B, C, Hv, Dv, 1]
    s = initial_state.clone()
    steps = torch.tensor(accepted)  # [B]
    for j in range(max(accepted, default=0)):
        new = s * decay[:, j] + key[:, j] * delta[:, j]  # [B, Hv, Dv, Dk]
        s = torch.where((steps > j)[:, None, None, None], new, s)
    return s


@SPEC.implement("reference")
def gated_delta_net(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Reference ``GatedDeltaNet``: returns ``(output, final_state [B, Hv, Dv, Dk])`` and, when
    ``state_update_capacity > 0``, ``state_update [B, C*(W + Hk*Dk + Hv*Dv)]``; ORT's float32
    results bit for bit (module docstring)."""
    d = validate_call(call)
    o, s, _, _ = _run(d, call.inputs)
    return with_capture((o.reshape(d.output_shape).to(d.dtype), s.to(d.state_dtype)),
                        call.inputs, d)
