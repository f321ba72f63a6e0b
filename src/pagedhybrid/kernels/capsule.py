"""Speculative verify steps: compact state updates captured during the step, committed after.

A verify sequence (``StepMetadata.verify``) brings its last sampled token and ``k`` draft tokens
into one step. Attention writes their K/V into the pages as for any chunk (a rejected token's
rows are simply overwritten later: attention reads a sequence's own length). The linear layers'
fixed states cannot be cut back that way, so for verify sequences the step leaves the state
rows as they were and captures ONNX Runtime 1.32's compact state update per token instead
(``ops.varlen_causal_conv`` / ``ops.gated_delta_net``: the conv's input rows; GDN's decay
``exp(g)``, key and delta ``beta (v - (exp(g) S)^T k)``) into a ``Capsule`` indexed by state
slot. Once the sampler knows how many tokens were accepted, ``commit`` replays exactly those into
the state rows (and emits any prefix-cache checkpoint that falls inside them).

Memory per slot and linear layer: ``C (conv_dim + Hv + Hk Dk + Hv Dv)`` values for a capsule of
``C`` tokens, against ``C Hv Dv Dk`` floats for per-token copies of the recurrent state
(``capsule_bytes`` / ``full_state_bytes``).

The replay reproduces the in-place kernels' rounding (``StateCapture.replay`` of each bundle),
so a committed row is bit for bit what running the accepted tokens in place leaves: the native
kernels round each update as one fused multiply-add after the decay (ORT's own replay,
``ops.gated_delta_net.replay_state``, rounds the product and the sum apart).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pagedhybrid.kernels.cpu.seam import qwen_gates
from pagedhybrid.kernels.step import StepMetadata, int_tensor


class Capsule(NamedTuple):
    """One linear layer's capsules, row ``slot`` per state slot, ``C`` tokens each."""

    conv: torch.Tensor  # [S, C, conv_dim] (model dtype): the conv's input rows
    decay: torch.Tensor  # float32 [S, C, Hv]: exp(g)
    key: torch.Tensor  # float32 [S, C, Hk, Dk]: the (L2-normalised) key
    delta: torch.Tensor  # float32 [S, C, Hv, Dv]: beta (v - (exp(g) S)^T k)

    @classmethod
    def allocate(cls, config: object, num_slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> Capsule:
        c = config
        hv, hk = c.linear_num_value_heads, c.linear_num_key_heads  # type: ignore[attr-defined]
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim  # type: ignore[attr-defined]
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.zeros(num_slots, capacity, c.conv_dim, dtype=dtype,  # type: ignore[attr-defined]
                               device=device),
                   torch.zeros(num_slots, capacity, hv, **f32),  # type: ignore[arg-type]
                   torch.zeros(num_slots, capacity, hk, dk, **f32),  # type: ignore[arg-type]
                   torch.zeros(num_slots, capacity, hv, dv, **f32))  # type: ignore[arg-type]

    @property
    def capacity(self) -> int:
        return int(self.decay.shape[1])


def capsule_bytes(config: object, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of one slot's capsules across the linear layers."""
    c = config
    per = (capacity * c.conv_dim * dtype.itemsize  # type: ignore[attr-defined]
           + 4 * capacity * (c.linear_num_value_heads  # type: ignore[attr-defined]
                             + c.linear_num_key_heads * c.linear_key_head_dim  # type: ignore[attr-defined]
                             + c.linear_num_value_heads * c.linear_value_head_dim))  # type: ignore[attr-defined]
    return per * len(c.linear_attention_layers)  # type: ignore[attr-defined]


def full_state_bytes(config: object, capacity: int) -> int:
    """Bytes of ``capacity`` per-token copies of one slot's recurrent states (the alternative)."""
    c = config
    return (4 * capacity * c.linear_num_value_heads * c.linear_value_head_dim  # type: ignore[attr-defined]
            * c.linear_key_head_dim * len(c.linear_attention_layers))  # type: ignore[attr-defined]


class StateCapture(NamedTuple):
    """A bundle's verify-step kernels for the recurrent state:

    * ``gated_delta(q, k, v, a, b, a_log, dt_bias, pool, meta, scale, capsule)`` -- the step
      seam's ``gated_delta`` for sequences that are all verify sequences: their outputs
      ``[n, Hv, Dv]`` fp32, their pool rows read and left unchanged, every token's decay, key
      and delta written into capsule slot ``j`` (the token's place in its chunk) of the
      sequence's state slot;
    * ``replay(pool, slots int64 [B], capsule, begin int32 [B], end int32 [B])`` -- pool row
      ``slots[b]`` advanced by capsule tokens ``begin[b] .. end[b] - 1``;
    * ``replay_layers`` (optional) -- ``commit`` of every layer in one call (the native bundles:
      ``commit_replay``, the per-layer calls' glue was most of a commit's time).
    """

    gated_delta: Callable[..., torch.Tensor]
    replay: Callable[..., None]
    replay_layers: Callable[..., None] | None = None

    def commit(self, conv_pools: Sequence[torch.Tensor], pools: Sequence[torch.Tensor],
               capsules: Sequence[Capsule], slots: torch.Tensor, begin: torch.Tensor,
               end: torch.Tensor) -> None:
        """Every linear layer's conv and recurrent rows ``slots[b]`` advanced by their capsule
        tokens ``begin[b] .. end[b] - 1`` (``replay_conv`` and ``replay`` layer by layer)."""
        if self.replay_layers is not None:
            self.replay_layers(conv_pools, pools, capsules, slots, begin, end)
            return
        index = conv_replay_index(conv_pools[0].shape[-1], begin, end)  # the same for all
        for conv, pool, caps in zip(conv_pools, pools, capsules, strict=True):
            replay_conv(conv, caps, slots, index)
            self.replay(pool, slots, caps, begin, end)


def _verify_rows(meta: StepMetadata, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """The verify sequences' token rows ``[n]``, their flat capsule rows (``slot * C + j``) and
    their state slots."""

    def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, sub = meta.subset(meta.verify)
        slots = sub.state_slots.tolist()
        flat = [slots[b] * capacity + j for b in range(sub.batch) for j in range(sub.q_lens[b])]
        return rows, int_tensor(flat, torch.int64), sub.state_slots

    return meta.memo(f"verify_rows{capacity}", make)


def causal_conv(conv: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                pool: torch.Tensor, meta: StepMetadata, activation: str,
                checkpoints: torch.Tensor | None, capsule: Capsule | None) -> torch.Tensor:
    """The bundle's ``conv`` over the step; verify sequences' conv rows are kept as they were
    (a copy of ``K-1`` columns each) and their input rows captured."""
    if not meta.verify:
        return conv(x, weight, pool, meta, activation, checkpoints)
    assert capsule is not None, "a verify step needs the layer's capsule"
    rows, flat, slots = _verify_rows(meta, capsule.capacity)
    before = pool.index_select(0, slots)  # [n, C, K-1]
    y = conv(x, weight, pool, meta, activation, checkpoints)
    pool.index_copy_(0, slots, before)
    capsule.conv.view(-1, capsule.conv.shape[-1]).index_copy_(0, flat, x.index_select(0, rows))
    return y


def gated_delta(run: Callable[..., torch.Tensor], capture: StateCapture | None,
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
                meta: StepMetadata, scale: float, checkpoints: torch.Tensor | None,
                capsule: Capsule | None) -> torch.Tensor:
    """The bundle's ``run`` (its ``gated_delta``) for the step's other sequences, its
    ``capture`` for the verify ones."""
    if not meta.verify:
        return run(q, k, v, a, b, a_log, dt_bias, pool, meta, scale, checkpoints)
    assert capture is not None and capsule is not None, "a verify step needs capture kernels"
    out = torch.empty(v.shape, dtype=torch.float32)
    rest = meta.unverified
    if rest:
        rows, sub = meta.subset(rest)
        out.index_copy_(0, rows, run(q[rows], k[rows], v[rows], a[rows], b[rows], a_log,
                                     dt_bias, pool, sub, scale, checkpoints))
    rows, sub = meta.subset(meta.verify)
    out.index_copy_(0, rows, capture.gated_delta(q[rows], k[rows], v[rows], a[rows], b[rows],
                                                 a_log, dt_bias, pool, sub, scale, capsule))
    return out


def conv_replay_index(length: int, begin: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, L]``: where each of a conv row's ``L`` entries comes from after capsule
    tokens ``begin .. end - 1``, in ``[row | capsule]`` (the same for every layer of a round)."""
    p = (end - begin).long()[:, None] + torch.arange(length)  # [B, L]: place in [state | x_b..]
    return torch.where(p < length, p, p + begin.long()[:, None])


def replay_conv(pool: torch.Tensor, capsule: Capsule, slots: torch.Tensor,
                index: torch.Tensor) -> None:
    """Conv rows ``slots`` advanced by the capsule tokens ``conv_replay_index`` says (row
    copies)."""
    state = pool.index_select(0, slots)  # [B, C, L]
    caps = capsule.conv.index_select(0, slots).transpose(1, 2)  # [B, C, cap]
    ext = torch.cat([state, caps], 2)  # [B, C, L + cap]
    pool.index_copy_(0, slots, ext.gather(2, index[:, None, :].expand(-1, ext.shape[1], -1)))


def torch_capture(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                  b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                  pool: torch.Tensor, meta: StepMetadata, scale: float, capsule: Capsule
                  ) -> torch.Tensor:
    """``StateCapture.gated_delta`` in torch: the per-token recurrence on a copy of each
    sequence's row (the update as ``torch_replay`` rounds it)."""
    g, beta = qwen_gates(a, b, a_log, dt_bias)  # [n, Hv]
    decay = g.exp()
    ratio = v.shape[1] // k.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32)
    slots = meta.state_slots.tolist()
    for i, slot in enumerate(slots):
        lo, hi = meta.cu_seqlens[i], meta.cu_seqlens[i + 1]
        s = torch.zeros_like(pool[slot]) if meta.fresh[i] else pool[slot].clone()  # [Hv, Dv, Dk]
        for j, t in enumerate(range(lo, hi)):
            kr = k[t].float().repeat_interleave(ratio, 0)  # [Hv, Dk]
            s = s * decay[t][:, None, None]
            u = beta[t][:, None] * (v[t].float() - (s * kr[:, None, :]).sum(-1))  # [Hv, Dv]
            s = s + u[:, :, None] * kr[:, None, :]
            out[t] = scale * (s * q[t].float().repeat_interleave(ratio, 0)[:, None, :]).sum(-1)
            capsule.decay[slot, j] = decay[t]
            capsule.key[slot, j] = k[t]
            capsule.delta[slot, j] = u
    return out


def torch_replay(pool: torch.Tensor, slots: torch.Tensor, capsule: Capsule, begin: torch.Tensor,
                 end: torch.Tensor) -> None:
    """``StateCapture.replay`` in torch (the update as ``torch_capture`` rounds it)."""
    ratio = capsule.delta.shape[2] // capsule.key.shape[2]
    for slot, lo, hi in zip(slots.tolist(), begin.tolist(), end.tolist(), strict=True):
        s = pool[slot]
        for j in range(lo, hi):
            kr = capsule.key[slot, j].repeat_interleave(ratio, 0)  # [Hv, Dk]
            s = s * capsule.decay[slot, j][:, None, None]
            s = s + capsule.delta[slot, j][:, :, None] * kr[:, None, :]
        pool[slot] = s


def segments(counts: Sequence[int], checkpoints: Sequence[Sequence[tuple[int, int]]]
             ) -> list[tuple[list[int], list[int], list[tuple[int, int]]]]:
    """The commit in rounds: per round, each sequence's (begin, end) and the (sequence,
    checkpoint row) saved after it -- a sequence's tokens split at its checkpoint offsets."""
    cuts = [sorted({o for o, _ in ck if 0 < o < n} | {n}) for n, ck in
            zip(counts, checkpoints, strict=True)]
    done = [0] * len(counts)
    rounds = []
    for r in range(max((len(c) for c in cuts), default=0)):
        begin = list(done)
        end = [c[r] if r < len(c) else d for c, d in zip(cuts, done, strict=True)]
        saves = [(i, row) for i, ck in enumerate(checkpoints) for o, row in ck
                 if o == end[i] and end[i] > begin[i]]
        rounds.append((begin, end, saves))
        done = end
    return rounds
