"""Fast CPU ``com.microsoft.GatedDeltaNet``: chunked WY/UT prefill + blocked recurrent decode.

Same contract, signature and validation (``gated_delta_net`` is the ``torch`` implementation
registered with ``pagedhybrid.ops.gated_delta_net.SPEC``; ``validate_call``), same operands
(the contract's ``prepare``: L2 norm, fused softplus/qwen or sigmoid/kda gate and sigmoid beta,
with torch's vectorised functions over all tokens), a different compute order. Everything runs
in float32 (float64 for double inputs); outputs are cast back to the input type, the state stays
float32. A capturing call (``state_update_capacity > 0``) gets the contract's ``state_update``
appended by ``with_capture`` (its few captured tokens rerun exactly, ORT's bits).

State layout: ``[B, Hv, Dv, Dk]`` (V-major, as the contract), updated in place in a working
buffer (or in the caller's pool rows, ``forward(..., state_rows=slots)``); it is never
transposed.

Sequences are split by length:

* length 1 (decode): one recurrent step for all of them at once. With ``a = exp(g)``:
  ``[r, y] = S [a*k, a*q]`` (one batched GEMV pass over the state), ``u = beta (v - r)``,
  ``S <- a S + u k^T`` (in place: ``mul_`` + ``addcmul_``), ``o = scale (y + u (k.q))``. The
  state rows are processed in blocks of ~``DECODE_BLOCK_BYTES`` so the three passes over a block
  hit the cache and DRAM sees about one read and one write of the state.
* length > 1 (prefill / chunked prefill): chunks of C tokens (``chunk_size``, default 64; 16 with
  per-key decay). Sequences are sorted by chunk count, so chunk ``j`` of every sequence that has
  one is a prefix ``[:n_j]`` of the sorted batch: one Python iteration per chunk position (never
  per token), all sequences and heads batched. Within a chunk (cumulative log-decay ``G``,
  ``Dec_ij = exp(G_i - G_j)`` for ``j <= i``):
      L = strict_tril(beta_i (k_i.k_j) Dec_ij);  (I + L) [U | W] = [beta v | beta exp(G) k]
      V' = U - W S^T                            (delta rules; V' = v otherwise)
      O  = scale ((exp(G) q) S^T + tril((q.k) Dec) V')
      S <- exp(G_C) S + V'^T (exp(G_C - G) k)
  The triangular system is solved with ``torch.linalg.solve_triangular(unitriangular=True)``.
  Padding tokens (past a sequence's end) get k = v = q = 0, g = 0, beta = 0 and change nothing.
  Token rows move with ``index_select`` / ``index_copy_`` (whole-row copies) only.
* length 0: the state passes through.

GQA: query/key heads are shared by ``Hv / Hk`` value heads; Gram matrices are computed per key
head and broadcast, only the per-value-head operands are expanded.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, NamedTuple

import torch

from pagedhybrid.kernels.registry import OpCoverage
from pagedhybrid.ops.gated_delta_net import (
    _DELTA,
    _GATED,
    SPEC,
    GdnDims,
    prepare,
    validate_call,
    with_capture,
)
from pagedhybrid.ops.spec import BoundCall

__all__ = ["COVERAGE", "compute", "forward", "gated_delta_net"]

CHUNK = 64
CHUNK_PER_KEY = 16  # per-key decay materialises [C, C, Dk] decay tensors per head
DECODE_BLOCK_BYTES = 2 << 20
GROUP_TOKENS = 1024  # chunk tokens whose state-independent operands are precomputed at once

COVERAGE = OpCoverage(
    op="com.microsoft.GatedDeltaNet",
    dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
    features=("update_rule:linear", "update_rule:gated", "update_rule:delta",
              "update_rule:gated_delta", "decay:per_head", "decay:per_key",
              "gate:none", "gate:softplus/qwen", "gate:sigmoid/kda", "beta:sigmoid",
              "qk_l2_norm", "gqa", "layout:separate", "layout:rank4", "layout:packed_qkv",
              "varlen", "zero_length_sequences", "in_place_state_pool",
              "state_update_capture"),
    delegated={},
    paths={"decode": "sequences of length 1: one blocked recurrent step, state in place",
           "chunked": "sequences of length > 1: WY/UT chunks (C=64, 16 with per-key decay), "
                      "one Python iteration per chunk position"},
)


# -- public API ----------------------------------------------------------------------------------
@SPEC.implement("torch")
def gated_delta_net(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Fast ``GatedDeltaNet``: returns ``(output, final_state [B, Hv, Dv, Dk])`` (new tensors),
    and the contract's ``state_update`` when the call captures."""
    d = validate_call(call)
    return with_capture(compute(call, d), call.inputs, d)


def compute(call: BoundCall, d: GdnDims) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path on a validated call (``d = validate_call(call)``)."""
    initial_state = call.inputs[6]
    q, k, v, g, b = prepare(d, call.inputs)  # [T, Hk, Dk] x2, [T, Hv, Dv], g, beta
    shape = (d.batch, d.num_heads_v, d.head_size_v, d.head_size_qk)
    state = (initial_state.to(d.compute_dtype, copy=True) if initial_state is not None
             else torch.zeros(shape, dtype=d.compute_dtype))  # [B, Hv, Dv, Dk] working copy
    o = forward(q, k, v, g, b, state, d.cu_seqlens, d.attrs["update_rule"], d.scale,
                d.attrs["chunk_size"])
    return o.reshape(d.output_shape).to(d.dtype), state.to(d.state_dtype)


# -- compute -------------------------------------------------------------------------------------
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
            beta: torch.Tensor | None, state: torch.Tensor, cu_seqlens: tuple[int, ...],
            rule: str, scale: float, chunk_size: int = CHUNK,
            state_rows: torch.Tensor | None = None,
            emit: dict[int, list[tuple[int, torch.Tensor]]] | None = None) -> torch.Tensor:
    """Run the recurrence on prepared inputs, updating ``state`` in place.

    q, k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]``, g ``[T, Hv]`` / ``[T, Hv, Dk]`` (log-space) or None,
    beta ``[T, Hv]`` or None, all of the compute dtype. ``state`` ``[P, Hv, Dv, Dk]``: sequence
    b owns row ``state_rows[b]`` (default: row b). Returns o ``[T, Hv, Dv]``.

    ``emit`` (state checkpoints inside a chunk): sequence b -> [(offset, target)]: the state after
    b's first ``offset`` tokens (0 < offset < its length) is copied into ``target``
    ``[Hv, Dv, Dk]`` as the chunked form passes it. The sequence's chunks are phase-shifted so a
    chunk ends at each offset (leading padding tokens change nothing); the offsets of a sequence
    must be a multiple of the chunk size apart, which is cut to their gcd with it.
    """
    t, hv, dv = v.shape
    o = torch.empty(t, hv, dv, dtype=v.dtype)  # [T, Hv, Dv]; every token is written
    cu = torch.tensor(cu_seqlens, dtype=torch.long)  # [B+1]
    lens = cu[1:] - cu[:-1]  # [B]
    srows = torch.arange(len(lens)) if state_rows is None else state_rows.long()  # [B]
    single = torch.nonzero(lens == 1).flatten()  # [n1]
    multi = torch.nonzero(lens > 1).flatten()  # [nm]
    if single.numel():
        _decode(q, k, v, g, beta, state, srows[single], cu[single], rule, scale, o)
    if multi.numel():
        per_key = g is not None and g.dim() == 3
        c = max(1, min(int(chunk_size), 256))
        c = min(c, CHUNK_PER_KEY) if per_key else c
        emit = emit or {}
        for targets in emit.values():  # chunk ends must fall on every offset of a sequence
            for a, b in pairwise(sorted(off for off, _ in targets)):
                c = math.gcd(c, b - a)
        phase = torch.tensor([(-min(off for off, _ in emit[int(b)])) % c if int(b) in emit
                              else 0 for b in multi])  # [nm] leading padding per sequence
        nc = (lens[multi] + phase + c - 1) // c  # [nm]
        order = torch.sort(nc, descending=True, stable=True).indices
        seqs = multi[order]  # [nm], most chunks first
        marks = {}  # (chunk step, sorted position) -> targets
        for pos, b in enumerate(seqs.tolist()):
            for off, target in emit.get(b, ()):
                step = (int(phase[order[pos]]) + off) // c - 1
                marks.setdefault((step, pos), []).append(target)
        _with_rows(state, srows[seqs], lambda s: _chunked(
            q, k, v, g, beta, s, cu[seqs], lens[seqs], rule, scale, c, o, phase[order], marks))
    return o


def _with_rows(state: torch.Tensor, rows: torch.Tensor, fn: Any) -> None:
    """Run ``fn`` on ``state[rows]`` in place: a view when the rows are a range, else a copy."""
    n = rows.numel()
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + n)):
        fn(state[first: first + n])  # contiguous rows: work directly in the buffer
    else:
        work = state.index_select(0, rows)  # [n, Hv, Dv, Dk]
        fn(work)
        state.index_copy_(0, rows, work)


def _expand_heads(x: torch.Tensor, hv: int, dim: int = -2) -> torch.Tensor:
    """Repeat the key-head axis ``dim`` (Hk) to Hv: key head ``h // (Hv/Hk)`` feeds value head h."""
    dim = dim % x.dim()
    hk = x.shape[dim]
    if hk == hv:
        return x
    shape = list(x.shape)
    e = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], hv // hk, *shape[dim + 1:])
    return e.reshape(*shape[:dim], hv, *shape[dim + 1:])


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
            beta: torch.Tensor | None, state: torch.Tensor, srows: torch.Tensor,
            rows: torch.Tensor, rule: str, scale: float, o: torch.Tensor) -> None:
    """One recurrent step for n single-token sequences (token ``rows [n]``), in place on the
    state rows ``srows [n]`` of ``state [P, Hv, Dv, Dk]``. Blocks of (sequence, head) rows are
    gathered, updated and scattered back while cache-resident (views when the rows are a range).
    """
    n, (_, hv, dv, dk) = rows.numel(), state.shape
    m = n * hv
    qt = _expand_heads(q[rows], hv).reshape(m, dk)  # [n*Hv, Dk]
    kt = _expand_heads(k[rows], hv).reshape(m, dk)  # [n*Hv, Dk]
    vt = v[rows].reshape(m, dv)  # [n*Hv, Dv]
    gated, delta = rule in _GATED, rule in _DELTA
    per_key = gated and g is not None and g.dim() == 3
    a = None
    if gated:
        assert g is not None
        a = torch.exp(g[rows]).reshape(m, dk) if per_key else torch.exp(g[rows]).reshape(m)
    bt = beta[rows].reshape(m, 1) if delta and beta is not None else None  # [n*Hv, 1]
    kq = torch.stack([kt * a, qt * a] if per_key else [kt, qt], dim=1)  # [n*Hv, 2, Dk]
    qk = (qt * kt).sum(-1, keepdim=True)  # [n*Hv, 1]
    pool = state.view(-1, dv, dk)  # [P*Hv, Dv, Dk]
    sidx = (srows[:, None] * hv + torch.arange(hv)).flatten()  # [n*Hv] pool row per (seq, head)
    first = int(sidx[0])
    ranged = torch.equal(sidx, torch.arange(first, first + m))
    out = o.view(o.shape[0], hv * dv)
    blk = max(1, DECODE_BLOCK_BYTES // (dv * dk * state.element_size()))
    ys = []
    for r0 in range(0, m, blk):
        r1 = min(m, r0 + blk)
        sb = pool[first + r0: first + r1] if ranged else pool.index_select(0, sidx[r0:r1])
        ry = torch.bmm(kq[r0:r1], sb.transpose(1, 2))  # [mb, 2, Dv]: S k, S q (one pass)
        r, y = ry[:, 0], ry[:, 1]  # [mb, Dv]
        if gated and not per_key:
            assert a is not None
            ab = a[r0:r1, None]  # [mb, 1]
            r, y = r * ab, y * ab
        u = bt[r0:r1] * (vt[r0:r1] - r) if delta and bt is not None else vt[r0:r1]  # [mb, Dv]
        if gated:
            assert a is not None
            sb.mul_(a[r0:r1, None, :] if per_key else a[r0:r1, None, None])
        sb.addcmul_(u[:, :, None], kt[r0:r1, None, :])  # S += u k^T
        if not ranged:
            pool.index_copy_(0, sidx[r0:r1], sb)
        ys.append(y + u * qk[r0:r1])  # [mb, Dv]
    y_all = torch.cat(ys) if len(ys) > 1 else ys[0]  # [n*Hv, Dv]
    out.index_copy_(0, rows, (scale * y_all).reshape(n, hv * dv))


class _Chunks(NamedTuple):
    """State-independent per-chunk operands of a group of chunks (batch ``N*Hv``)."""

    qa: torch.Tensor  # [N*Hv, C, Dk]  scale * exp(G) * q
    qk: torch.Tensor  # [N*Hv, C, C]   scale * tril((q.k) Dec)
    u: torch.Tensor  # [N*Hv, C, Dv]   T beta v (delta rules) or v
    w: torch.Tensor | None  # [N*Hv, C, Dk]  T beta exp(G) k (delta rules)
    kd: torch.Tensor  # [N*Hv, C, Dk]  exp(G_C - G) k
    s_decay: torch.Tensor | None  # [N*Hv, 1, 1] or [N*Hv, 1, Dk]  exp(G_C)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
             beta: torch.Tensor | None, s: torch.Tensor, starts: torch.Tensor,
             lens: torch.Tensor, rule: str, scale: float, c: int, o: torch.Tensor,
             phase: torch.Tensor | None = None,
             marks: dict[tuple[int, int], list[torch.Tensor]] | None = None) -> None:
    """Chunked WY/UT form for sequences sorted by chunk count (descending); ``s`` in place.

    ``phase`` ``[nseq]``: leading padding tokens per sequence (its chunks then end at
    ``phase + j*c``); ``marks``: (chunk step, sorted position) -> targets that receive that
    sequence's state right after the step (state checkpoints).

    Chunk ids are ordered by (chunk position j, sequence), so the chunks of step j are one
    contiguous id range and their sequences the prefix ``s[:n_j]``. Groups of consecutive steps
    (about ``GROUP_TOKENS`` chunk tokens) get their state-independent operands precomputed in
    one batch; the sequential part per step is four batched GEMMs and one scaling of the state.
    """
    _, hv, dv, dk = s.shape
    t = k.shape[0]
    phase = torch.zeros_like(lens) if phase is None else phase
    marks = marks or {}
    nc = (lens + phase + c - 1) // c  # [nseq], descending
    max_nc = int(nc[0])
    active = (nc[None, :] > torch.arange(max_nc)[:, None]).sum(1).tolist()  # n_j per step
    offs = [0, *torch.tensor(active).cumsum(0).tolist()]  # chunk-id range of each step
    jj = torch.repeat_interleave(torch.arange(max_nc), torch.tensor(active))  # [NC] step
    bb = torch.arange(offs[-1]) - torch.tensor(offs[:-1])[jj]  # [NC] sequence (sorted pos)
    pos = jj[:, None] * c + torch.arange(c)[None, :] - phase[bb][:, None]  # [NC, C] local
    valid_all = (pos >= 0) & (pos < lens[bb][:, None])  # [NC, C]
    rows_all = torch.where(valid_all, starts[bb][:, None] + pos, 0)  # [NC, C]; pads -> row 0
    out = o.view(t, hv * dv)
    j0 = 0
    while j0 < max_nc:
        j1 = j0 + 1
        while j1 < max_nc and (offs[j1 + 1] - offs[j0]) * c <= GROUP_TOKENS:
            j1 += 1
        lo, hi = offs[j0], offs[j1]
        rows, valid = rows_all[lo:hi], valid_all[lo:hi]  # [N, C]
        ch = _intra(q, k, v, g, beta, rows, None if bool(valid.all()) else valid, rule, scale,
                    hv)
        oc = torch.empty((hi - lo) * hv, c, dv, dtype=v.dtype)  # [N*Hv, C, Dv]
        for j in range(j0, j1):
            a, b = (offs[j] - lo) * hv, (offs[j + 1] - lo) * hv
            sj = s[: active[j]].view(b - a, dv, dk)  # [n*Hv, Dv, Dk] (prefix of the batch)
            st = sj.transpose(-1, -2)  # [n*Hv, Dk, Dv]
            vnew = (torch.baddbmm(ch.u[a:b], ch.w[a:b], st, alpha=-1.0) if ch.w is not None
                    else ch.u[a:b])  # [n*Hv, C, Dv]  V' = U - W S^T
            torch.bmm(ch.qa[a:b], st, out=oc[a:b])  # inter-chunk: scale exp(G) q S^T
            oc[a:b].baddbmm_(ch.qk[a:b], vnew)  # + intra-chunk
            if ch.s_decay is not None:
                sj.mul_(ch.s_decay[a:b])
            sj.baddbmm_(vnew.transpose(-1, -2), ch.kd[a:b])  # S += V'^T (decayed K)
            for (step, spos), targets in marks.items():
                if step == j:
                    for target in targets:
                        target.copy_(s[spos])
        res = oc.view(hi - lo, hv, c, dv).permute(0, 2, 1, 3).reshape(hi - lo, c, hv * dv)
        flat = res.reshape(-1, hv * dv)  # [N*C, Hv*Dv]
        if bool(valid.all()):
            out.index_copy_(0, rows.flatten(), flat)
        else:
            keep = torch.nonzero(valid.flatten()).flatten()
            out.index_copy_(0, rows.flatten()[keep], flat.index_select(0, keep))
        j0 = j1


def _intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
           beta: torch.Tensor | None, rows: torch.Tensor, valid: torch.Tensor | None, rule: str,
           scale: float, hv: int) -> _Chunks:
    """Precompute the state-independent operands of the chunks whose token rows are ``rows``.

    ``valid`` (bool ``[N, C]``, None = all) marks real tokens; padding gets q = k = v = 0,
    g = 0 and beta = 0, so it changes neither the outputs nor the state.
    """
    n, c = rows.shape
    gated, delta = rule in _GATED, rule in _DELTA
    flat_rows = rows.flatten()
    qz, kz, vz, gz, bz = (_take(x, flat_rows, valid, n, c) for x in (q, k, v, g, beta))
    assert qz is not None and kz is not None and vz is not None
    qh = qz.permute(0, 2, 1, 3).contiguous()  # [N, Hk, C, Dk]
    kh = kz.permute(0, 2, 1, 3).contiguous()  # [N, Hk, C, Dk]
    vh = vz.permute(0, 2, 1, 3).contiguous()  # [N, Hv, C, Dv]
    hk, dk = qh.shape[1], qh.shape[3]
    r = hv // hk
    incl = torch.ones(c, c, dtype=torch.bool).tril()  # [C, C]  j <= i
    qk_k = qh @ kh.transpose(-1, -2)  # [N, Hk, C, C]
    kk_k = kh @ kh.transpose(-1, -2) if delta else None  # [N, Hk, C, C]
    b = bz.permute(0, 2, 1) if delta and bz is not None else None  # [N, Hv, C]
    s_decay = None
    if gated and g is not None and g.dim() == 3:  # per-key decay: [C, C, Dk] decay tensors
        qk, kk, qa, kd, ea, kea, s_decay = _per_key_decay(qh, kh, gz, b, incl, delta, scale,
                                                          n, hv, dk)
    elif gated and gz is not None:  # per-head decay
        qk, kk, qa, kd, ea, kea, s_decay = _per_head_decay(qh, kh, qk_k, kk_k, gz, b, incl,
                                                           scale, n, hk, r, hv)
    else:  # no decay
        mask = incl.to(qh.dtype) * scale  # [C, C]
        qk = _expand_heads(qk_k, hv, 1) * mask  # [N, Hv, C, C]
        kk = _expand_heads(kk_k, hv, 1) * b[..., :, None] if kk_k is not None and \
            b is not None else None
        qa = _expand_heads(qh, hv, 1) * scale  # [N, Hv, C, Dk]
        kd = _expand_heads(kh, hv, 1)  # [N, Hv, C, Dk]
        ea = kea = None
    w = None
    if delta:
        assert kk is not None and b is not None
        u, w = _delta_operands(kk, b, vh, kh, ea, kea, incl, qh.dtype, gated, n, hk, r, hv)
    else:
        u = vh
    return _Chunks(qa.reshape(n * hv, c, dk), qk.reshape(n * hv, c, c),
                   u.reshape(n * hv, c, -1), w, kd.reshape(n * hv, c, dk), s_decay)


def _take(x: torch.Tensor | None, flat_rows: torch.Tensor, valid: torch.Tensor | None, n: int,
          c: int) -> torch.Tensor | None:
    """Row gather ``[N, C, ...]`` (whole-row copies), padding zeroed."""
    if x is None:
        return None
    y = x.index_select(0, flat_rows).view(n, c, *x.shape[1:])
    if valid is not None:
        y.mul_(valid.view(n, c, *([1] * (x.dim() - 1))).to(y.dtype))
    return y


def _per_v(x: torch.Tensor, f: torch.Tensor, n: int, hk: int, r: int, hv: int) -> torch.Tensor:
    """x ``[N, Hk, ...]`` broadcast to value heads times f ``[N, Hv, ...]``."""
    fv = f.reshape(n, hk, r, *f.shape[2:])
    return (x.unsqueeze(2) * fv).reshape(n, hv, *torch.broadcast_shapes(
        x.shape[2:], f.shape[2:]))


def _per_key_decay(qh: torch.Tensor, kh: torch.Tensor, gz: torch.Tensor, b: torch.Tensor | None,
                   incl: torch.Tensor, delta: bool, scale: float, n: int, hv: int,
                   dk: int) -> tuple[Any, ...]:
    """Chunk operands under per-key decay (``[C, C, Dk]`` decay tensors, value-head operands):
    ``(qk, kk, qa, kd, ea, kea, s_decay)``."""
    gcum = torch.cumsum(gz, dim=1).permute(0, 2, 1, 3)  # [N, Hv, C, Dk]
    diff = gcum[:, :, :, None, :] - gcum[:, :, None, :, :]  # [N, Hv, C, C, Dk]
    dec = torch.exp(diff.masked_fill(~incl[:, :, None], float("-inf")))
    qe, ke = _expand_heads(qh, hv, 1), _expand_heads(kh, hv, 1)  # [N, Hv, C, Dk]
    qk = torch.einsum("nhid,nhjd,nhijd->nhij", qe, ke, dec) * scale  # [N, Hv, C, C]
    kk = (torch.einsum("nhid,nhjd,nhijd->nhij", ke, ke, dec) * b[..., :, None]
          if delta and b is not None else None)  # [N, Hv, C, C]
    ea = torch.exp(gcum)  # [N, Hv, C, Dk]
    qa, kea = qe * (ea * scale), ke * ea
    kd = ke * torch.exp(gcum[:, :, -1:, :] - gcum)  # [N, Hv, C, Dk]
    s_decay = torch.exp(gcum[:, :, -1, :]).reshape(n * hv, 1, dk)
    return qk, kk, qa, kd, ea, kea, s_decay


def _per_head_decay(qh: torch.Tensor, kh: torch.Tensor, qk_k: torch.Tensor,
                    kk_k: torch.Tensor | None, gz: torch.Tensor, b: torch.Tensor | None,
                    incl: torch.Tensor, scale: float, n: int, hk: int, r: int,
                    hv: int) -> tuple[Any, ...]:
    """Chunk operands under per-head decay (key-head Gram matrices broadcast to value heads):
    ``(qk, kk, qa, kd, ea, kea, s_decay)``."""
    gcum = torch.cumsum(gz, dim=1).permute(0, 2, 1).contiguous()  # [N, Hv, C]
    diff = gcum[..., :, None] - gcum[..., None, :]  # [N, Hv, C, C]
    dec = torch.exp(diff.masked_fill(~incl, float("-inf")))  # lower incl. diagonal
    qk = _per_v(qk_k, dec * scale, n, hk, r, hv)  # [N, Hv, C, C]
    kk = _per_v(kk_k, dec * b[..., :, None], n, hk, r, hv) if kk_k is not None and \
        b is not None else None
    ea = torch.exp(gcum)  # [N, Hv, C]
    qa = _per_v(qh, (ea * scale)[..., None], n, hk, r, hv)  # [N, Hv, C, Dk]
    kd = _per_v(kh, torch.exp(gcum[..., -1:] - gcum)[..., None], n, hk, r, hv)  # [N, Hv, C, Dk]
    kea = None
    s_decay = torch.exp(gcum[..., -1]).reshape(n * hv, 1, 1)
    return qk, kk, qa, kd, ea, kea, s_decay


def _delta_operands(kk: torch.Tensor, b: torch.Tensor, vh: torch.Tensor, kh: torch.Tensor,
                    ea: torch.Tensor | None, kea: torch.Tensor | None, incl: torch.Tensor,
                    dtype: torch.dtype, gated: bool, n: int, hk: int, r: int,
                    hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Delta rules: solve ``(I + L) [U | W] = [beta v | beta exp(G) k]`` (L = ``kk``'s strict
    lower triangle, ``incl`` the mask ``j <= i``); returns ``(u, w)``, w as ``[N*Hv, C, Dk]``."""
    c, dk = incl.shape[0], kh.shape[3]
    if not gated:
        kk = kk.masked_fill(~incl, 0.0)
    eye = torch.eye(c, dtype=dtype).expand(n, hv, c, c)
    tinv = torch.linalg.solve_triangular(kk, eye, upper=False, unitriangular=True)
    u = (tinv * b[..., None, :]) @ vh  # [N, Hv, C, Dv]  T diag(beta) V
    if kea is not None:  # per-key decay: T diag(beta) (exp(G) * K), value-head operands
        w = (tinv * b[..., None, :]) @ kea  # [N, Hv, C, Dk]
    else:
        tk = tinv * (b if ea is None else b * ea)[..., None, :]  # [N, Hv, C, C]
        w = (tk.reshape(n, hk, r * c, c) @ kh).reshape(n, hv, c, dk)  # GQA w/o copies
    return u, w.reshape(n * hv, c, dk)
