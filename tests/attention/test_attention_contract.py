"""Contract objects: the seed example, every validation rule broken once, JSON round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest
from contract_builders import (
    decode_contract,
    kv_cache,
    qwen3_contract,
    qwen3_rope,
    qwen3_sharding,
    shared_prefix_cache,
    single_rank_sharding,
)

from pagedhybrid.attention.capability import AttentionBackendCapability
from pagedhybrid.attention.contract import (
    AttentionContract,
    AttentionContractError,
    KVCacheSpec,
    ReductionSpec,
    RoPESpec,
    ShardingSpec,
)
from pagedhybrid.attention.layouts import cp_sharding
from pagedhybrid.errors import ContractViolation


def _raises(field: str, rule: str) -> Any:
    return pytest.raises(AttentionContractError, match=rf"'{field}'.*{rule}")


# -- the seed example -----------------------------------------------------------------------------
def test_qwen3_8b_tp2_cp2_example_constructs_as_written() -> None:
    c = qwen3_contract()
    assert (c.sharding.local_q_heads, c.sharding.local_kv_heads) == (16, 4)
    assert c.reduction.merge == "online_softmax_lse" and c.reduction.acc_dtype == "fp32"
    assert c.reduction.order == "global_block_index" and c.reduction.downcast_at == "final_write"
    assert c.reduction.partial_state == "out_attention_lse"
    d = c.to_dict()
    assert d["semantic_operator"] == "standard_softmax_attention"
    assert d["lse_domain"] == "attention"
    assert AttentionContract.from_json(c.to_json()) == c
    assert json.loads(c.to_json())["sharding"]["global_block_indices"] == [0]


def test_error_is_a_typed_contract_violation_naming_object_and_field() -> None:
    with pytest.raises(ContractViolation) as e:
        qwen3_sharding(local_q_heads=8)
    assert isinstance(e.value, AttentionContractError)
    assert e.value.op == "ShardingSpec" and e.value.where == "local_q_heads"
    assert "global_q_heads / tp_world_size = 16" in e.value.rule and e.value.got == 8


# -- TP-local head ownership (GQA) ----------------------------------------------------------------
@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"local_q_heads": 8}, "local_q_heads", "global_q_heads / tp_world_size"),
    ({"local_kv_heads": 8}, "local_kv_heads", "global_kv_heads / tp_world_size"),
    ({"local_q_head_start": 16}, "local_q_head_start", "contiguous ownership"),
    ({"tp_rank": 1, "local_q_head_start": 16, "local_kv_head_start": 0},
     "local_kv_head_start", "global GQA mapping"),
    ({"global_q_heads": 30, "local_q_heads": 15}, "global_q_heads", "multiple of global_kv_heads"),
    ({"global_kv_heads": 3, "global_q_heads": 33}, "global_q_heads", "divisible by tp_world_size"),
    ({"tp_world_size": 16, "local_q_heads": 2, "local_kv_heads": 0}, "global_kv_heads",
     "divisible by tp_world_size"),
    ({"tp_rank": 2}, "tp_rank", "< tp_world_size"),
    ({"cp_rank": 2}, "cp_rank", "< cp_world_size"),
])
def test_gqa_ownership_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        qwen3_sharding(**over)


def test_tp_rank1_owns_the_second_contiguous_head_groups() -> None:
    sh = qwen3_sharding(tp_rank=1, local_q_head_start=16, local_kv_head_start=4)
    assert sh.local_q_head_start // (32 // 8) == sh.local_kv_head_start  # GQA mapping kept


# -- CP block-to-token ownership ------------------------------------------------------------------
def test_non_contiguous_cp_blocks_have_explicit_global_and_local_offsets() -> None:
    sh = qwen3_sharding(global_block_indices=(0, 3), global_block_token_starts=(0, 3072),
                        local_block_offsets=(0, 1024, 2048))
    coords = sh.local_global_coordinates()
    assert coords[:1024] == list(range(1024)) and coords[1024:] == list(range(3072, 4096))
    assert ShardingSpec.from_json(sh.to_json()) == sh


@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"global_block_indices": (3, 0), "global_block_token_starts": (0, 3072),
      "local_block_offsets": (0, 1024, 2048)}, "global_block_indices", "strictly increasing"),
    ({"global_block_indices": ()}, "global_block_indices", "must not be empty"),
    ({"global_block_indices": (-1,)}, r"global_block_indices\[0\]", ">= 0"),
    ({"global_block_indices": (0, 3), "global_block_token_starts": (0,),
      "local_block_offsets": (0, 1024, 2048)}, "global_block_token_starts", "one global token"),
    ({"global_block_indices": (0, 3), "global_block_token_starts": (0, 3072),
      "local_block_offsets": (0, 2048)}, "local_block_offsets", "nblocks \\+ 1"),
    ({"local_block_offsets": (0, 2047)}, "local_block_offsets", "must end at local_sequence"),
    ({"local_block_offsets": (1, 2048)}, "local_block_offsets", "must start at 0"),
    ({"global_block_indices": (0, 1), "global_block_token_starts": (0, 512),
      "local_block_offsets": (0, 1024, 2048)}, "global_block_token_starts", "non-overlapping"),
    ({"global_block_token_starts": (3000,)}, "global_block_token_starts", "beyond global"),
    ({"local_sequence_length": 5000}, "local_sequence_length", "<= global_sequence_length"),
    ({"cp_world_size": 1, "cp_rank": 0}, "local_sequence_length", "when cp_world_size = 1"),
])
def test_cp_block_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        qwen3_sharding(**over)


def test_zigzag_layouts_match_head_tail_load_balancing() -> None:
    # TransformerEngine / Megatron: cp=3 turns chunks 123456 into 162534
    order = []
    for r in range(3):
        order += cp_sharding((6,), cp_world_size=3, cp_rank=r, scheme="zigzag", global_q_heads=2,
                             global_kv_heads=1).local_global_coordinates()
    assert order == [0, 5, 1, 4, 2, 3]
    sh = cp_sharding((8,), cp_world_size=2, cp_rank=0, scheme="zigzag", global_q_heads=2,
                     global_kv_heads=1)
    assert sh.global_block_indices == (0, 3) and sh.local_global_coordinates() == [0, 1, 6, 7]


# -- packed varlen --------------------------------------------------------------------------------
def _packed(world: int = 2, rank: int = 0) -> ShardingSpec:
    return cp_sharding((8, 16), cp_world_size=world, cp_rank=rank, scheme="zigzag",
                       global_q_heads=4, global_kv_heads=2)


def test_packed_varlen_metadata() -> None:
    sh = _packed()
    assert sh.packed_sequence_offsets == (0, 4, 12)
    assert sh.global_packed_sequence_offsets == (0, 8, 24)
    assert sh.local_global_coordinates() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    c = AttentionContract(role="infer", mode="prefill", dtype="fp32", batch_size=2,
                          query_sequence_length=12, head_dim=8, causal=True,
                          causal_offsets=(0, 0), sharding=sh)
    assert AttentionContract.from_dict(json.loads(c.to_json())) == c
    with _raises("batch_size", r"len\(packed_sequence_offsets\) - 1 = 2"):
        AttentionContract(**{**c.__dict__, "batch_size": 1, "causal_offsets": (0,)})
    with _raises("causal_offsets", "one offset per logical sequence"):
        AttentionContract(**{**c.__dict__, "causal_offsets": (0,)})


@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"packed_sequence_offsets": (0, 4, 11)}, "packed_sequence_offsets",
     "must end at local_sequence_length"),
    ({"packed_sequence_offsets": (0, 4, 4, 12)}, "packed_sequence_offsets", "strictly"),
    ({"packed_sequence_offsets": (1, 4, 12)}, "packed_sequence_offsets", "must start at 0"),
    ({"packed_sequence_offsets": (0, 6, 12)}, "packed_sequence_offsets",
     "tokens this rank's blocks hold"),
    ({"global_packed_sequence_offsets": (0, 8, 23)}, "global_packed_sequence_offsets",
     "must end at global_sequence_length"),
    ({"global_packed_sequence_offsets": (0, 8, 16, 24)}, "global_packed_sequence_offsets",
     "same 2 sequences"),
    ({"global_packed_sequence_offsets": None}, "global_packed_sequence_offsets",
     "required for packed varlen with cp_world_size > 1"),
    ({"packed_sequence_offsets": None}, "global_packed_sequence_offsets",
     "requires packed_sequence_offsets"),
])
def test_packed_varlen_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        ShardingSpec(**{**_packed().__dict__, **over})


# -- contract-level rules ------------------------------------------------------------------------
@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"causal_offsets": None}, "causal_offsets", "required when causal"),
    ({"causal": False}, "causal_offsets", "None when causal = False"),
    ({"causal_offsets": (-1,)}, r"causal_offsets\[0\]", ">= 0"),
    ({"export_lse": False}, "export_lse", "attention-domain LSE"),
    ({"query_sequence_length": 1024}, "query_sequence_length", "full prefill"),
    ({"role": "serve"}, "role", "one of"),
    ({"mode": "extend"}, "mode", "one of"),
    ({"dtype": "fp8"}, "dtype", "one of"),
    ({"kv_cache": kv_cache()}, "kv_cache", "None for prefill"),
])
def test_contract_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        qwen3_contract(**over)


def test_reduction_is_fixed_to_fp32_online_softmax_in_global_block_order() -> None:
    with _raises("acc_dtype", "CP attention accumulation must be fp32"):
        ReductionSpec(acc_dtype="bf16")
    for field in ("merge", "order", "downcast_at", "engine", "partial_state"):
        with _raises(field, "one of"):
            ReductionSpec(**{field: "sum"})
    with _raises("kv_block_size", ">= 1"):
        ReductionSpec(kv_block_size=0)
    assert ReductionSpec.from_dict(ReductionSpec(kv_block_size=8).to_dict()).kv_block_size == 8


# -- decode cache identity: each rule violated once -----------------------------------------------
def test_decode_cache_identity_valid() -> None:
    c = decode_contract()
    assert c.kv_cache is not None and c.kv_cache.sequence_positions(1) == tuple(range(7))
    assert AttentionContract.from_json(c.to_json()) == c
    shared = shared_prefix_cache()
    assert KVCacheSpec.from_json(shared.to_json()) == shared
    decode_contract(shared)


@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"cache_positions": (4,)}, "cache_positions", "one entry per logical sequence"),
    ({"cache_positions": (5, 6)}, r"cache_positions\[0\]", "terminal global token position"),
    ({"global_token_positions": (0, 1, 2, 4, 3, 0, 1, 2, 3, 4, 5, 6)},
     r"global_token_positions\[sequence 0\]", "strictly increasing"),
    ({"global_token_positions": (0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5)}, "global_token_positions",
     "one position per cached token"),
    ({"block_table": ((3, -1, 0), (1, 2, -1))}, r"block_table\[0\]", "active pages before"),
    ({"block_table": ((3, 0, 4), (1, 2, -1))}, r"block_table\[0\]", "trailing -1"),
    ({"block_table": ((3, 3, -1), (1, 2, -1))}, r"block_table\[0\]", "must not repeat"),
    ({"block_table": ((3, 0, -1), (1, 0, -1))}, r"block_table\[1\]",
     "only the 0 declared shared prefix pages"),
    ({"block_table": ((3, 0, -1), (1, 2))}, r"block_table\[1\]", "same width"),
    ({"page_size": 0}, "page_size", ">= 1"),
    ({"prefix_cache_key": "k"}, "prefix_cache_key", "None when prefix caching is disabled"),
    ({"prefix_cache_enabled": True}, "prefix_cache_key", "required"),
    ({"shared_prefix_page_count": 1}, "shared_prefix_page_count", "only when prefix caching"),
])
def test_decode_cache_identity_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        kv_cache(**over)


@pytest.mark.parametrize(("over", "field", "rule"), [
    # shared prefix pages must use the same leading page ids ...
    ({"block_table": ((5, 1), (6, 2))}, r"block_table\[1\]", "same 1 shared prefix page ids"),
    # ... the same logical positions ...
    ({"global_token_positions": (0, 1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 9, 10),
      "cache_positions": (5, 10)}, r"global_token_positions\[sequence 1\]",
     "logical positions of the shared prefix"),
    # ... be fully populated and read-only (the terminal token is in an exclusive page)
    ({"kv_seq_lens": (4, 7), "cache_positions": (3, 6), "block_table": ((5, -1), (5, 2)),
      "global_token_positions": (0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6)}, "shared_prefix_page_count",
     "fully populated and read-only"),
    # a suffix page may not alias another sequence's page
    ({"block_table": ((5, 1), (5, 1))}, r"block_table\[1\]", "suffix pages are exclusive"),
    ({"block_table": ((5, 1), (5, 5))}, r"block_table\[1\]", "must not repeat"),
    ({"block_table": ((5, 2), (1, 5)), "shared_prefix_page_count": 0},
     r"block_table\[1\]", "only the 0 declared shared prefix pages"),
])
def test_shared_prefix_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        shared_prefix_cache(**over)


def test_decode_contract_cache_rules() -> None:
    with _raises("kv_cache", "required for decode"):
        decode_contract(kv=None, kv_cache=None)
    with _raises("kv_cache", "one kv_seq_lens / cache_positions entry per sequence"):
        decode_contract(batch_size=1, causal_offsets=(4,), sharding=single_rank_sharding(1))
    with _raises(r"causal_offsets\[1\]", "terminal cached token"):
        decode_contract(causal_offsets=(4, 7))
    with _raises("query_sequence_length", "batch_size \\* query_sequence_length"):
        decode_contract(sharding=single_rank_sharding(3))


# -- RoPE metadata -------------------------------------------------------------------------------
@pytest.mark.parametrize(("over", "field", "rule"), [
    ({"q_state": "pre_rope"}, "q_state", "post_rope at the unfused_rope_attention boundary"),
    ({"fusion_boundary": "fused_rope_attention"}, "q_state", "pre_rope at the fused"),
    ({"rotary_dim": 63}, "rotary_dim", "even"),
    ({"theta": 0.0}, "theta", "finite and > 0"),
    ({"cast_at": "before_rope", "output_dtype": None}, "output_dtype", "required"),
    ({"k_cache_state": "rotated"}, "k_cache_state", "one of"),
    ({"rope_scaling": {"f": object()}}, "rope_scaling", "JSON-serialisable"),
])
def test_rope_spec_errors(over: dict[str, Any], field: str, rule: str) -> None:
    with _raises(field, rule):
        qwen3_rope(**over)


@pytest.mark.parametrize(("rope_over", "field", "rule"), [
    ({"rotary_dim": 256}, "rope.rotary_dim", "<= head_dim = 128"),
    ({"query_position_offsets": (0, 0)}, "rope.query_position_offsets", "batch_size = 1"),
    ({"key_position_offsets": ()}, "rope.key_position_offsets", "batch_size = 1"),
    ({"output_dtype": "fp16"}, "rope.output_dtype", "attention dtype bf16"),
    ({"position_ids": (0, 1, 2)}, "rope.position_ids", "length must be"),
])
def test_rope_metadata_validated_against_the_contract(rope_over: dict[str, Any], field: str,
                                                      rule: str) -> None:
    with _raises(field, rule):
        qwen3_contract(rope=qwen3_rope(**rope_over))


def test_rope_positions_are_global_never_rederived_from_local_offsets() -> None:
    # two packed documents of 4 tokens, zigzag over CP=2: rank 0 holds chunks 0 and 3 of each
    sh = cp_sharding((4, 4), cp_world_size=2, cp_rank=0, scheme="zigzag", global_q_heads=2,
                     global_kv_heads=1)

    def contract(pos: tuple[int, ...]) -> AttentionContract:
        rope = RoPESpec(q_state="post_rope", k_state="post_rope", rotary_dim=8,
                        position_ids=pos)
        return AttentionContract(role="train", mode="prefill", dtype="fp32", batch_size=2,
                                 query_sequence_length=4, head_dim=8, causal=True,
                                 causal_offsets=(0, 0), sharding=sh, rope=rope)

    assert contract((0, 3, 0, 3)).rope is not None
    with _raises("rope.position_ids", "global in-sequence positions"):
        contract((0, 1, 0, 1))  # re-derived from local offsets: wrong under CP


def test_rope_with_scaling_round_trips() -> None:
    rope = qwen3_rope(rope_scaling={"mrope_section": [11, 11, 10], "type": "default"},
                      rotary_dim=64)
    assert RoPESpec.from_json(rope.to_json()) == rope


# -- capability objects -------------------------------------------------------------------------
def test_capability_validation_and_round_trip() -> None:
    cap = AttentionBackendCapability(backend_id="x", roles=("infer",), modes=("prefill",),
                                     dtypes=("bf16",), cp_world_sizes=(1, 2),
                                     exports_attention_lse=True, deterministic_cp_merge=True)
    assert AttentionBackendCapability.from_json(cap.to_json()) == cap
    with _raises("deterministic_cp_merge", "requires exports_attention_lse"):
        AttentionBackendCapability(backend_id="x", roles=("infer",), modes=("prefill",),
                                   dtypes=("bf16",), deterministic_cp_merge=True)
    with _raises("roles", "must not be empty"):
        AttentionBackendCapability(backend_id="x", roles=(), modes=("prefill",),
                                   dtypes=("bf16",))
    with _raises("implementation_kind", "one of"):
        AttentionBackendCapability(backend_id="x", roles=("infer",), modes=("prefill",),
                                   dtypes=("bf16",), implementation_kind="fast")


def test_from_dict_rejects_unknown_fields_and_foreign_semantics() -> None:
    d = qwen3_contract().to_dict()
    with _raises("<dict>", "unknown fields"):
        AttentionContract.from_dict({**d, "split_kv": "auto"})
    with _raises("lse_domain", "'attention'"):
        AttentionContract.from_dict({**d, "lse_domain": "base2"})
