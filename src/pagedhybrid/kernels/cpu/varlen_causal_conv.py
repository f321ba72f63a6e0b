"""Fast CPU ``com.microsoft.VarlenCausalConvWithState``: shifted multiply-adds over the stream.

Same contract, signature and validation as ``pagedhybrid.ops.varlen_causal_conv`` (the ``torch``
implementation registered with ``SPEC.implement``; ``validate_call``); a different compute order.
State layout: ``[B, C, L]`` channels-first, ``L = (K-1)*dilation``.

Algorithm. The packed input ``x [T, C]`` is treated as ONE stream: for every row ``i`` and tap
``j`` the shifted row ``i - (K-1-j)*dilation`` is multiplied by ``weight[:, 0, j]`` and added
(``addcmul_`` on row slices, no gather, no ``[T, K, C]`` window). Rows are processed in blocks of
``ROW_BLOCK`` so the taps, the bias and the activation of a block run while it is in cache.
That is exact for every row whose receptive field lies inside its own sequence, i.e. local
position ``p >= L``. The few rows with ``p < L`` (at most ``B*L``; every row for decode) read the
carried state or would cross into the previous sequence: they are recomputed from an explicit
``[R, K, C]`` window that takes negative positions from ``initial_state``. The final state is
gathered the same way (local positions ``n_b - L .. n_b - 1``). Arithmetic in float32 (float64 for
double inputs); outputs in the input dtype.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.registry import OpCoverage
from pagedhybrid.ops.spec import BoundCall
from pagedhybrid.ops.varlen_causal_conv import SPEC, ConvDims, validate_call, with_capture

__all__ = ["COVERAGE", "compute", "varlen_causal_conv"]

ROW_BLOCK = 256

COVERAGE = OpCoverage(
    op="com.microsoft.VarlenCausalConvWithState",
    dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
    features=("activation:none", "activation:silu/swish", "bias", "dilation", "kernel_size>=1",
              "varlen", "initial_state_none_as_zeros", "state_update_capture"),
    delegated={},
    paths={"stream": "rows with local position >= (K-1)*dilation: blocked shifted addcmul",
           "boundary": "rows with local position < (K-1)*dilation (all decode rows): explicit "
                       "window over [state; tokens]"},
)


@SPEC.implement("torch")
def varlen_causal_conv(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Fast ``VarlenCausalConvWithState``: ``(output [T, C], final_state [B, C, L])``, and the
    contract's ``state_update`` when the call captures."""
    input, weight, _cu, bias, initial_state = call.inputs[:5]
    d = validate_call(call)
    return with_capture(compute(input, weight, bias, initial_state, d), input, d)


def compute(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            initial_state: torch.Tensor | None, d: ConvDims
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv of a validated call (``d = validate_call(call)``)."""
    ct, t, c, k, dil, sl = (d.compute_dtype, d.total_tokens, d.channels, d.kernel_size,
                            d.dilation, d.state_len)
    x = input if input.dtype == ct else input.to(ct)  # [T, C]
    wt = weight.to(ct)[:, 0, :].t().contiguous()  # [K, C]
    bz = bias.to(ct) if bias is not None else None  # [C]
    silu = d.attrs["activation"] in ("silu", "swish")
    if t == d.batch and sl > 0 and initial_state is not None:
        return _decode(x, wt, bz, initial_state.to(ct), d, silu)
    y = torch.empty(t, c, dtype=ct)  # [T, C]

    cu = torch.tensor(d.cu_seqlens, dtype=torch.long)  # [B+1]
    lens = cu[1:] - cu[:-1]  # [B]
    # 1. the whole stream, as if it were one sequence (rows near boundaries fixed in step 2);
    #    skipped when every row is a boundary row (decode)
    for r0 in range(0, t if int(lens.max()) > sl else 0, ROW_BLOCK):
        r1 = min(t, r0 + ROW_BLOCK)
        yb = y[r0:r1]  # [rb, C]
        torch.mul(x[r0:r1], wt[k - 1], out=yb)
        for j in range(k - 1):
            s = (k - 1 - j) * dil
            a = max(r0, s)
            if a < r1:
                yb[a - r0:].addcmul_(x[a - s: r1 - s], wt[j])
        if bz is not None:
            yb.add_(bz)
        if silu:
            torch.nn.functional.silu(yb, inplace=True)

    # 2. rows whose window reaches before their sequence's first token: explicit window
    state_rows = (initial_state.to(ct).permute(0, 2, 1).reshape(d.batch * sl, c)
                  if initial_state is not None and sl > 0
                  else torch.zeros(d.batch * sl, c, dtype=ct))  # [B*L, C]
    if sl > 0:
        nfix = torch.clamp(lens, max=sl)  # [B] rows per sequence to recompute
        seq = torch.repeat_interleave(torch.arange(d.batch), nfix)  # [R]
        local = torch.arange(int(nfix.sum())) - torch.repeat_interleave(
            torch.cumsum(nfix, 0) - nfix, nfix)  # [R] local position p < L
        taps = (torch.arange(k) - (k - 1)) * dil  # [K], <= 0
        win = window(x, state_rows, cu, seq, local[:, None] + taps[None, :], sl)  # [R, K, C]
        yf = win[:, 0] * wt[0]  # [R, C]
        for j in range(1, k):
            yf.addcmul_(win[:, j], wt[j])
        if bz is not None:
            yf = yf + bz
        if silu:
            yf = torch.nn.functional.silu(yf)
        y[cu[seq] + local] = yf

    # 3. final state: local positions n_b - L .. n_b - 1 (negative ones from the state)
    if sl > 0:
        tail = lens[:, None] + (torch.arange(sl) - sl)[None, :]  # [B, L]
        rows = window(x, state_rows, cu, torch.arange(d.batch), tail, sl)  # [B, L, C]
        final = rows.permute(0, 2, 1).contiguous()  # [B, C, L]
    else:
        final = torch.zeros(d.batch, c, 0, dtype=ct)
    return y.to(d.dtype), final.to(d.dtype)


def _decode(x: torch.Tensor, wt: torch.Tensor, bz: torch.Tensor | None, state: torch.Tensor,
            d: ConvDims, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: tap j reads state column ``j*dilation`` (the last tap the token).

    ``x [B, C]``, ``wt [K, C]``, ``state [B, C, L]``; the new state drops the oldest column.
    """
    k, dil = d.kernel_size, d.dilation
    y = x * wt[k - 1]  # [B, C]
    for j in range(k - 1):
        y.addcmul_(state[:, :, j * dil], wt[j])  # column j*dilation of the state  [B, C]
    if bz is not None:
        y.add_(bz)
    if silu:
        torch.nn.functional.silu(y, inplace=True)
    final = torch.cat([state[:, :, 1:], x[:, :, None]], dim=2)  # [B, C, L]
    return y.to(d.dtype), final.to(d.dtype)


def window(x: torch.Tensor, state_rows: torch.Tensor, cu: torch.Tensor, seq: torch.Tensor,
            pos: torch.Tensor, sl: int) -> torch.Tensor:
    """Rows at local positions ``pos [R, W]`` of sequences ``seq [R]`` -> ``[R, W, C]``;
    negative positions read the carried state (``state_rows`` ``[B*L, C]``). Row copies only
    (``index_select`` / ``index_copy_``), no element-wise gather."""
    r, w = pos.shape
    flat = pos.flatten()  # [R*W]
    fseq = seq.repeat_interleave(w)  # [R*W]
    out = torch.empty(r * w, x.shape[1], dtype=x.dtype)
    inside = flat >= 0
    ix, istate = torch.nonzero(inside).flatten(), torch.nonzero(~inside).flatten()
    if ix.numel():
        out.index_copy_(0, ix, x.index_select(0, cu[fseq[ix]] + flat[ix]))
    if istate.numel():
        out.index_copy_(0, istate, state_rows.index_select(0, fseq[istate] * sl + sl +
                                                           flat[istate]))
    return out.view(r, w, -1)
