"""Engine end to end on a tiny real checkpoint, against HF transformers ``generate``.

Every comparison is exact (greedy, fp32): batched == alone == HF. Pools are filled with random
garbage (``cache_fill=None``) unless a test says otherwise -- pages and slots are never zeroed by
the engine, so garbage must not change any output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt_of

from pagedhybrid.engine import (
    Engine,
    EngineConfig,
    InputBatch,
    InvalidRequest,
    SamplingParams,
    SequenceOutput,
    load_engine,
)
from pagedhybrid.engine.core.scheduler import SchedulerOutput
from pagedhybrid.engine.worker.input_batch import StepPlan
from pagedhybrid.errors import CapacityError, ContractViolation
from pagedhybrid.models.qwen35 import ABI_INPUT_NAMES, PackedBatch, Qwen35ForCausalLM, load
from pagedhybrid.serve.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_all(engine: Engine, check: bool = True) -> dict[str, SequenceOutput]:
    final: dict[str, SequenceOutput] = {}
    for out in engine.stream():
        if check:
            engine.check_invariants()
        if out.finished:
            final[out.request_id] = out
    assert engine.blocks.num_free == engine.blocks.capacity
    assert engine.states.num_free == engine.states.capacity
    return final


@pytest.mark.parametrize("block_size", [16, 32])
def test_staggered_batch_with_preemption_matches_alone_and_hf(
        make_engine: Callable[..., Engine], hf_greedy: Callable[..., list[int]],
        block_size: int) -> None:
    lengths = [3, 45, 20, 70, 9]
    prompts = [prompt_of(i, n) for i, n in enumerate(lengths)]
    outs = [12, 5, 10, 8, 12]
    # Tight pools: 5 pages of 16 (or 3 of 32) tokens and 2 slots force preemption.
    engine = make_engine(block_size=block_size, num_blocks=5 if block_size == 16 else 3,
                         num_state_slots=2, max_num_seqs=3, max_num_batched_tokens=24,
                         cache_fill=None)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    final: dict[str, SequenceOutput] = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # arrivals while others are mid-prefill or decoding
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params[i])
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_invariants()
        step += 1
    assert engine.stats.preemptions > 0, "the pools were meant to force preemption"
    assert engine.blocks.num_free == engine.blocks.capacity
    assert engine.states.num_free == engine.states.capacity
    for i, p in enumerate(prompts):
        want = hf_greedy(p, outs[i])
        assert list(final[f"r{i}"].token_ids) == want, f"r{i} vs HF"
        assert final[f"r{i}"].finish_reason == "length"
    # the same requests alone, with zeroed pools, give the same tokens
    for i in (1, 3):
        alone = make_engine(block_size=block_size, num_blocks=8, max_num_seqs=1)
        alone.add_request("x", prompts[i], params[i])
        assert list(run_all(alone)["x"].token_ids) == list(final[f"r{i}"].token_ids)


def test_batch_is_the_packed_abi(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(block_size=16, num_blocks=16, max_num_batched_tokens=24)
    engine.add_request("a", prompt_of(0, 5), GREEDY)
    engine.step()
    engine.add_request("b", prompt_of(1, 40), GREEDY)
    sched = engine.scheduler.schedule()
    step = InputBatch(engine.cache)
    plan = step.update(sched)
    batch, meta, rows = step.batch, step.meta, step.rows
    sampling, sample_rows, spans, verify = (plan.sampling, plan.sample_rows, plan.prompt_spans,
                                            plan.verify_rows)
    assert isinstance(batch, PackedBatch)
    assert set(ABI_INPUT_NAMES) <= set(PackedBatch._fields)
    (a, b) = sched.sequences
    assert (a.start, a.num_new_tokens, b.start, b.num_new_tokens) == (5, 1, 0, 23)
    assert batch.input_ids.dtype == torch.int64
    assert batch.input_ids.tolist() == [a.request.token_ids[5], *prompt_of(1, 40)[:23]]
    assert batch.position_ids.dtype == torch.int64 and batch.position_ids.shape == (3, 24)
    assert batch.position_ids.tolist() == [[5, *range(23)]] * 3
    for name in ("cu_seqlens", "past_seqlens", "block_table", "state_slots",
                 "attention_metadata"):
        assert getattr(batch, name).dtype == torch.int32, name
    assert batch.cu_seqlens.tolist() == [0, 1, 24]
    assert batch.past_seqlens.tolist() == [5, 0]
    assert batch.block_table.tolist() == [[*a.block_table, -1], list(b.block_table)]
    assert batch.state_slots.tolist() == [a.slot, b.slot] and a.slot != b.slot
    assert batch.attention_metadata.tolist() == [23, 23, 23]
    assert rows.tolist() == [0] and sampling == [0]  # b's chunk does not reach its last token
    assert sample_rows == [0] and spans == [] and verify == []  # no prompt logprobs, no drafts
    # the step object the other tensor-parallel ranks get: plain ints, built from the lists
    assert plan.write_slots is None and list(plan.token_ids) == batch.input_ids.tolist()
    assert (list(plan.q_lens), list(plan.starts), list(plan.rows)) == ([1, 23], [5, 0], [0])
    # the step metadata every layer reads: lengths, page slots written, state rows, fresh mask
    assert (meta.q_lens, meta.past_lens, meta.decode, meta.multi) == ((1, 23), (5, 0), (0,), (1,))
    assert meta.fresh == (False, True) and meta.state_slots.tolist() == [a.slot, b.slot]
    want = [a.block_table[5 // 16] * 16 + 5] + [b.block_table[p // 16] * 16 + p % 16
                                                 for p in range(23)]
    assert meta.write_slots.tolist() == want
    engine.abort_request(["a", "b"])


def _same_step(a: InputBatch, b: InputBatch) -> None:
    for name in PackedBatch._fields:
        assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
    ma, mb = a.meta, b.meta
    for name in ("cu_seqlens_t", "past_t", "block_table", "state_slots", "fresh_t", "positions",
                 "write_slots"):
        assert torch.equal(getattr(ma, name), getattr(mb, name)), name
        assert getattr(ma, name).dtype == getattr(mb, name).dtype, name
    for name in ("q_lens", "past_lens", "cu_seqlens", "decode", "multi", "checkpoints"):
        assert getattr(ma, name) == getattr(mb, name), name
    assert a.rows == b.rows and a.requests == b.requests
    assert (list(a.plan.sampling), list(a.plan.sample_rows), list(a.plan.prompt_spans)) == (
        list(b.plan.sampling), list(b.plan.sample_rows), list(b.plan.prompt_spans))


def test_the_step_log_keeps_the_last_steps(make_engine: Callable[..., Engine],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A server steps for days: the per-step log is bounded (``stats.STEP_LOG``), not a list
    that grows with every step."""
    from pagedhybrid.engine.core import stats

    monkeypatch.setattr(stats, "STEP_LOG", 3)
    engine = make_engine(block_size=16, num_blocks=16)
    engine.add_request("a", prompt_of(0, 5), GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.stats.steps == 6 and len(engine.stats.step_log) == 3
    assert [n for n, _, _, _ in engine.stats.step_log] == [1, 1, 1]
    share, steps = engine.stats.overhead_at(1)
    assert steps == 3 and 0.0 < share < 1.0


def test_a_decode_step_advanced_from_the_last_equals_one_built_from_lists(
        make_engine: Callable[..., Engine]) -> None:
    """The runner's persistent batch: every step it advances from the previous one equals, field
    for field, the step built from the scheduler's lists -- across page boundaries, a
    one-token prompt (fresh state), requests joining and finishing, prefix hits and prompt
    logprobs (which must not advance) -- and the tokens equal a run that always builds anew."""
    def run(check: bool) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(block_size=16, num_blocks=64, max_num_seqs=4,
                             max_num_batched_tokens=16, enable_prefix_caching=True)
        advanced = [0]
        step = engine.runner.input_batch
        step.persistent = check
        orig = step.update

        def update(out: SchedulerOutput) -> StepPlan:
            plan = orig(out)
            if step.advanced:  # advanced from the last step (its tensors reused)
                advanced[0] += 1
                assert step.inputs is not None
                assert step.batch.input_ids.data_ptr() == step.inputs._i64[2].data_ptr()
                fresh = InputBatch(engine.cache)
                fresh.update(out)
                _same_step(step, fresh)
            return plan

        step.update = update  # type: ignore[method-assign]
        try:
            final: dict[str, list[int]] = {}
            prompts = [[7], prompt_of(1, 9), prompt_of(2, 6), prompt_of(1, 9)]  # a prefix hit
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                     prompt_logprobs=2 if n == 7 else None)
                      for n in (40, 12, 7, 14)]
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(f"r{i}", p, sp)
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = list(out.token_ids)
            for rid, out in run_all(engine).items():
                final[rid] = list(out.token_ids)
            return final, advanced[0]
        finally:
            del step.update

    got, advanced = run(True)
    assert advanced >= 25, "most decode steps should advance from the last"
    assert got == run(False)[0]


def test_one_token_prompt_chunks_beside_a_decode_are_not_taken_for_its_successor(
        make_engine: Callable[..., Engine]) -> None:
    """With a budget of 2 tokens, a prompt is prefilled a token a step beside a decoding
    request: every step is one token per sequence, but the prompt's steps sample nothing for
    it. The step where it reaches its last prompt token must sample it (not reuse the last
    step's sampling rows), so both requests give the tokens they give alone."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {"a": prompt_of(3, 1), "b": prompt_of(4, 7)}
    want = {}
    for rid, prompt in prompts.items():
        alone = make_engine(num_blocks=16, max_num_seqs=1)
        alone.add_request(rid, prompt, params)
        want[rid] = list(run_all(alone)[rid].token_ids)
    engine = make_engine(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=2)
    for rid, prompt in prompts.items():  # a: one prompt token, then decodes; b: a token a step
        engine.add_request(rid, prompt, params)
    step, seen = engine.runner.input_batch, []
    orig = step.update

    def update(out: SchedulerOutput) -> StepPlan:
        seen.append(tuple(s.num_new_tokens for s in out.sequences))
        return orig(out)

    step.update = update  # type: ignore[method-assign]
    got = {rid: list(out.token_ids) for rid, out in run_all(engine).items()}
    assert seen[:7] == [(1, 1)] * 7, seen  # the case meant: one token per sequence throughout
    assert got == want


def test_seeded_sampling_same_alone_and_in_batch(make_engine: Callable[..., Engine]) -> None:
    mine = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=10,
                          ignore_eos=True)
    prompt = prompt_of(5, 17)
    alone = make_engine(num_blocks=8, max_num_seqs=1)
    alone.add_request("me", prompt, mine)
    want = run_all(alone)["me"].token_ids
    batched = make_engine(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16,
                          cache_fill=None, seed=99)
    batched.add_request("other0", prompt_of(6, 30), SamplingParams(temperature=1.0,
                                                                   max_tokens=10))
    batched.step()
    batched.add_request("me", prompt, mine)
    batched.add_request("other1", prompt_of(7, 4), SamplingParams(temperature=1.5, seed=1,
                                                                  max_tokens=10))
    got = run_all(batched)["me"].token_ids
    assert got == want
    greedy = make_engine(num_blocks=8, max_num_seqs=1)
    greedy.add_request("g", prompt, GREEDY)
    assert run_all(greedy)["g"].token_ids[:10] != want  # really sampled


def test_abort_mid_prefill_and_mid_decode(make_engine: Callable[..., Engine],
                                          hf_greedy: Callable[..., list[int]]) -> None:
    engine = make_engine(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
                         cache_fill=None)
    engine.add_request("pre", prompt_of(10, 60), GREEDY)
    engine.add_request("keep", prompt_of(11, 6), GREEDY)
    engine.step()
    req = engine.scheduler.requests["pre"]
    assert 0 < req.num_computed_tokens < 60 and engine.blocks.has("pre")
    assert engine.abort_request("pre") == ["pre"]
    assert not engine.blocks.has("pre") and not engine.states.has("pre")
    engine.check_invariants()
    engine.add_request("dec", prompt_of(12, 4), GREEDY)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("pre", "abort")]
    engine.step()
    assert engine.scheduler.requests["dec"].num_output_tokens > 0
    owned = engine.blocks.num_owned
    engine.abort_request("dec")
    assert engine.blocks.num_owned < owned and not engine.states.has("dec")
    engine.check_invariants()
    final = run_all(engine)
    assert final["dec"].finish_reason == "abort"
    assert list(final["keep"].token_ids) == hf_greedy(prompt_of(11, 6), 12)
    assert engine.abort_request("nope") == []


def test_bad_requests_are_rejected_and_others_carry_on(
        make_engine: Callable[..., Engine], hf_greedy: Callable[..., list[int]]) -> None:
    engine = make_engine(block_size=16, num_blocks=4, max_num_seqs=2)
    engine.add_request("ok", prompt_of(20, 9), GREEDY)
    engine.step()
    for rid, prompt, match in [("e1", [], "empty"), ("e2", [1, -3], "ints"),
                               ("e3", [1, 258], "ints"), ("e4", [1.5, 2], "ints"),
                               ("e5", "text", "tokenizer"), ("ok", [1], "in use")]:
        with pytest.raises(InvalidRequest, match=match):
            engine.add_request(rid, prompt, GREEDY)
    with pytest.raises(CapacityError, match="no room"):
        engine.add_request("long", [1] * 64, GREEDY)  # the whole pool is 4 x 16 tokens
    with pytest.raises(ContractViolation, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert set(engine.scheduler.requests) == {"ok"}
    final = run_all(engine)
    assert list(final["ok"].token_ids) == hf_greedy(prompt_of(20, 9), 12)


def test_failing_request_finishes_with_error_others_unaffected(
        tiny_dir: object, hf_greedy: Callable[..., list[int]]) -> None:
    model = load(tiny_dir)  # a private copy: one token's embedding becomes NaN
    poison = 200
    model.model.embed_tokens.weight[poison] = float("nan")
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=6, max_num_seqs=3,
                                        max_num_batched_tokens=32))
    good = [prompt_of(30, 12), prompt_of(31, 25)]
    good = [[t if t != poison else 1 for t in p] for p in good]
    engine.add_request("g0", good[0], GREEDY)
    engine.add_request("bad", [5, poison, 7, 9], GREEDY)
    engine.add_request("g1", good[1], GREEDY)
    final = run_all(engine)
    assert final["bad"].finish_reason == "error" and "non-finite" in (final["bad"].error or "")
    for i in (0, 1):
        assert list(final[f"g{i}"].token_ids) == hf_greedy(good[i], 12)
    # the NaN-filled pages and slot are reused by later requests without any effect
    engine.add_request("g2", good[1], GREEDY)
    assert list(run_all(engine)["g2"].token_ids) == hf_greedy(good[1], 12)


def test_stop_tokens_max_tokens_and_logprobs(make_engine: Callable[..., Engine],
                                             hf_model: torch.nn.Module,
                                             hf_greedy: Callable[..., list[int]]) -> None:
    prompt = prompt_of(40, 11)
    want = hf_greedy(prompt, 12)
    stop = want[4]
    first = want.index(stop)
    engine = make_engine(num_blocks=16, max_num_seqs=4)
    engine.add_request("stop", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                      stop_token_ids=(stop,)))
    engine.add_request("len", prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                     ignore_eos=True))
    engine.add_request("lp", prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True, logprobs=3))
    final = run_all(engine)
    assert final["stop"].finish_reason == "stop"
    assert list(final["stop"].token_ids) == want[: first + 1]
    assert final["len"].finish_reason == "length" and list(final["len"].token_ids) == want[:3]
    # logprobs: the top-3 of HF's own distribution at each generated position
    ids = torch.tensor([prompt + want[:6]])
    with torch.no_grad():
        ref = hf_model(ids).logits[0, len(prompt) - 1: len(prompt) + 5].log_softmax(-1)
    lps = final["lp"].logprobs
    assert lps is not None and len(lps) == 6
    for j, entry in enumerate(lps):
        top = ref[j].topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        for tok, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[tok].logprob == pytest.approx(v, abs=1e-4)
        assert want[j] in entry and entry[want[j]].rank == 1


def test_streaming_and_llm_generate(tiny_dir: object, hf_greedy: Callable[..., list[int]],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(str(tiny_dir), num_blocks=16, max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [prompt_of(50, 7), prompt_of(51, 30), prompt_of(52, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6)]
    got: dict[str, list[int]] = {}
    finished = set()
    for out in llm.stream(prompts, params):
        assert out.request_id not in finished
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert list(out.token_ids) == got[out.request_id]  # deltas add up to the total
        if out.finished:
            finished.add(out.request_id)
    assert len(finished) == 3
    for rid, toks in got.items():
        i = int(rid.split("-")[1])
        assert toks == hf_greedy(prompts[i], params[i].max_tokens)
    results = llm.generate(prompts, params)
    assert [list(r.token_ids) for r in results] == [hf_greedy(p, q.max_tokens)
                                                    for p, q in zip(prompts, params,
                                                                    strict=True)]
    err = capsys.readouterr().err
    assert "prompt" in err and "generated" in err and "tok/s" in err
    t = llm.last_throughput
    assert t is not None and t.generated_tokens == 19 and t.prompt_tokens == 39
    with pytest.raises(ContractViolation, match=r"prompts\[1\]"):
        llm.generate([prompts[0], []], GREEDY)
    with pytest.raises(InvalidRequest):  # the engine's own refusal: a token outside the vocabulary
        llm.generate([prompts[0], [10 ** 9]], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_engine_config_sizing(tiny_model: object) -> None:
    with pytest.raises(ContractViolation, match="exclusive"):
        EngineConfig(num_blocks=4, cache_memory_bytes=1 << 20)
    with pytest.raises(ContractViolation, match="block_size"):
        Engine(tiny_model, EngineConfig(block_size=24, num_blocks=4))  # type: ignore[arg-type]
    e = Engine(tiny_model, EngineConfig(block_size=32, cache_memory_bytes=1 << 20,  # type: ignore[arg-type]
                                        num_state_slots=3))
    assert e.cache.num_slots == 3 and e.cache.block_size == 32
    assert e.blocks.capacity == e.cache.num_pages > 0
    with pytest.raises(CapacityError, match="cache budget"):
        Engine(tiny_model, EngineConfig(cache_memory_bytes=1000))  # type: ignore[arg-type]


def test_the_runner_chooses_the_executor_by_the_step(make_engine: Callable[..., Engine]) -> None:
    """The native bundle binds the graph executor: decode-only steps run the whole model in one
    call, prefill steps eagerly, with the same tokens as a bundle without a graph (torch's,
    which binds none and says why in the kernel line). (The engines share one model: each runs
    before the next is built, as the model takes its bundle from the last engine built.)"""
    out, steps = {}, {}
    for name in ("native", "torch"):
        engine = make_engine(block_size=16, num_blocks=32, backend=name)
        assert (engine.runner.executors.graph is None) == (name == "torch")
        if name == "torch":
            line = engine.runner.kernel_summary()
            assert "no graph (the torch bundle has no fused whole step)" in line, line
        engine.add_request("a", prompt_of(3, 20), GREEDY)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[name] = o.token_ids
        steps[name] = dict(engine.runner.executors.steps)
    assert out["native"] == out["torch"]
    # decodes, prefill
    assert steps["native"] == {"graph": GREEDY.max_tokens - 1, "layers": 0, "eager": 1}
    assert steps["torch"] == {"graph": 0, "layers": 0, "eager": GREEDY.max_tokens}


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_the_model_is_built_with_the_engines_bundle(monkeypatch: pytest.MonkeyPatch,
                                                    tiny_dir: Path, backend: str) -> None:
    """``load_engine`` builds the model with the bundle the engine's needs choose: the model
    is given a bundle once (when it is built), not ``auto``'s first and the engine's after."""
    given: list[str] = []
    real = Qwen35ForCausalLM.use_backend
    monkeypatch.setattr(Qwen35ForCausalLM, "use_backend",
                        lambda self, b: (given.append(b.name), real(self, b))[1])
    engine = load_engine(tiny_dir, dtype="float32", backend=backend, enable_prefix_caching=False)
    assert given == [backend]
    assert engine.runner.model.backend is engine.runner.kernels.backend
