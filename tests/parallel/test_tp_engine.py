"""Tensor-parallel serving: the engine with ``tensor_parallel_size=2`` on real ranks.

Rank 0 is this process (``LLM(tensor_parallel_size=2)``); rank 1 is a real worker process
started by the ``mp`` executor (``python -m pagedhybrid.engine.worker.distributed``), joined
over gloo.
Greedy outputs equal TP=1's on the built-in model and on random checkpoints (one with a single
KV head and linear key head, replicated on both ranks), through chunked prefill, prefix-cache
hits, an abort, preemption and n-gram speculative decoding; both ranks ran the same steps on
pools of the same sizes. A rank killed mid-run fails the requests with its name and exit code,
never a hang; bad TP sizes are refused before any rank starts. MTP drafts: the head's steps
run on both ranks. torchrun-style
``external_launcher``: two ``pagedhybrid generate`` processes with ``RANK`` 0 / 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams
from pagedhybrid.errors import ContractViolation, EngineDead
from pagedhybrid.models.qwen35 import default_model_dir, load
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config, write_checkpoint
from pagedhybrid.serve.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "And the children of Israel went up out of Egypt, and",
           "In the beginning God created the heaven and the earth. And the earth was without "
           "form, and void; and darkness was upon the face of the deep."]
OPTS: dict[str, Any] = {"dtype": "float32", "num_blocks": 48, "max_num_seqs": 4,
                        "max_num_batched_tokens": 24, "state_checkpoint_interval": 16}


def _run(llm: LLM, prompts: list[Any], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_progress=False)]


def _invariants(llm: LLM) -> None:
    """Rank 0's pools add up; every rank has the same pools and ran the same steps."""
    engine = llm.engine
    engine.check_invariants()
    peers = engine.runner.peers
    assert peers is not None and peers.dead is None
    mine = engine.runner.rank_state()
    for state in peers.check():
        assert state["rank"] == 1
        assert state["steps"] == engine.stats.steps
        assert {k: state[k] for k in mine} == mine


@pytest.fixture(scope="module")
def tp1() -> LLM:
    return LLM(None, **OPTS)


@pytest.fixture(scope="class")
def tp2() -> Any:
    """One tensor-parallel engine per process: each test's closes before the next starts."""
    with LLM(None, tensor_parallel_size=2, **OPTS) as llm:
        yield llm
    assert llm.engine.dead == "the engine was closed"
    with pytest.raises(EngineDead):
        llm.engine.add_request("x", PROMPTS[0], GREEDY)


class TestBuiltinModelTP2:
    """TP=2 on the built-in model (one engine for these tests, closed after them)."""

    def test_greedy_equals_tp1(self, tp1: LLM, tp2: LLM) -> None:
        peers = tp2.engine.runner.peers
        assert peers is not None and peers.world_size == 2 and peers.executor == "mp"
        assert tp2.engine.model.config.num_attention_heads * 2 == \
            tp1.engine.model.config.num_attention_heads  # rank 0 holds half the heads
        assert _run(tp2, PROMPTS) == _run(tp1, PROMPTS)  # chunked: 24-token steps
        _invariants(tp2)


    def test_prefix_hits_and_an_abort(self, tp1: LLM, tp2: LLM) -> None:
        shared = PROMPTS[2] + " And God said, Let there be light"
        want = _run(tp1, [shared])
        engine = tp2.engine
        before = engine.prefix_cache_stats()["hit_tokens"]
        outs = tp2.generate([shared, shared], GREEDY, use_progress=False)
        assert [list(o.token_ids) for o in outs] == want * 2
        assert engine.prefix_cache_stats()["hit_tokens"] > before  # the second one hit
        # an abort mid-decode frees its pages at once; the others go on
        engine.add_request("stay", PROMPTS[1], GREEDY)
        engine.add_request("gone", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                              ignore_eos=True))
        for _ in range(6):
            engine.step()
        assert engine.abort_request("gone") == ["gone"]
        done = {o.request_id: o for o in engine.stream() if o.finished}
        assert done["gone"].finish_reason == "abort"
        assert list(done["stay"].token_ids) == _run(tp1, [PROMPTS[1]])[0]
        _invariants(tp2)


def test_tp2_preemption_and_ngram_speculation_equal_tp1(tmp_path: Path) -> None:
    """Few pages: requests are preempted and recomputed; n-gram drafts verified and rolled
    back on both ranks (the commit goes to every rank)."""
    opts = {**OPTS, "num_blocks": 8, "max_num_seqs": 3,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [p + " the LORD the LORD the LORD" for p in PROMPTS]
    want = _run(LLM(None, **opts), prompts, params)
    with LLM(None, tensor_parallel_size=2, **opts) as llm:
        outs = llm.generate(prompts, params, use_progress=False)
        assert [list(o.token_ids) for o in outs] == want
        assert sum(s.num_preemptions for o in outs for s in o.sequences) > 0
        spec = llm.engine.stats.spec  # drafts accepted, and some rejected (rolled back)
        assert 0 < spec.accepted_tokens < spec.draft_tokens
        _invariants(llm)


def test_tp2_mtp_drafts_keep_the_greedy_output() -> None:
    """The MTP head's catch-up and chain steps run on both ranks (the head's attention is split
    like the model's); greedy output is the plain TP=1 run's, and drafts are accepted."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _run(LLM(None, **OPTS), PROMPTS, params)
    with LLM(None, tensor_parallel_size=2, speculative_config=spec, **OPTS) as llm:
        assert _run(llm, PROMPTS, params) == want
        assert llm.engine.stats.spec.accepted_tokens > 0
        _invariants(llm)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp2_greedy_and_score_equal_tp1_on_random_checkpoints(tmp_path: Path,
                                                              kv_heads: int) -> None:
    """kv_heads=1: one KV head and one linear key head, replicated on both ranks. The training
    recompute (``score``) runs on both ranks too and reproduces the rollout's logprobs
    bitwise in batch-invariant mode."""
    cfg = dataclasses.replace(tiny_byte_config(), num_key_value_heads=kv_heads,
                              linear_num_key_heads=kv_heads)
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=11))
    prompts = [[5, 9, 200, 31, 7, 7, 64, 12, 3, 99, 150, 18, 4, 4, 4, 80, 81, 82, 11, 1],
               [17, 18, 19, 20, 21, 22, 23], [250, *range(40, 72)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    opts = {**OPTS, "batch_invariant": True}
    ref = LLM(str(tmp_path), **opts).generate(prompts, params, use_progress=False)
    with LLM(str(tmp_path), tensor_parallel_size=2, **opts) as llm:
        assert llm.engine.kernels.backend.name == "native_batch_invariant"
        outs = llm.generate(prompts, params, use_progress=False)
        assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in ref]
        for o, r in zip(outs, ref, strict=True):  # rounding only (the all-reduce's order)
            for a, b, t in zip(o.logprobs, r.logprobs, o.token_ids, strict=True):
                assert abs(a[t].logprob - b[t].logprob) < 1e-3
        scored = llm.score(prompts, [list(o.token_ids) for o in outs])
        assert scored == [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids, strict=True)]
                          for o in outs]
        _invariants(llm)


def test_tp2_with_int8_kv_pages_and_int4_weights_equals_tp1() -> None:
    """Each rank keeps its own KV heads' scales from the checkpoint's scale file and quantises
    its own slice of every projection (the same codes: blocks of 32 along K never straddle
    ranks). Within rounding: the same greedy tokens for the first 8, with TP=1's logprobs to
    0.05 -- the all-reduce's summation order (and TP's unfused decode path) move activations
    by an ulp, which can flip an int8 activation code: measured up to 0.014 here, where a
    sharding error moves logprobs by O(1); a greedy run may part at a near-tie after that, as
    it did here at the 12th token."""
    opts = {**OPTS, "kv_cache_dtype": "int8", "quantization": "int4"}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    ref = LLM(None, **opts).generate(PROMPTS, params, use_progress=False)
    with LLM(None, tensor_parallel_size=2, **opts) as llm:
        assert llm.engine.cache.kv_scales[3].k.shape[0] == 1  # one of the 2 KV heads
        assert llm.engine.model.weight_format is not None
        outs = llm.generate(PROMPTS, params, use_progress=False)
        for o, r in zip(outs, ref, strict=True):
            assert list(o.token_ids)[:8] == list(r.token_ids)[:8]
            for j, t in enumerate(r.token_ids[:8]):
                assert abs(o.logprobs[j][t].logprob - r.logprobs[j][t].logprob) < 0.05
        _invariants(llm)


def test_a_killed_rank_fails_the_requests_without_a_hang() -> None:
    with LLM(None, tensor_parallel_size=2, **OPTS) as llm:
        engine = llm.engine
        peers = engine.runner.peers
        assert peers is not None
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=200,
                                                         ignore_eos=True))
        engine.step()
        proc = peers.ranks[0].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        outs = []
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 30:
            outs.extend(o for o in engine.step() if o.finished)
        assert time.monotonic() - t0 < 30, "the engine hung on a dead rank"
        assert sorted(o.request_id for o in outs) == ["0", "1", "2"]
        for o in outs:
            assert o.finish_reason == "error"
            assert "rank 1 exited with code -9" in (o.error or ""), o.error
        assert engine.dead is not None and "rank 1" in engine.dead
        with pytest.raises(EngineDead, match="rank 1"):
            engine.add_request("late", PROMPTS[0], GREEDY)


def test_bad_tensor_parallel_sizes_are_refused_before_any_rank_starts(tmp_path: Path) -> None:
    with pytest.raises(ContractViolation, match=r"tensor_parallel_size.*num_attention_heads"):
        LLM(None, tensor_parallel_size=3, **OPTS)  # 8 heads do not split 3 ways
    cores = os.cpu_count() or 1
    cfg = dataclasses.replace(tiny_byte_config(), num_attention_heads=8, num_key_value_heads=8,
                              linear_num_key_heads=8, linear_num_value_heads=8,
                              intermediate_size=8 * 32)
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=1))
    w = 2 * cores if (2 * cores) <= 8 else 8
    if w > cores:
        with pytest.raises(ContractViolation, match=r"tensor_parallel_size.*cores"):
            LLM(str(tmp_path), tensor_parallel_size=w, **OPTS)
    with pytest.raises(ContractViolation, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ContractViolation, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ContractViolation, match=r"tensor_parallel_size.*other ranks"):
        Engine(load(default_model_dir(), dtype=torch.float32),
               EngineConfig(tensor_parallel_size=2, num_blocks=8))
    with pytest.raises(ContractViolation, match="external_launcher needs MASTER_ADDR"):
        env = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "RANK") if k in os.environ}
        try:
            LLM(None, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                **OPTS)
        finally:
            os.environ.update(env)


@pytest.mark.parametrize("launcher", ["env", "torchrun"])
def test_external_launcher_ranks_generate_as_tp1(tp1: LLM, launcher: str) -> None:
    """Every rank runs the same ``pagedhybrid generate`` command; rank 1 serves rank 0's steps
    and exits 0. ``env``: MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK set by hand (rank 0
    hosts the store); ``torchrun``: the real launcher (its agent hosts the store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "pagedhybrid", "generate", "--json", "--max-tokens", "12", "--ignore-eos",
            "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--tensor-parallel-size", "2",
            "--distributed-executor-backend", "external_launcher", "--dtype", "float32",
            "--num-blocks", "48", "--max-num-seqs", "4"]
    if launcher == "torchrun":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        logs = Path(tempfile.mkdtemp())  # torchrun keeps each rank's stdout there
        cmds = [([torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                  "127.0.0.1", "--master-port", str(port), "--redirects", "3", "--log-dir",
                  str(logs), *args], dict(os.environ))]
    else:
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "WORLD_SIZE": "2"}
        cmds = [([sys.executable, *args], {**base, "RANK": str(r)}) for r in (0, 1)]
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c, e in cmds]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    text = outs[0][0] if launcher == "env" else next(logs.glob("**/0/stdout.log")).read_text()
    doc = json.loads(text)
    assert [o["token_ids"] for o in doc["outputs"]] == _run(tp1, PROMPTS[:2])
