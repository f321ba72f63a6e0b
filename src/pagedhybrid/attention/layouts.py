"""CP token layouts and TP head ownership as ``ShardingSpec``s.

Per document (packed sequence) of length ``n``:

* ``contiguous``: ``W`` equal chunks, rank ``r`` owns chunk ``r``;
* ``zigzag`` (head-tail load balance, PyTorch ``_HeadTailLoadBalancer`` / TransformerEngine):
  ``2W`` equal chunks, rank ``r`` owns chunks ``r`` and ``2W - 1 - r`` (causal work balanced).

Chunks are numbered in global order across documents (the stable ``global_block_indices``); a
rank's blocks are listed in ascending global order, so its local rows are the concatenation of
its chunks. ``n`` must be divisible by the chunk count.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedhybrid.attention.contract import ShardingSpec
from pagedhybrid.errors import UnsupportedConfiguration

SCHEMES = ("contiguous", "zigzag")


def chunk_owners(scheme: str, world: int) -> list[int]:
    """Owner rank of each chunk of one document."""
    if scheme == "contiguous":
        return list(range(world))
    if scheme == "zigzag":
        return [c if c < world else 2 * world - 1 - c for c in range(2 * world)]
    raise UnsupportedConfiguration(f"CP layout scheme {scheme!r}; use one of {SCHEMES}")


def cp_blocks(seq_lens: Sequence[int], world: int, rank: int, scheme: str
              ) -> list[tuple[int, int, int]]:
    """This rank's blocks as ``(global_block_index, global_start, length)`` in global order."""
    owners = chunk_owners(scheme, world)
    blocks, start, index = [], 0, 0
    for n in seq_lens:
        if n % len(owners):
            raise UnsupportedConfiguration(
                f"{scheme} CP over {world} ranks needs every sequence length divisible by "
                f"{len(owners)}; got {n} (pad the sequence)")
        size = n // len(owners)
        for c, r in enumerate(owners):
            if r == rank:
                blocks.append((index, start + c * size, size))
            index += 1
        start += n
    return blocks


def cp_sharding(seq_lens: Sequence[int], *, cp_world_size: int, cp_rank: int, scheme: str,
                global_q_heads: int, global_kv_heads: int, tp_world_size: int = 1,
                tp_rank: int = 0, packed: bool | None = None) -> ShardingSpec:
    """``ShardingSpec`` of rank ``(tp_rank, cp_rank)``; ``packed`` defaults to len(seq_lens) > 1."""
    blocks = cp_blocks(seq_lens, cp_world_size, cp_rank, scheme)
    offsets = [0]
    for _, _, n in blocks:
        offsets.append(offsets[-1] + n)
    packed = len(seq_lens) > 1 if packed is None else packed
    glob = [0]
    for n in seq_lens:
        glob.append(glob[-1] + n)
    local_packed = None
    if packed:
        per_seq = [0] * len(seq_lens)
        for _, s, n in blocks:
            b = max(i for i in range(len(seq_lens)) if glob[i] <= s)
            per_seq[b] += n
        local_packed = [0]
        for n in per_seq:
            local_packed.append(local_packed[-1] + n)
    lq, lkv = global_q_heads // tp_world_size, global_kv_heads // tp_world_size
    return ShardingSpec(
        tp_rank=tp_rank, tp_world_size=tp_world_size, cp_rank=cp_rank,
        cp_world_size=cp_world_size, global_q_heads=global_q_heads,
        global_kv_heads=global_kv_heads, local_q_head_start=tp_rank * lq, local_q_heads=lq,
        local_kv_head_start=tp_rank * lkv, local_kv_heads=lkv,
        global_sequence_length=glob[-1], local_sequence_length=offsets[-1],
        global_block_indices=tuple(b[0] for b in blocks),
        global_block_token_starts=tuple(b[1] for b in blocks),
        local_block_offsets=tuple(offsets),
        packed_sequence_offsets=None if local_packed is None else tuple(local_packed),
        global_packed_sequence_offsets=(tuple(glob) if packed and cp_world_size > 1 else None),
    )
