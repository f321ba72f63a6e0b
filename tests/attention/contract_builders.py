"""Small valid contracts for the attention tests; each test breaks one field of them."""

from __future__ import annotations

from typing import Any

from pagedhybrid.attention.contract import (
    AttentionContract,
    KVCacheSpec,
    ReductionSpec,
    RoPESpec,
    ShardingSpec,
)


def qwen3_sharding(**over: Any) -> ShardingSpec:
    """The seed's Qwen3-8B TP=2 CP=2 rank-0 sharding."""
    kw: dict[str, Any] = dict(
        tp_rank=0, tp_world_size=2, cp_rank=0, cp_world_size=2, global_q_heads=32,
        global_kv_heads=8, local_q_head_start=0, local_q_heads=16, local_kv_head_start=0,
        local_kv_heads=4, global_sequence_length=4096, local_sequence_length=2048,
        global_block_indices=(0,), global_block_token_starts=(0,), local_block_offsets=(0, 2048))
    kw.update(over)
    return ShardingSpec(**kw)


def qwen3_rope(**over: Any) -> RoPESpec:
    kw: dict[str, Any] = dict(
        q_state="post_rope", k_state="post_rope", k_cache_state="post_rope", theta=1.0e6,
        rotary_dim=128, query_position_offsets=(0,), key_position_offsets=(0,),
        cast_at="after_rope", output_dtype="bf16", fusion_boundary="unfused_rope_attention")
    kw.update(over)
    return RoPESpec(**kw)


def qwen3_contract(**over: Any) -> AttentionContract:
    """The seed's Qwen3-8B TP=2 CP=2 example, exactly as written there."""
    kw: dict[str, Any] = dict(
        role="infer", mode="prefill", dtype="bf16", batch_size=1, query_sequence_length=2048,
        head_dim=128, causal=True, causal_offsets=(0,), sharding=qwen3_sharding(),
        reduction=ReductionSpec(), rope=qwen3_rope())
    kw.update(over)
    return AttentionContract(**kw)


def single_rank_sharding(n: int, hq: int = 4, hkv: int = 2,
                         packed: tuple[int, ...] | None = None) -> ShardingSpec:
    return ShardingSpec(
        tp_rank=0, tp_world_size=1, cp_rank=0, cp_world_size=1, global_q_heads=hq,
        global_kv_heads=hkv, local_q_head_start=0, local_q_heads=hq, local_kv_head_start=0,
        local_kv_heads=hkv, global_sequence_length=n, local_sequence_length=n,
        global_block_indices=(0,), global_block_token_starts=(0,), local_block_offsets=(0, n),
        packed_sequence_offsets=packed)


def kv_cache(**over: Any) -> KVCacheSpec:
    """Two sequences (5 and 7 cached tokens), page size 4, a 3-wide block table."""
    kw: dict[str, Any] = dict(
        cache_positions=(4, 6), kv_seq_lens=(5, 7),
        block_table=((3, 0, -1), (1, 2, -1)),
        global_token_positions=(0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6), page_size=4)
    kw.update(over)
    return KVCacheSpec(**kw)


def shared_prefix_cache(**over: Any) -> KVCacheSpec:
    """Two sequences sharing one full read-only prefix page (id 5), exclusive suffix pages."""
    kw: dict[str, Any] = dict(
        cache_positions=(5, 6), kv_seq_lens=(6, 7), block_table=((5, 1), (5, 2)),
        global_token_positions=(0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6), page_size=4,
        prefix_cache_enabled=True, prefix_cache_key="sys-prompt-v1", shared_prefix_page_count=1)
    kw.update(over)
    return KVCacheSpec(**kw)


def decode_contract(kv: KVCacheSpec | None = None, **over: Any) -> AttentionContract:
    kv = kv or kv_cache()
    b = kv.batch_size
    kw: dict[str, Any] = dict(
        role="infer", mode="decode", dtype="fp32", batch_size=b, query_sequence_length=1,
        head_dim=16, causal=True, causal_offsets=tuple(p for p in kv.cache_positions),
        sharding=single_rank_sharding(b), reduction=ReductionSpec(kv_block_size=4), kv_cache=kv)
    kw.update(over)
    return AttentionContract(**kw)
