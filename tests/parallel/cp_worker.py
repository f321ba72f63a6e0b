"""Per-rank body of the gloo CP tests (run by ``pagedhybrid.parallel.launch.run_gloo``).

Every rank runs every case: its CP shard through ``context_parallel_attention`` over the real
gloo group, and the same global problem as a CP = 1 call in the same process. It reports, per
case, whether its rows are bitwise equal to the CP = 1 rows and the max error against the
float64 dense oracle. Float collectives that could sum (``all_reduce``, ``reduce_scatter``) are
replaced by functions that raise, proving the CP path never reduces floats in a collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from cp_cases import (
    DECODE_CASES,
    PREFILL_CASES,
    Q_BLOCK,
    PrefillCase,
    decode_oracle,
    decode_shard,
    prefill_contract,
    prefill_global,
    prefill_oracle,
    prefill_shard,
)

from pagedhybrid.attention.contract import AttentionContract
from pagedhybrid.attention.cp_plan import is_cache_mode
from pagedhybrid.attention.layouts import cp_sharding
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.parallel import context_parallel_attention

QB = Q_BLOCK


def _forbid(name: str) -> None:
    def raiser(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"deterministic CP must not call dist.{name}")

    setattr(dist, name, raiser)


def _errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
            ) -> dict[str, float]:
    """Max absolute error and max error relative to max(1, |reference|) (fp32 spacing grows
    with magnitude: an LSE near 6 is only representable to 4.8e-7)."""
    res = {}
    for name, got, ref in (("out", out, ref_out), ("lse", lse, ref_lse)):
        err = (got.double() - ref).abs()
        res[f"err_{name}"] = err.max().item()
        res[f"rel_{name}"] = (err / ref.abs().clamp(min=1.0)).max().item()
    return res


def _prefill(case: PrefillCase, rank: int, world: int) -> dict[str, Any]:
    contract, coords, (q, k, v) = prefill_shard(case, world, rank)
    out, lse = context_parallel_attention(q, k, v, contract=contract, query_block_size=QB)
    gq, gk, gv = prefill_global(case)
    c1 = prefill_contract(case, 1, 0)
    out1, lse1 = context_parallel_attention(gq, gk, gv, contract=c1, query_block_size=QB)
    ref_out, ref_lse = prefill_oracle(case, gq, gk, gv)
    res = {"bitwise_out": torch.equal(out, out1[coords]),
           "bitwise_lse": torch.equal(lse, lse1[coords]),
           "dtype_out": str(out.dtype), "dtype_lse": str(lse.dtype),
           **_errors(out, lse, ref_out[coords], ref_lse[coords])}
    if case.dtype == "bf16":  # bf16 in -> fp32 merge -> one bf16 write == fp32 path cast once
        f32 = prefill_contract(PrefillCase(**{**case.__dict__, "dtype": "fp32"}), world, rank)
        o32, l32 = context_parallel_attention(q.float(), k.float(), v.float(), contract=f32,
                                              query_block_size=QB)
        res["bf16_is_fp32_cast_once"] = torch.equal(out, o32.to(torch.bfloat16))
        res["bf16_lse_is_fp32_lse"] = torch.equal(lse, l32)
    return res


def _decode(case: Any, rank: int, world: int) -> dict[str, Any]:
    contract, (q, kc, vc) = decode_shard(case, world, rank)
    assert is_cache_mode(contract)
    out, lse = context_parallel_attention(q, kc, vc, contract=contract, query_block_size=QB)
    c1, (q1, kc1, vc1) = decode_shard(case, 1, 0)
    out1, lse1 = context_parallel_attention(q1, kc1, vc1, contract=c1, query_block_size=QB)
    ref_out, ref_lse = decode_oracle(case)
    return {"bitwise_out": torch.equal(out, out1), "bitwise_lse": torch.equal(lse, lse1),
            "dtype_out": str(out.dtype), "dtype_lse": str(lse.dtype),
            **_errors(out, lse, ref_out, ref_lse)}


def _rejections(rank: int, world: int) -> dict[str, str]:
    """Calls that one rank (or the layout) gets wrong must fail on every rank, not hang."""
    case = PREFILL_CASES[2]
    out: dict[str, str] = {}
    contract, _, (q, k, v) = prefill_shard(case, world, rank)

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "no error"
        except (ContractViolation, UnsupportedConfiguration) as e:
            out[name] = f"{type(e).__name__}: {e}"

    # rank 1 passes a wrongly shaped key: everyone raises
    bad_k = k[:-1] if rank == 1 else k
    attempt("bad_shape_on_one_rank",
            lambda: context_parallel_attention(q, bad_k, v, contract=contract))
    # rank 0 disagrees about the causal offsets: everyone raises
    other = AttentionContract.from_dict({**contract.to_dict(), "causal_offsets": [1, 0]})
    attempt("contracts_disagree",
            lambda: context_parallel_attention(q, k, v, contract=other if rank == 0 else contract))
    # zigzag chunks of 4 tokens with a KV tile of 8: a tile would straddle two ranks
    wide = AttentionContract.from_dict(
        {**contract.to_dict(), "reduction": {**contract.reduction.to_dict(), "kv_block_size": 8}})
    sh = cp_sharding((16, 16), cp_world_size=world, cp_rank=rank, scheme="zigzag",
                     global_q_heads=4, global_kv_heads=2)
    wide = AttentionContract.from_dict({**wide.to_dict(), "sharding": sh.to_dict(),
                                        "query_sequence_length": sh.local_sequence_length})
    n = sh.local_sequence_length
    attempt("tile_split_across_ranks", lambda: context_parallel_attention(
        q[:n], k[:n], v[:n], contract=wide))
    return out


def cp_worker(rank: int, world: int) -> dict[str, Any]:
    _forbid("all_reduce")
    _forbid("reduce_scatter")
    _forbid("reduce_scatter_tensor")
    results: dict[str, Any] = {}
    for case in PREFILL_CASES:
        results[case.name] = _prefill(case, rank, world)
    for dcase in DECODE_CASES:
        results[dcase.name] = _decode(dcase, rank, world)
    results["rejections"] = _rejections(rank, world)
    return results
