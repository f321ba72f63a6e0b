"""The CP-size-independent grid of the deterministic context-parallel attention.

Coordinates (all global, never rank-local):

* a **query row** has an id (prefill: its global token coordinate; decode / chunked prefill:
  ``b * query_sequence_length + i``), its sequence ``b``, its in-sequence index ``i`` and its
  logical position ``causal_offsets[b] + i``;
* a **KV tile** ``(b, t)`` covers the logical key positions ``[t * kv_block_size,
  (t + 1) * kv_block_size)`` of sequence ``b``; slot ``c`` of the tile holds position
  ``t * kv_block_size + c`` (prefill: the token with in-sequence index ``j``; decode: the cached
  token with global position ``j``), missing positions are padding. The global block index of a
  tile is ``(b, t)`` in lexicographic order;
* a **query block** ``(b, i // query_block_size)`` groups rows of one sequence.

One fp32 partial ``(out, lse)`` is computed per (query block, KV tile), by whichever rank holds
the tile, with the same inputs and shapes whatever the CP size; query blocks whose rows all lie
before the tile are skipped (a rule on global positions only). Each row then folds its partials
left in ascending tile index. This module has no communication; ``context_parallel`` moves
queries and partials between ranks.

Tile layout: ``KVTile.k`` / ``.v`` [kv_block_size, Hkv, D] in the input dtype (zeros in padding),
``KVTile.present`` [kv_block_size] bool. Float data stays on the input device; ids, positions and
tile keys are CPU int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedhybrid.attention.contract import AttentionContract, AttentionMode
from pagedhybrid.attention.lse import NEG_INF, attention_partial, merge_states

OP = "pagedhybrid.parallel.context_parallel_attention"


@dataclass(frozen=True)
class QueryRows:
    """Query rows known to this rank: ids, sequence, in-sequence index, logical position."""

    ids: torch.Tensor  # [R] int64
    seq: torch.Tensor  # [R] int64
    index: torch.Tensor  # [R] int64
    pos: torch.Tensor  # [R] int64
    q: torch.Tensor  # [R, Hq, D] (input dtype)


@dataclass(frozen=True)
class KVTile:
    seq: int
    tile: int
    k: torch.Tensor  # [bs, Hkv, D]
    v: torch.Tensor  # [bs, Hkv, D]
    present: torch.Tensor  # [bs] bool


def prefill_rows(contract: AttentionContract, query: torch.Tensor) -> QueryRows:
    """Local query rows of a prefill call, in local order."""
    sh = contract.sharding
    coords = torch.tensor(sh.local_global_coordinates(), dtype=torch.int64)  # [L]
    bounds = torch.tensor(sh.global_sequence_offsets, dtype=torch.int64)  # [B+1]
    seq = torch.searchsorted(bounds, coords, right=True) - 1  # [L]
    index = coords - bounds[seq]  # [L]
    return QueryRows(coords, seq, index, index + _offsets(contract)[seq], query)


def cache_rows(contract: AttentionContract, query: torch.Tensor) -> QueryRows:
    """Query rows of a decode / chunked-prefill call: ``query_sequence_length`` per sequence."""
    qlen = contract.query_sequence_length
    ids = torch.arange(contract.batch_size * qlen, dtype=torch.int64)  # [B*q]
    seq, index = ids // qlen, ids % qlen
    return QueryRows(ids, seq, index, index + _offsets(contract)[seq], query)


def _offsets(contract: AttentionContract) -> torch.Tensor:
    if contract.causal_offsets is None:
        return torch.zeros(contract.batch_size, dtype=torch.int64)
    return torch.tensor(contract.causal_offsets, dtype=torch.int64)


def prefill_tiles(contract: AttentionContract, key: torch.Tensor,
                  value: torch.Tensor) -> list[KVTile]:
    """KV tiles made of this rank's tokens (a tile may be partial here; the caller checks)."""
    rows = prefill_rows(contract, key)
    return _tiles(contract, rows.seq, rows.index, key, value)


def cache_tiles(contract: AttentionContract, key_cache: torch.Tensor,
                value_cache: torch.Tensor) -> list[KVTile]:
    """KV tiles of the cached tokens described by ``contract.kv_cache`` (pages -> positions)."""
    kv = contract.kv_cache
    assert kv is not None
    seqs, poss, pages, slots = [], [], [], []
    for b, n in enumerate(kv.kv_seq_lens):
        j = torch.arange(n, dtype=torch.int64)
        seqs.append(torch.full((n,), b, dtype=torch.int64))
        poss.append(torch.tensor(kv.sequence_positions(b), dtype=torch.int64))
        pages.append(torch.tensor(kv.block_table[b], dtype=torch.int64)[j // kv.page_size])
        slots.append(j % kv.page_size)
    page = torch.cat(pages).to(key_cache.device)  # [N]
    slot = torch.cat(slots).to(key_cache.device)  # [N]
    k = key_cache[page, slot]  # [N, Hkv, D]
    v = value_cache[page, slot]  # [N, Hkv, D]
    return _tiles(contract, torch.cat(seqs), torch.cat(poss), k, v)


def _tiles(contract: AttentionContract, seq: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> list[KVTile]:
    bs = contract.reduction.kv_block_size
    tile, slot = pos // bs, pos % bs
    out = []
    keys = sorted({(int(b), int(t)) for b, t in zip(seq.tolist(), tile.tolist(), strict=True)})
    for b, t in keys:
        sel = (seq == b) & (tile == t)  # [N]
        kt = k.new_zeros((bs, *k.shape[1:]))  # [bs, Hkv, D]
        vt = v.new_zeros((bs, *v.shape[1:]))  # [bs, Hkv, D]
        present = torch.zeros(bs, dtype=torch.bool, device=k.device)
        at = slot[sel].to(k.device)
        kt[at] = k[sel.to(k.device)]
        vt[at] = v[sel.to(k.device)]
        present[at] = True
        out.append(KVTile(b, t, kt, vt, present))
    return out


@dataclass(frozen=True)
class Partials:
    """Partial states: row ids [P], tile keys [P, 2] = (b, t), out [P, Hq, D], lse [P, Hq]."""

    ids: torch.Tensor
    tiles: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def tile_partials(contract: AttentionContract, rows: QueryRows, tiles: list[KVTile],
                  scale: float, query_block_size: int) -> Partials:
    """One fp32 partial per (query block, KV tile) for every row of the tile's sequence."""
    bs = contract.reduction.kv_block_size
    ids, keys, outs, lses = [], [], [], []
    order = torch.argsort(rows.ids)  # global row order, independent of the rank layout
    seq, index, pos = rows.seq[order], rows.index[order], rows.pos[order]
    for tile in tiles:
        in_seq = torch.nonzero(seq == tile.seq).flatten()  # [Rb] ascending row ids
        kpos = tile.tile * bs + torch.arange(bs, dtype=torch.int64)  # [bs]
        qblock = index[in_seq] // query_block_size
        for qb in torch.unique(qblock).tolist():
            sel = in_seq[qblock == qb]
            qpos = pos[sel]  # [R]
            if contract.causal and int(qpos.max()) < tile.tile * bs:
                continue  # every row of this query block precedes the tile (global rule)
            allowed = tile.present[None, :].expand(len(sel), bs)  # [R, bs]
            if contract.causal:
                allowed = allowed & (kpos[None, :] <= qpos[:, None]).to(allowed.device)
            q = rows.q[order[sel].to(rows.q.device)]  # [R, Hq, D]
            o, lse = attention_partial(q, tile.k, tile.v, allowed, scale)
            ids.append(rows.ids[order[sel]])
            keys.append(torch.tensor([[tile.seq, tile.tile]], dtype=torch.int64)
                        .expand(len(sel), 2))
            outs.append(o)
            lses.append(lse)
    hq, d = rows.q.shape[1], rows.q.shape[2]
    if not ids:
        dev = rows.q.device
        return Partials(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64),
                        torch.zeros(0, hq, d, device=dev), torch.zeros(0, hq, device=dev))
    return Partials(torch.cat(ids), torch.cat(keys), torch.cat(outs), torch.cat(lses))


def fold_partials(rows: QueryRows, parts: Partials, query_block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left fold, per row, of its partials in ascending global block index ``(b, t)``.

    The fold runs per query block on a fixed ``[query_block_size, Hq, D]`` buffer with every row
    at its grid slot (absent rows are the identity ``(0, -inf)``): torch's elementwise kernels
    (exp, log1p) may round an element differently depending on where it falls in a vectorised
    loop, so the shapes and positions of every merge are made independent of the CP layout.
    A row without partials stays ``(0, -inf)``. Returns out [R, Hq, D], lse [R, Hq] (fp32) in
    the order of ``rows``.
    """
    n, hq, d = rows.q.shape
    dev = rows.q.device
    out = torch.zeros(n, hq, d, device=dev)
    lse = torch.full((n, hq), NEG_INF, device=dev)
    if parts.ids.numel() == 0:
        return out, lse
    sorted_ids, sorter = rows.ids.sort()
    at = torch.searchsorted(sorted_ids, parts.ids.contiguous()).clamp(max=n - 1)  # [P]
    known = sorted_ids[at] == parts.ids
    if not bool(known.all()):
        raise _violation("partials", "arrived for query rows this rank does not own",
                         parts.ids[~known][:8].tolist())
    local = sorter[at]  # [P] local row of each partial
    key = torch.stack([parts.tiles[:, 0], parts.tiles[:, 1], local], 1)  # [P, 3]
    if torch.unique(key, dim=0).shape[0] != key.shape[0]:
        raise _violation("partials", "hold two partial states for one (row, KV tile)", None)
    qblock = rows.index // query_block_size  # [R]
    slot = rows.index % query_block_size  # [R]
    for b, qb in torch.unique(torch.stack([rows.seq, qblock], 1), dim=0).tolist():
        members = torch.nonzero((rows.seq == b) & (qblock == qb)).flatten()  # local rows
        state_o = torch.zeros(query_block_size, hq, d, device=dev)
        state_l = torch.full((query_block_size, hq), NEG_INF, device=dev)
        mine = torch.isin(local, members)  # partials of this query block
        for t in torch.unique(parts.tiles[mine, 1]).tolist():  # ascending tile index
            sel = torch.nonzero(mine & (parts.tiles[:, 1] == t)).flatten()
            buf_o = torch.zeros(query_block_size, hq, d, device=dev)
            buf_l = torch.full((query_block_size, hq), NEG_INF, device=dev)
            at = slot[local[sel]].to(dev)
            buf_o[at] = parts.out[sel.to(dev)]
            buf_l[at] = parts.lse[sel.to(dev)]
            state_o, state_l = merge_states(state_o, state_l, buf_o, buf_l)
        out[members.to(dev)] = state_o[slot[members].to(dev)]
        lse[members.to(dev)] = state_l[slot[members].to(dev)]
    return out, lse


def _violation(where: str, rule: str, got: object) -> Exception:
    from pagedhybrid.errors import ContractViolation

    return ContractViolation(OP, where, rule, got)


def is_cache_mode(contract: AttentionContract) -> bool:
    return contract.kv_cache is not None or contract.mode is AttentionMode.DECODE
