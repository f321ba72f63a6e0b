"""Deterministic context-parallel attention over ``torch.distributed`` (gloo on CPU, nccl on CUDA).

``context_parallel_attention(query, key, value, *, contract, process_group=None)`` is called on
every CP rank with its local shard and returns ``(out, lse)`` for its query rows: out in the
contract dtype, lse fp32 (natural log, scale included). Output and LSE are bitwise equal for
every CP size, because nothing numeric depends on it (``cp_plan`` has the grid):

1. metadata round (``all_gather_object``): every rank's error status (a rank that rejects the
   call makes all ranks raise, never hang), a fingerprint of the global contract fields, and the
   KV tiles each rank holds -- a tile split across ranks, or a global field that differs between
   ranks, is rejected on all ranks alike;
2. queries: prefill all-gathers the query rows (each tagged with its global row id); decode and
   chunked prefill take the (replicated) query of every rank and check it is identical;
3. every rank computes one fp32 partial ``(out, lse)`` per (query block, KV tile it holds) on the
   fixed global grid, with identical inputs and shapes whatever the CP size;
4. partials travel to the ranks that own their rows with ``all_to_all_single``, each tagged with
   ``(row id, sequence, tile)``; they are never summed by a collective;
5. each rank folds its rows' partials left in ascending global block index (``lse.merge_states``)
   and casts ``out`` to the contract dtype once, at the final write.

Layouts: prefill ``query [L, Hq_local, D]``, ``key``/``value [L, Hkv_local, D]`` with the rows of
``ShardingSpec`` (contiguous or zigzag blocks, packed varlen via packed/global packed offsets);
decode / chunked prefill ``query [B * q, Hq_local, D]`` (the same on every CP rank) and
``key``/``value`` the rank's paged caches ``[num_pages, page_size, Hkv_local, D]`` described by
``contract.kv_cache`` (its ``global_token_positions`` place every cached token on the grid).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from pagedhybrid.attention.contract import AttentionContract, AttentionRole
from pagedhybrid.attention.cp_plan import (
    OP,
    KVTile,
    Partials,
    QueryRows,
    cache_rows,
    cache_tiles,
    fold_partials,
    is_cache_mode,
    prefill_rows,
    prefill_tiles,
    tile_partials,
)
from pagedhybrid.dtypes import to_torch
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                               contract: AttentionContract, process_group: Any = None,
                               scale: float | None = None, query_block_size: int = 64
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic CP attention (module docstring).

    Returns out [R, Hq_local, D] in the contract dtype and lse [R, Hq_local] fp32.
    """
    if not isinstance(contract, AttentionContract):
        raise ContractViolation(OP, "contract", "must be an AttentionContract",
                                type(contract).__name__)
    world = contract.sharding.cp_world_size
    group = _group(contract, process_group)
    error = _local_error(contract, query, key, value, query_block_size)
    scale = 1.0 / math.sqrt(contract.head_dim) if scale is None else float(scale)
    cache = is_cache_mode(contract)
    tiles: list[KVTile] = []
    if error is None:
        try:
            tiles = (cache_tiles(contract, key, value) if cache
                     else prefill_tiles(contract, key, value))
        except ContractViolation as e:
            error = e
    meta = {"error": None if error is None else repr(error),
            "fingerprint": _fingerprint(contract, scale, query_block_size),
            "tiles": [(t.seq, t.tile) for t in tiles]}
    metas = [meta] if world == 1 else _all_gather_object(meta, group, world)
    _agree(metas, error, contract.sharding.cp_rank)
    _check_tiles_disjoint(metas, contract)

    if cache:
        rows = mine = cache_rows(contract, query)
        if world > 1:
            _check_replicated(query, group, world)
        dest = None  # every rank owns every row
    else:
        mine = prefill_rows(contract, query)
        rows, dest = (mine, None) if world == 1 else _gather_rows(mine, group, world)
    parts = tile_partials(contract, rows, tiles, scale, query_block_size)
    if world > 1:
        parts = _exchange(parts, rows, dest, group, world)
    out, lse = fold_partials(mine, parts, query_block_size)
    return out.to(query.dtype), lse  # the one downcast: [R, Hq, D], [R, Hq] fp32


# -- validation ----------------------------------------------------------------------------------
def _group(contract: AttentionContract, process_group: Any) -> Any:
    sh = contract.sharding
    if sh.cp_world_size == 1:
        if process_group is not None and dist.get_world_size(process_group) != 1:
            raise ContractViolation(OP, "process_group",
                                    "must have size 1 when cp_world_size = 1",
                                    dist.get_world_size(process_group))
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise UnsupportedConfiguration(
            f"cp_world_size = {sh.cp_world_size} needs an initialised torch.distributed process "
            "group (init_process_group('gloo') on CPU, 'nccl' on CUDA)")
    group = process_group if process_group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != sh.cp_world_size or rank != sh.cp_rank:
        raise ContractViolation(OP, "process_group",
                                f"must have cp_world_size = {sh.cp_world_size} ranks with this "
                                f"rank at cp_rank = {sh.cp_rank}", f"size {size}, rank {rank}")
    return group


def _local_error(contract: AttentionContract, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, query_block_size: int) -> Exception | None:
    try:
        _validate(contract, query, key, value, query_block_size)
    except (ContractViolation, UnsupportedConfiguration) as e:
        return e
    return None


def _validate(contract: AttentionContract, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, query_block_size: int) -> None:
    sh = contract.sharding
    if contract.role is AttentionRole.TRAIN:
        raise UnsupportedConfiguration(
            "role=train: the deterministic CP reference is forward-only (no gradients flow "
            "through its collectives); use role=infer")
    if contract.rope is not None and contract.rope.fused:
        raise UnsupportedConfiguration(
            "fused RoPE+Attention: the CP reference consumes post-RoPE Q/K "
            "(fusion_boundary=unfused_rope_attention)")
    if query_block_size < 1:
        raise ContractViolation(OP, "query_block_size", "must be >= 1", query_block_size)
    dt = to_torch(contract.dtype)
    hq, hkv, d = sh.local_q_heads, sh.local_kv_heads, contract.head_dim
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ContractViolation(OP, name, "must be a torch.Tensor", type(t).__name__)
        if t.dtype != dt:
            raise ContractViolation(OP, name, f"must have the contract dtype {dt}", t.dtype)
    rows = (contract.batch_size * contract.query_sequence_length if is_cache_mode(contract)
            else sh.local_sequence_length)
    _shape("query", query, (rows, hq, d))
    if is_cache_mode(contract):
        kv = contract.kv_cache
        if kv is None:
            raise UnsupportedConfiguration(
                f"mode={contract.mode.value} without a KVCacheSpec: pass the paged cache and its "
                "identity (chunked prefill over dense KV is not implemented)")
        if key.dim() != 4 or key.shape[1] != kv.page_size:
            raise ContractViolation(OP, "key", "must be a paged cache [num_pages, page_size = "
                                    f"{kv.page_size}, {hkv}, {d}]", tuple(key.shape))
        _shape("key", key, (key.shape[0], kv.page_size, hkv, d))
        _shape("value", value, tuple(key.shape))
        used = [p for row in kv.block_table for p in row if p >= 0]
        if used and max(used) >= key.shape[0]:
            raise ContractViolation(OP, "kv_cache.block_table",
                                    f"page ids must be < num_pages = {key.shape[0]}", max(used))
    else:
        if not sh.is_packed and contract.batch_size != 1:
            raise UnsupportedConfiguration(
                "prefill with batch_size > 1 needs the packed varlen layout "
                "(packed_sequence_offsets); tensors are [tokens, heads, head_dim]")
        _shape("key", key, (sh.local_sequence_length, hkv, d))
        _shape("value", value, (sh.local_sequence_length, hkv, d))


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(want):
        raise ContractViolation(OP, name, f"must have shape {list(want)}", list(t.shape))


def _fingerprint(contract: AttentionContract, scale: float, query_block_size: int) -> str:
    d = contract.to_dict()
    sh = dict(d["sharding"])
    for local in ("cp_rank", "local_sequence_length", "global_block_indices",
                  "global_block_token_starts", "local_block_offsets", "packed_sequence_offsets"):
        sh.pop(local)
    d["sharding"] = sh
    d.pop("kv_cache")
    d.pop("rope")
    d["scale"] = scale
    d["query_block_size"] = query_block_size
    if contract.kv_cache is None and contract.sharding.cp_world_size > 1:
        d["global_sequence_offsets"] = list(contract.sharding.global_sequence_offsets)
    return json.dumps(d, sort_keys=True)


def _agree(metas: list[dict[str, Any]], error: Exception | None, rank: int) -> None:
    if error is not None:
        raise error
    bad = [(r, m["error"]) for r, m in enumerate(metas) if m["error"] is not None]
    if bad:
        raise ContractViolation(OP, "process_group", "another CP rank rejected the call",
                                "; ".join(f"rank {r}: {e}" for r, e in bad))
    prints = {m["fingerprint"] for m in metas}
    if len(prints) != 1:
        raise ContractViolation(OP, "contract",
                                "global contract fields (mode, dtype, heads, lengths, sequence "
                                "offsets, reduction, causal offsets) must agree on all CP ranks",
                                f"rank {rank} sees {len(prints)} distinct contracts")


def _check_tiles_disjoint(metas: list[dict[str, Any]], contract: AttentionContract) -> None:
    holder: dict[tuple[int, int], int] = {}
    for r, m in enumerate(metas):
        for key in m["tiles"]:
            key = tuple(key)
            if key in holder:
                raise UnsupportedConfiguration(
                    f"KV tile (sequence {key[0]}, tile {key[1]}) of kv_block_size = "
                    f"{contract.reduction.kv_block_size} is split across CP ranks "
                    f"{holder[key]} and {r}: CP ownership boundaries must align with the fixed "
                    "KV grid (choose a kv_block_size dividing every CP block length)")
            holder[key] = r


# -- communication -------------------------------------------------------------------------------
def _all_gather_object(obj: Any, group: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _comm_device(group: Any, like: torch.device) -> torch.device:
    """gloo moves CPU tensors; nccl needs CUDA tensors (metadata travels there too)."""
    if dist.get_backend(group) == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_rows(t: torch.Tensor, counts: list[int], group: Any, world: int) -> torch.Tensor:
    """All-gather variable-length row tensors (padded to the longest), concatenated by rank."""
    n = max(counts)
    pad = t.new_zeros((n, *t.shape[1:]), device=_comm_device(group, t.device))
    pad[: t.shape[0]] = t
    bufs = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(bufs, pad, group=group)
    return torch.cat([b[:c] for b, c in zip(bufs, counts, strict=True)]).to(t.device)


def _gather_rows(rows: QueryRows, group: Any, world: int) -> tuple[QueryRows, torch.Tensor]:
    """Every rank's prefill query rows, tagged with global row ids; returns (rows, owner rank)."""
    counts = [int(c) for c in _all_gather_object(rows.ids.numel(), group, world)]
    tagged = torch.stack([rows.ids, rows.seq, rows.index, rows.pos], 1)  # [L, 4]
    meta = _all_gather_rows(tagged, counts, group, world).cpu()  # [G, 4]
    q = _all_gather_rows(rows.q, counts, group, world)  # [G, Hq, D]
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(counts))  # [G]
    if torch.unique(meta[:, 0]).numel() != meta.shape[0]:
        raise ContractViolation(OP, "sharding", "CP ranks claim the same global token twice",
                                None)
    return QueryRows(meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3], q), owner


def _check_replicated(query: torch.Tensor, group: Any, world: int) -> None:
    bufs = [torch.empty_like(query) for _ in range(world)]
    dist.all_gather(bufs, query.contiguous(), group=group)
    if not all(torch.equal(b, bufs[0]) for b in bufs):
        raise ContractViolation(OP, "query", "decode / chunked-prefill queries must be "
                                "identical on every CP rank (the KV cache is what is sharded)",
                                None)


def _exchange(parts: Partials, rows: QueryRows, owner: torch.Tensor | None, group: Any,
              world: int) -> Partials:
    """Send each partial to the rank(s) owning its row; tags travel with the data."""
    hq, d = parts.out.shape[1], parts.out.shape[2]
    if owner is None:  # replicated rows: every rank receives every partial
        dest = [torch.arange(parts.ids.numel())] * world
    else:
        row_owner = _owner_of(parts.ids, rows.ids, owner)  # [P]
        dest = [torch.nonzero(row_owner == r).flatten() for r in range(world)]
    send_counts = [int(x.numel()) for x in dest]
    dev = parts.out.device
    comm = _comm_device(group, dev)
    recv_counts = _all_to_all_counts(send_counts, group, comm)
    order = torch.cat(dest)
    tags = torch.cat([parts.ids[:, None], parts.tiles], 1)[order].to(comm)  # [S, 3] int64
    data = torch.cat([parts.out, parts.lse[..., None]], 2)[order.to(dev)].to(comm)  # [S, Hq, D+1]
    rtags = tags.new_empty((sum(recv_counts), 3))
    rdata = data.new_empty((sum(recv_counts), hq, d + 1))
    dist.all_to_all_single(rtags, tags.contiguous(), recv_counts, send_counts, group=group)
    dist.all_to_all_single(rdata, data.contiguous(), recv_counts, send_counts, group=group)
    rtags, rdata = rtags.cpu(), rdata.to(dev)
    return Partials(rtags[:, 0], rtags[:, 1:], rdata[..., :d], rdata[..., d])


def _owner_of(ids: torch.Tensor, row_ids: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    sorted_ids, sorter = row_ids.sort()
    return owner[sorter[torch.searchsorted(sorted_ids, ids)]]


def _all_to_all_counts(send: list[int], group: Any, comm: torch.device) -> list[int]:
    recv = torch.zeros(len(send), dtype=torch.int64, device=comm)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.int64, device=comm), group=group)
    return [int(x) for x in recv.tolist()]
