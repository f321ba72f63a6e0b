"""The packed step of the serving path: ``PackedBatch`` and the paged hybrid cache layout.

One step packs the new tokens of ``B`` sequences back to back (``N`` tokens in all). Full-attention
layers keep K/V in pages of ``block_size`` tokens shared by all sequences (``block_table`` maps a
sequence's logical block ``j`` to a physical page); linear (Gated DeltaNet) layers keep one fixed
conv state and one fixed FP32 recurrent state per sequence, in pools indexed by ``state_slots`` so
that reordering or removing requests never moves state. ``forward_packed`` writes pages and state
slots in place.

Cache layout (``PagedHybridCache``), per layer index:

* full attention: ``key_cache[i]``, ``value_cache[i]`` ``[num_pages, block_size, Hkv, hd]``
  (ONNX Runtime PagedAttention, SEPARATE layout), model dtype;
* linear attention: ``conv_state[i]`` ``[num_slots, conv_dim, K-1]`` (the last K-1 conv inputs,
  channels first), model dtype; ``recurrent_state[i]`` ``[num_slots, Hv, Dv, Dk]`` float32
  (V-major, the transpose of HF's ``[.., Dk, Dv]``).

A sequence with ``past_seqlens == 0`` starts from zero conv/recurrent state whatever its slot
holds (slots are reused without clearing).

Prefix caching adds state-checkpoint pools with the slot pools' row layout, per linear layer:
``checkpoint_conv[i]`` ``[num_checkpoints, conv_dim, K-1]`` and ``checkpoint_recurrent[i]``
``[num_checkpoints, Hv, Dv, Dk]`` (fp32). The layers write a row when the step's metadata asks
for a checkpoint; ``restore_checkpoint(row, slot)`` copies one into a slot (a prefix hit).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import NamedTuple

import torch

from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.capsule import (
    Capsule,
    StateCapture,
    segments,
)
from pagedhybrid.kernels.step import StepMetadata, int_tensor
from pagedhybrid.kvquant import KVScales, dequantize
from pagedhybrid.models.qwen35.config import Qwen35Config

OP = "pagedhybrid.Qwen35.forward_packed"

# PackedBatch field -> graph input name of the exported packed paged model.
ABI_INPUT_NAMES: dict[str, str] = {
    "input_ids": "input_ids",
    "position_ids": "position_ids",
    "block_table": "block_table",
    "cu_seqlens": "cumulative_sequence_lengths",
    "past_seqlens": "past_sequence_lengths",
    "attention_metadata": "attention_metadata",
}


class PackedBatch(NamedTuple):
    """The inputs of one packed, paged step (``B`` sequences, ``N`` new tokens in all).

    ==================  ===============  ==========================================================
    field               dtype / shape    meaning (ABI name)
    ==================  ===============  ==========================================================
    input_ids           int64 [N]        new tokens, sequence after sequence (``input_ids``)
    position_ids        int64 [3, N]     MRoPE planes T/H/W; text: three equal rows
                                         ``past + j`` (``position_ids``)
    cu_seqlens          int32 [B+1]      prefix sums of new-token counts, ``cu[0] = 0``,
                                         ``cu[B] = N`` (``cumulative_sequence_lengths``)
    past_seqlens        int32 [B]        tokens already in the KV pages (``past_sequence_lengths``)
    block_table         int32 [B, M]     physical page of each logical block, ``-1`` = unmapped
                                         (``block_table``)
    state_slots         int32 [B]        row of each sequence in the conv / recurrent state pools
                                         (the export takes states in batch order instead)
    attention_metadata  int32 [3]        ``[max_query_len, max_kv_len, max_kv_len lower bound]``
                        or None          upper bounds on the host (``attention_metadata``)
    ==================  ===============  ==========================================================
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    past_seqlens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    attention_metadata: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def last_token_rows(self) -> torch.Tensor:
        """Rows of each sequence's last new token, ``cu_seqlens[1:] - 1`` (int64 ``[B]``)."""
        return self.cu_seqlens[1:].long() - 1

    @classmethod
    def from_metadata(cls, meta: StepMetadata, input_ids: Sequence[int],
                      device: torch.device | str = "cpu") -> PackedBatch:
        """The ABI view of a validated step: every field but ``input_ids`` is a tensor of
        ``meta`` (no second representation of lengths, positions, table or slots)."""
        top = max(meta.total_lens, default=0)
        return cls(
            input_ids=int_tensor(input_ids, torch.int64, device),
            position_ids=meta.positions.view(1, -1).expand(3, -1),
            cu_seqlens=meta.cu_seqlens_t, past_seqlens=meta.past_t,
            block_table=meta.block_table, state_slots=meta.state_slots.to(torch.int32),
            attention_metadata=int_tensor((max(meta.q_lens, default=0), top, top), torch.int32,
                                          device))

    @classmethod
    def from_sequences(
        cls,
        new_tokens: Sequence[Sequence[int]],
        past_seqlens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        state_slots: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> PackedBatch:
        """Pack text sequences: positions ``past + j`` on all three planes, ``-1``-padded table."""
        b = len(new_tokens)
        if not (len(past_seqlens) == len(block_tables) == len(state_slots) == b):
            raise ContractViolation(OP, "from_sequences", "needs one past length, block-table "
                                    "row and state slot per sequence",
                                    (b, len(past_seqlens), len(block_tables), len(state_slots)))
        lengths = [len(t) for t in new_tokens]
        ids = [int(t) for toks in new_tokens for t in toks]
        pos = [p + j for p, n in zip(past_seqlens, lengths, strict=True) for j in range(n)]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        width = max([len(r) for r in block_tables] + [1])
        table = [list(r) + [-1] * (width - len(r)) for r in block_tables]
        max_q = max(lengths, default=0)
        max_kv = max((p + n for p, n in zip(past_seqlens, lengths, strict=True)), default=0)
        i32 = {"dtype": torch.int32, "device": device}
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            position_ids=torch.tensor(pos, dtype=torch.int64, device=device).view(1, -1)
            .expand(3, -1).contiguous(),
            cu_seqlens=torch.tensor(cu, **i32),
            past_seqlens=torch.tensor(list(past_seqlens), **i32),
            block_table=torch.tensor(table, **i32).view(b, width),
            state_slots=torch.tensor(list(state_slots), **i32),
            attention_metadata=torch.tensor([max_q, max_kv, max_kv], **i32),
        )

    def validate(self, config: Qwen35Config, cache: PagedHybridCache) -> None:
        """Field dtypes/ranks/shapes and token ids (``metadata`` checks lengths, pages and
        slots)."""

        def check(cond: bool, where: str, rule: str, got: object = None) -> None:
            if not cond:
                raise ContractViolation(OP, where, rule, got)

        def tensor(name: str, dtype: torch.dtype, rank: int) -> torch.Tensor:
            t = getattr(self, name)
            check(isinstance(t, torch.Tensor), name, "must be a torch.Tensor", type(t).__name__)
            check(t.dtype == dtype, name, f"must be {dtype}", t.dtype)
            check(t.dim() == rank, name, f"must have rank {rank}", tuple(t.shape))
            return t

        ids = tensor("input_ids", torch.int64, 1)
        n = ids.shape[0]
        pos = tensor("position_ids", torch.int64, 2)
        check(tuple(pos.shape) == (3, n), "position_ids", f"must have shape [3, {n}]",
              list(pos.shape))
        cu = tensor("cu_seqlens", torch.int32, 1)
        b = cu.shape[0] - 1
        check(b >= 1, "cu_seqlens", "must hold at least one sequence [B+1]", list(cu.shape))
        check(tuple(tensor("past_seqlens", torch.int32, 1).shape) == (b,), "past_seqlens",
              f"must have shape [{b}]", list(self.past_seqlens.shape))
        check(tensor("block_table", torch.int32, 2).shape[0] == b, "block_table",
              f"must have {b} rows", list(self.block_table.shape))
        slots = tensor("state_slots", torch.int32, 1)
        check(tuple(slots.shape) == (b,), "state_slots", f"must have shape [{b}]",
              list(slots.shape))
        if self.attention_metadata is not None:
            meta = tensor("attention_metadata", torch.int32, 1)
            check(meta.shape[0] in (2, 3), "attention_metadata", "must have 2 or 3 entries",
                  list(meta.shape))
        if n:
            lo, hi = int(ids.min()), int(ids.max())
            check(lo >= 0 and hi < config.vocab_size, "input_ids",
                  f"must be token ids in [0, {config.vocab_size})", (lo, hi))

    def metadata(self, config: Qwen35Config, cache: PagedHybridCache) -> StepMetadata:
        """Validate the batch and build its step metadata (once per step; every layer reads
        it). Lengths come from ``cu_seqlens``/``past_seqlens``; pages and slots are checked
        against the cache."""
        self.validate(config, cache)
        cu = [int(x) for x in self.cu_seqlens.tolist()]
        if cu[0] != 0 or any(b < a for a, b in pairwise(cu)) or \
                cu[-1] != self.num_tokens:
            raise ContractViolation(OP, "cu_seqlens", f"must rise from 0 to {self.num_tokens}",
                                    cu)
        return StepMetadata.build(
            [b - a for a, b in pairwise(cu)], self.past_seqlens.tolist(),
            self.block_table, self.state_slots.tolist(), block_size=cache.block_size,
            num_pages=cache.num_pages, num_slots=cache.num_slots)


LAZY_ZEROS_BYTES = 1 << 20  # CPU pools from this size on are mapped, not written


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
          ) -> torch.Tensor:
    """A zero tensor; on the CPU a large one lies in anonymous mapped memory, whose pages the
    kernel zeroes when first touched, so a cache of gigabytes costs no time (and no resident
    memory) until sequences use it -- instead of a write of every byte at start-up."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass(frozen=True)
class PagedHybridCache:
    """KV pages of the full-attention layers and state pools of the linear layers."""

    key_cache: dict[int, torch.Tensor]  # layer -> [P, bs, Hkv, hd]
    value_cache: dict[int, torch.Tensor]  # layer -> [P, bs, Hkv, hd]
    conv_state: dict[int, torch.Tensor]  # layer -> [S, conv_dim, K-1]
    recurrent_state: dict[int, torch.Tensor]  # layer -> fp32 [S, Hv, Dv, Dk]
    block_size: int
    num_pages: int
    num_slots: int
    checkpoint_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    checkpoint_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    # quantized pages (int8 / float8e4m3fn): each full layer's K/V scales (pagedhybrid.kvquant)
    kv_scales: dict[int, KVScales] = field(default_factory=dict)
    # speculative decoding: each linear layer's verify-step capsules (kernels/capsule.py)
    capsules: dict[int, Capsule] = field(default_factory=dict)

    @property
    def kv_dtype(self) -> torch.dtype:
        return next(iter(self.key_cache.values())).dtype

    @property
    def num_checkpoints(self) -> int:
        first = next(iter(self.checkpoint_recurrent.values()), None)
        return 0 if first is None else int(first.shape[0])

    def checkpoint_pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if layer not in self.checkpoint_conv:
            return None
        return self.checkpoint_conv[layer], self.checkpoint_recurrent[layer]

    def commit_verified(self, capture: StateCapture, slots: Sequence[int],
                        counts: Sequence[int],
                        checkpoints: Sequence[Sequence[tuple[int, int]]]) -> None:
        """A verify step's commit: state slot ``slots[b]`` of every linear layer advanced by
        the first ``counts[b]`` tokens of its capsule, with checkpoint row ``row`` saved after
        ``offset`` tokens for each ``(offset, row)`` of ``checkpoints[b]``."""
        for begin, end, saves in segments(counts, checkpoints):
            todo = [i for i, (b0, b1) in enumerate(zip(begin, end, strict=True)) if b1 > b0]
            if not todo:
                continue
            sl = int_tensor([slots[i] for i in todo], torch.int64)
            b0 = int_tensor([begin[i] for i in todo], torch.int32)
            b1 = int_tensor([end[i] for i in todo], torch.int32)
            layers = list(self.capsules)
            capture.commit([self.conv_state[i] for i in layers],
                           [self.recurrent_state[i] for i in layers],
                           [self.capsules[i] for i in layers], sl, b0, b1)
            for i, row in saves:
                for layer, conv in self.checkpoint_conv.items():
                    conv[row].copy_(self.conv_state[layer][slots[i]])
                    self.checkpoint_recurrent[layer][row].copy_(
                        self.recurrent_state[layer][slots[i]])

    def restore_checkpoint(self, row: int, slot: int) -> None:
        """Copy checkpoint ``row`` into state slot ``slot`` (every linear layer)."""
        for i, conv in self.checkpoint_conv.items():
            self.conv_state[i][slot].copy_(conv[row])
            self.recurrent_state[i][slot].copy_(self.checkpoint_recurrent[i][row])

    @staticmethod
    def page_shape(config: Qwen35Config, num_pages: int, block_size: int) -> tuple[int, ...]:
        return (num_pages, block_size, config.num_key_value_heads, config.head_dim)

    @staticmethod
    def conv_state_shape(config: Qwen35Config, num_slots: int) -> tuple[int, ...]:
        return (num_slots, config.conv_dim, config.linear_conv_kernel_dim - 1)

    @staticmethod
    def recurrent_state_shape(config: Qwen35Config, num_slots: int) -> tuple[int, ...]:
        return (num_slots, config.linear_num_value_heads, config.linear_value_head_dim,
                config.linear_key_head_dim)

    @classmethod
    def allocate(
        cls,
        config: Qwen35Config,
        *,
        num_pages: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fill: float | None = 0.0,
        generator: torch.Generator | None = None,
        num_checkpoints: int = 0,
        kv_dtype: torch.dtype | None = None,
        kv_scales: dict[int, KVScales] | None = None,
        capsule_capacity: int = 0,
        mtp: bool = False,
    ) -> PagedHybridCache:
        """Allocate pools; ``fill=None`` fills them with random garbage (for tests). KV pages
        are ``kv_dtype`` (default ``dtype``); int8 / float8 pages need every full layer's
        ``kv_scales``; ``capsule_capacity`` > 0 adds verify-step capsules of that many tokens
        per slot (speculative decoding); ``mtp`` adds the MTP head's K/V pool (layer index
        ``num_hidden_layers``, ``dtype`` pages: drafts only, never quantized)."""

        def pool(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            if fill is None:
                return torch.randn(shape, generator=generator, dtype=torch.float32).to(dt).to(
                    device)
            if fill == 0.0:
                return zeros(shape, dt, device)
            return torch.full(shape, fill, dtype=torch.float32, device=device).to(dt)

        full, lin = config.full_attention_layers, config.linear_attention_layers
        kv = cls.page_shape(config, num_pages, block_size)
        kvd = kv_dtype or dtype
        head = {config.num_hidden_layers: dtype} if mtp else {}
        return cls(
            key_cache={**{i: pool(kv, kvd) for i in full},
                       **{i: pool(kv, d) for i, d in head.items()}},
            value_cache={**{i: pool(kv, kvd) for i in full},
                         **{i: pool(kv, d) for i, d in head.items()}},
            conv_state={i: pool(cls.conv_state_shape(config, num_slots), dtype) for i in lin},
            recurrent_state={
                i: pool(cls.recurrent_state_shape(config, num_slots), torch.float32) for i in lin
            },
            block_size=block_size,
            num_pages=num_pages,
            num_slots=num_slots,
            checkpoint_conv={i: pool(cls.conv_state_shape(config, num_checkpoints), dtype)
                             for i in lin} if num_checkpoints else {},
            checkpoint_recurrent={
                i: pool(cls.recurrent_state_shape(config, num_checkpoints), torch.float32)
                for i in lin} if num_checkpoints else {},
            kv_scales=dict(kv_scales or {}),
            capsules={i: Capsule.allocate(config, num_slots, capsule_capacity, dtype, device)
                      for i in lin} if capsule_capacity else {},
        )

    def clone(self) -> PagedHybridCache:
        """A deep copy of every pool (for checks and speculative runs)."""

        def copy(pools: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {i: t.clone() for i, t in pools.items()}

        return PagedHybridCache(copy(self.key_cache), copy(self.value_cache),
                                copy(self.conv_state), copy(self.recurrent_state),
                                self.block_size, self.num_pages, self.num_slots,
                                copy(self.checkpoint_conv), copy(self.checkpoint_recurrent),
                                dict(self.kv_scales),
                                {i: Capsule(*(t.clone() for t in c))
                                 for i, c in self.capsules.items()})

    def gather_kv(self, layer: int, pages: Sequence[int], length: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence, ``[length, Hkv, hd]`` each, read from its pages."""
        index = torch.tensor(list(pages), dtype=torch.int64)
        k = self.key_cache[layer].index_select(0, index.to(self.key_cache[layer].device))
        v = self.value_cache[layer].index_select(0, index.to(self.value_cache[layer].device))
        k = k.reshape(-1, *k.shape[2:])[:length]  # [length, Hkv, hd]
        v = v.reshape(-1, *v.shape[2:])[:length]
        if layer in self.kv_scales:  # quantized pages: dequantized (float32)
            k, v = dequantize(k, self.kv_scales[layer].k), dequantize(v, self.kv_scales[layer].v)
        return k, v
