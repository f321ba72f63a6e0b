"""Malformed PagedAttention calls: each raises ContractViolation naming the port/attribute.

Every case starts from one valid call (2 sequences, GQA 4/2, head_size 16, block 16, rotary,
head sink, q/k norm, exact attention_metadata) and breaks exactly one rule.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pagedhybrid.errors import ContractViolation

pa = importlib.import_module("pagedhybrid.ops.paged_attention")

BASE = {
    "name": "bad_input_base",
    "dims": {"seqs": [[17, 3], [0, 5]], "head_size": 16, "block_size": 16, "spare_blocks": 2,
             "packed_qkv": False, "rotary_dim": 16, "head_sink": True, "qk_norm": True,
             "slot_mapping": None, "attention_metadata": "exact"},
    "attrs": {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1},
    "backends": ["reference"],
}
(Q, K, V, KC, VC, CU, PAST, BT, COS, SIN, SLOT, SINK, QN, KN, KS, VS, META) = range(17)


def base():
    return pa.make_inputs(BASE, torch.float16, 0)


def _set(i, fn):
    def mutate(x, a):
        x[i] = fn(x)
    return mutate


def _attr(**kw):
    def mutate(x, a):
        a.update(kw)
    return mutate


def _both_caches(fn):
    def mutate(x, a):
        x[KC], x[VC] = fn(x[KC]), fn(x[VC])
    return mutate


def _table(fn):
    def mutate(x, a):
        t = x[BT].clone()
        fn(t)
        x[BT] = t
    return mutate


def _head12(x, a):  # head_size 12: every width consistent, but 12 % 8 != 0
    n = x[Q].shape[0]
    x[Q], x[K], x[V] = torch.zeros(n, 48).half(), torch.zeros(n, 24).half(), \
        torch.zeros(n, 24).half()
    x[KC], x[VC] = torch.zeros(6, 16, 2, 12).half(), torch.zeros(6, 16, 2, 12).half()
    x[COS] = x[SIN] = x[QN] = x[KN] = None
    a["do_rotary"] = 0


def _shared_written_page(x, a):  # sequence 1 writes into sequence 0's last page
    t = x[BT].clone()
    t[1, 0] = t[0, 1]
    x[BT] = t
    x[PAST] = torch.tensor([17, 1], dtype=torch.int32)  # seq 1 writes positions 1..5


CASES = [
    # ranks
    ("query_rank3", _set(Q, lambda x: x[Q][None]), "query"),
    ("key_rank1", _set(K, lambda x: x[K].flatten()), "key"),
    ("key_cache_rank3", _set(KC, lambda x: x[KC][0]), "key_cache"),
    ("block_table_rank1", _set(BT, lambda x: x[BT].flatten()), "block_table"),
    ("past_rank2", _set(PAST, lambda x: x[PAST][None]), "past_seqlens"),
    # heads / head size
    ("head_size_12", _head12, "query"),
    ("kv_heads_not_dividing", _attr(kv_num_heads=3), "kv_num_heads"),
    ("num_heads_zero", _attr(num_heads=0), "num_heads"),
    ("key_width", _set(K, lambda x: x[K][:, :16]), "key"),
    ("query_width_not_multiple", _set(Q, lambda x: x[Q][:, :60]), "query"),
    # caches
    ("block_size_8", _both_caches(lambda c: c[:, :8].contiguous()), "key_cache"),
    ("block_size_24", _both_caches(lambda c: torch.cat([c, c[:, :8]], 1)), "key_cache"),
    ("cache_kv_heads", _both_caches(lambda c: torch.cat([c, c[:, :, :1]], 2)), "key_cache"),
    ("cache_head_size", _both_caches(lambda c: torch.cat([c, c[..., :8]], 3)), "key_cache"),
    ("value_cache_shape", _set(VC, lambda x: x[VC][:-1]), "value_cache"),
    ("value_cache_missing", _set(VC, lambda x: None), "value_cache"),
    ("cache_dtype_vs_query", _both_caches(lambda c: c.float()), "key_cache"),
    ("value_cache_dtype", _set(VC, lambda x: x[VC].float()), "value_cache"),
    ("k_cache_dtype_attr", _attr(k_cache_dtype="bfloat16"), "k_cache_dtype"),
    # sequence metadata
    ("cu_non_monotonic", _set(CU, lambda x: torch.tensor([0, 9, 8], dtype=torch.int32)),
     "cumulative_sequence_length"),
    ("cu_not_from_zero", _set(CU, lambda x: torch.tensor([1, 3, 8], dtype=torch.int32)),
     "cumulative_sequence_length"),
    ("cu_not_ending_at_n", _set(CU, lambda x: torch.tensor([0, 3, 7], dtype=torch.int32)),
     "cumulative_sequence_length"),
    ("cu_length_vs_past", _set(CU, lambda x: torch.tensor([0, 3, 5, 8], dtype=torch.int32)),
     "past_seqlens"),
    ("past_negative", _set(PAST, lambda x: torch.tensor([-1, 0], dtype=torch.int32)),
     "past_seqlens"),
    ("index_int64", _set(BT, lambda x: x[BT].long()), "block_table"),
    # block table
    ("block_table_rows", _set(BT, lambda x: x[BT][:1]), "block_table"),
    ("block_table_out_of_range", _table(lambda t: t.__setitem__((0, 1), 99)), "block_table"),
    ("block_table_unmapped_needed", _table(lambda t: t.__setitem__((0, 1), -1)),
     "block_table"),
    ("block_table_repeated_page", _table(lambda t: t.__setitem__((0, 1), int(t[0, 0]))),
     "block_table"),
    ("block_table_too_few_pages", _set(BT, lambda x: x[BT][:, :1]), "block_table"),
    ("pages_written_by_two_sequences", _shared_written_page, "block_table"),
    # slot mapping
    ("slot_mapping_length", _set(SLOT, lambda x: torch.zeros(7, dtype=torch.int32)),
     "slot_mapping"),
    ("slot_mapping_range", _set(SLOT, lambda x: torch.tensor([0, 1, 2, 3, 4, 5, 6, 10_000],
                                                             dtype=torch.int32)),
     "slot_mapping"),
    ("slot_mapping_below_minus_one",
     _set(SLOT, lambda x: torch.tensor([0, 1, 2, 3, 4, 5, 6, -2], dtype=torch.int32)),
     "slot_mapping"),
    ("slot_mapping_duplicate", _set(SLOT, lambda x: torch.tensor([0, 1, 2, 3, 4, 5, 6, 6],
                                                                 dtype=torch.int32)),
     "slot_mapping"),
    # Q/K/V presence and dtypes
    ("key_without_value", _set(V, lambda x: None), "value"),
    ("value_without_key", _set(K, lambda x: None), "key"),
    ("key_dtype", _set(K, lambda x: x[K].float()), "key"),
    ("query_missing", _set(Q, lambda x: None), "query"),
    # rotary
    ("rotary_without_cos", lambda x, a: x.__setitem__(slice(COS, SIN + 1), [None, None]),
     "cos_cache"),
    ("cos_without_sin", _set(SIN, lambda x: None), "sin_cache"),
    ("cos_dim1_not_multiple_of_8", lambda x, a: x.__setitem__(
        slice(COS, SIN + 1), [x[COS][:, :4], x[SIN][:, :4]]), "cos_cache"),
    ("sin_shape", _set(SIN, lambda x: x[SIN][:-1]), "sin_cache"),
    ("positions_beyond_cos", lambda x, a: x.__setitem__(
        slice(COS, SIN + 1), [x[COS][:10], x[SIN][:10]]), "cos_cache"),
    ("rotary_offset_not_multiple_of_8", _attr(rotary_offset=4), "rotary_offset"),
    ("rotary_offset_past_head", _attr(rotary_offset=8), "rotary_offset"),
    # per-head optional inputs
    ("q_norm_without_k_norm", _set(KN, lambda x: None), "k_norm_weight"),
    ("k_norm_without_q_norm", _set(QN, lambda x: None), "q_norm_weight"),
    ("q_norm_shape", _set(QN, lambda x: x[QN][:8]), "q_norm_weight"),
    ("qk_norm_epsilon_zero", _attr(qk_norm_epsilon=0.0), "qk_norm_epsilon"),
    ("head_sink_shape", _set(SINK, lambda x: x[SINK][:2]), "head_sink"),
    # attention_metadata
    ("metadata_length_4", _set(META, lambda x: torch.tensor([5, 20, 20, 1], dtype=torch.int32)),
     "attention_metadata"),
    ("metadata_negative", _set(META, lambda x: torch.tensor([-1, 20], dtype=torch.int32)),
     "attention_metadata"),
    ("metadata_query_underestimate",
     _set(META, lambda x: torch.tensor([4, 20], dtype=torch.int32)), "attention_metadata"),
    ("metadata_kv_underestimate",
     _set(META, lambda x: torch.tensor([5, 19], dtype=torch.int32)), "attention_metadata"),
    ("metadata_lower_bound_above_upper",
     _set(META, lambda x: torch.tensor([5, 20, 21], dtype=torch.int32)), "attention_metadata"),
    ("metadata_lower_bound_above_actual",
     _set(META, lambda x: torch.tensor([5, 0, 21], dtype=torch.int32)), "attention_metadata"),
    # attributes
    ("is_causal_2", _attr(is_causal=2), "is_causal"),
    ("do_rotary_float", _attr(do_rotary=1.0), "do_rotary"),
    ("layout_unknown", _attr(kv_cache_layout="PAGED"), "kv_cache_layout"),
    ("quant_type_unknown", _attr(k_quant_type="PER_ROW"), "k_quant_type"),
    ("softcap_negative", _attr(softcap=-1.0), "softcap"),
    ("scale_nan", _attr(scale=float("nan")), "scale"),
    ("local_window_zero", _attr(local_window_size=0), "local_window_size"),
    ("v_head_size_separate", _attr(v_head_size=8), "v_head_size"),
    ("unknown_attribute", _attr(bogus=1), "bogus"),
]


def test_base_call_is_valid():
    inputs, attrs = base()
    pa.paged_attention(*inputs, **attrs)


def test_slot_mapping_base_is_valid():
    inputs, attrs = base()
    inputs[SLOT] = torch.tensor([0, 1, -1, 3, 4, -1, 6, 7], dtype=torch.int32)
    pa.paged_attention(*inputs, **attrs)


@pytest.mark.parametrize(("mutate", "where"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_contract_violation(mutate, where):
    inputs, attrs = base()
    if where == "slot_mapping":
        inputs[SLOT] = torch.arange(8, dtype=torch.int32)
    mutate(inputs, attrs)
    caches = [t.clone() if t is not None else None for t in (inputs[KC], inputs[VC])]
    with pytest.raises(ContractViolation) as info:
        if "bogus" in attrs:  # not a keyword of the public function: through validate()
            pa.validate(inputs, attrs)
        else:
            pa.paged_attention(*inputs, **attrs)
    err = info.value
    assert err.where == where, str(err)
    assert f"'{where}'" in str(err) and err.op == "com.microsoft.PagedAttention"
    # nothing was written before the rejection
    for before, after in zip(caches, (inputs[KC], inputs[VC]), strict=True):
        assert before is None or torch.equal(before, after)
