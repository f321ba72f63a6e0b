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
* ``'softplus'`` (alias ``'qwen'``): g = -exp(a_log) * softplus(decay + dt_bias).
* ``'sigmoid'`` (alias ``'kda'``): g = gate_lower_bound * sigmoid(exp(a_log) * (decay + dt_bias)).
* ``beta_activation='sigmoid'``: beta = sigmoid(beta).
* ``qk_l2_norm=1``: x <- x * rsqrt(sum(x^2) + 1e-12) per q/k head (ORT's eps is 1e-12, measured;
  HF's ``l2norm`` uses 1e-6).

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
Unsupported (UnsupportedConfiguration): compact state updates (``state_update_capacity > 0``,
``capture_count``, ``state_update_active``). ``chunk_size`` is a tuning hint with no effect on
results. Deviation: ``qk_l2_norm`` must be 0 or 1 (ORT treats any non-zero value as 1).

Calling convention: ``gated_delta_net`` and ``validate`` take ``SPEC.signature()`` (the 11 inputs
in ORT order, then the attributes keyword-only); ``validate_call`` works on the ``BoundCall`` that
``SPEC.bind`` makes of it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from pagedhybrid.dtypes import describe
from pagedhybrid.ops._gated_delta_net_recipes import (  # re-exported
    _DELTA,
    _GATED,
    conformance_recipes,
    make_inputs,
)
from pagedhybrid.ops.spec import (
    Attribute,
    BoundCall,
    OpSpec,
    Port,
    TypeConstraint,
    check_cu_seqlens,
    check_shape,
)

__all__ = ["SPEC", "GdnDims", "conformance_recipes", "gated_delta_net", "make_inputs",
           "output_shapes", "recurrent", "validate", "validate_call"]

L2_NORM_EPS = 1e-12  # ORT CPU 1.32 (measured: x * rsqrt(sum x^2 + 1e-12))
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
        Port("capture_count", "TI", optional=True, ranks=(1,), shape="[B]", supported=False),
        Port("state_update_active", "TI", optional=True, ranks=(1,), shape="[1]",
             supported=False),
    ),
    outputs=(
        Port("output", "T", shape="[T, Hv, Dv] | [B, S, Hv, Dv]"),
        Port("final_state", "TS", optional=True, shape="[B, Hv, Dv, Dk]"),
        Port("state_update", "TS", optional=True, shape="[B, C*(decay_width + Hk*Dk + Hv*Dv)]",
             supported=False),
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
        Attribute("state_update_capacity", "int", 0, choices=(0,),
                  unsupported=tuple(range(1, 9))),
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


def validate_call(call: BoundCall) -> GdnDims:
    """Check every port and attribute against ORT's rules and derive the dimensions."""
    chk = SPEC.check
    SPEC.check_inputs(call.inputs)
    (query, key, value, cu_seqlens, decay, beta, initial_state, a_log,
     dt_bias) = call.inputs[:9]
    a = call.attrs
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

    # -- layout and head geometry
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

    # -- packing
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

    # -- gates
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

    out_shape = (*lead, hv, dv)
    scale = a["scale"] if a["scale"] != 0.0 else 1.0 / math.sqrt(dk)
    return GdnDims(packed, token_rank, total, batch, hq, hv, dk, dv, per_key, tuple(cu),
                   out_shape, query.dtype, state_dtype, state_dtype, scale, a)


validate = SPEC.define(validate_call, "validate")  # the same check, called like the op


def output_shapes(*inputs: torch.Tensor | None, **attrs: Any
                  ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of ``output`` and ``final_state``."""
    d = validate(*inputs, **attrs)
    return ((d.output_shape, d.dtype),
            ((d.batch, d.num_heads_v, d.head_size_v, d.head_size_qk), d.state_dtype))


def _gates(d: GdnDims, decay: torch.Tensor | None, beta: torch.Tensor | None,
           a_log: torch.Tensor | None, dt_bias: torch.Tensor | None
           ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Effective log-decay g ``[T, Hv(, Dk)]`` and update rate beta ``[T, Hv]``."""
    ct, hv, dk, t = d.compute_dtype, d.num_heads_v, d.head_size_qk, d.total_tokens
    g = None
    if decay is not None:
        g = decay.to(ct).reshape(t, hv, dk) if d.per_key_decay else decay.to(ct).reshape(t, hv)
        act = d.attrs["gate_activation"]
        if act != "none":
            dt = dt_bias.to(ct)
            if d.per_key_decay:
                dt = dt.reshape(hv, dk) if dt.numel() == hv * dk else dt[:, None]  # [Hv, Dk|1]
            rate = torch.exp(a_log.to(ct))  # [Hv]
            rate = rate[:, None] if d.per_key_decay else rate
            x = g + dt  # [T, Hv(, Dk)]
            if act in ("softplus", "qwen"):
                g = -rate * torch.nn.functional.softplus(x)
            else:
                g = d.attrs["gate_lower_bound"] * torch.sigmoid(rate * x)
    b = None
    if beta is not None:
        b = beta.to(ct).reshape(t, hv)
        if d.attrs["beta_activation"] == "sigmoid":
            b = torch.sigmoid(b)
    return g, b


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
              beta: torch.Tensor | None, state: torch.Tensor, cu_seqlens: tuple[int, ...],
              rule: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence on already-activated inputs, all of the compute dtype.

    q, k ``[T, Hv, Dk]`` (heads already repeated to Hv), v ``[T, Hv, Dv]``, g ``[T, Hv]`` or
    ``[T, Hv, Dk]`` (log-space) or None, beta ``[T, Hv]`` or None, state ``[B, Hv, Dv, Dk]``.
    Steps all sequences together, one local position at a time. Returns (o ``[T, Hv, Dv]``,
    final state ``[B, Hv, Dv, Dk]``).
    """
    starts = torch.tensor(cu_seqlens[:-1])  # [B]
    lens = torch.tensor(cu_seqlens[1:]) - starts  # [B]
    s = state.transpose(-1, -2).clone()  # [B, Hv, Dk, Dv] (K-major while computing)
    out = torch.zeros_like(v)  # [T, Hv, Dv]
    for step in range(int(lens.max()) if len(lens) else 0):
        active = lens > step  # [B]
        idx = torch.where(active, starts + step, 0)  # [B]
        kt, vt = k[idx], v[idx]  # [B, Hv, Dk], [B, Hv, Dv]
        new = s
        if rule in _GATED:
            gt = torch.exp(g[idx])  # [B, Hv] or [B, Hv, Dk]
            new = new * (gt[..., None, None] if gt.dim() == 2 else gt[..., None])
        if rule in _DELTA:
            r = torch.einsum("bhkv,bhk->bhv", new, kt)  # [B, Hv, Dv]
            u = beta[idx][..., None] * (vt - r)  # [B, Hv, Dv]
        else:
            u = vt
        new = new + kt[..., :, None] * u[..., None, :]  # [B, Hv, Dk, Dv]
        o = scale * torch.einsum("bhkv,bhk->bhv", new, q[idx])  # [B, Hv, Dv]
        s = torch.where(active[:, None, None, None], new, s)
        out[idx[active]] = o[active]
    return out, s.transpose(-1, -2).contiguous()


@SPEC.implement("reference")
def gated_delta_net(call: BoundCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``GatedDeltaNet``: returns ``(output, final_state [B, Hv, Dv, Dk])``."""
    d = validate_call(call)
    query, key, value, _cu, decay, beta, initial_state, a_log, dt_bias = call.inputs[:9]
    ct, t = d.compute_dtype, d.total_tokens
    hq, hv, dk, dv = d.num_heads_qk, d.num_heads_v, d.head_size_qk, d.head_size_v
    if d.packed_qkv:
        flat = query.reshape(t, -1).to(ct)  # [T, W]
        q, k, v = flat.split([hq * dk, hq * dk, hv * dv], dim=-1)
    else:
        q, k, v = (x.reshape(t, -1).to(ct) for x in (query, key, value))
    q, k, v = q.reshape(t, hq, dk), k.reshape(t, hq, dk), v.reshape(t, hv, dv)
    if d.attrs["qk_l2_norm"]:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_NORM_EPS)
    q = q.repeat_interleave(hv // hq, dim=1)  # [T, Hv, Dk]
    k = k.repeat_interleave(hv // hq, dim=1)  # [T, Hv, Dk]
    g, b = _gates(d, decay, beta, a_log, dt_bias)
    s0 = (initial_state.to(ct) if initial_state is not None
          else torch.zeros(d.batch, hv, dv, dk, dtype=ct))
    o, s = recurrent(q, k, v, g, b, s0, d.cu_seqlens, d.attrs["update_rule"], d.scale)
    return o.reshape(d.output_shape).to(d.dtype), s.to(d.state_dtype)
