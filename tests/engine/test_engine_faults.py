"""A faulty step never stops the engine: its requests fail with reason ``error``, the pools are
checked (rebuilt when they do not add up), and every other request is served exactly as alone."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from pagedhybrid.engine import Engine, SamplingParams
from pagedhybrid.serve.llm import LLM

G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, max_num_seqs=4, max_num_batched_tokens=64)


def alone(llm: LLM, prompt: str) -> tuple[int, ...]:
    return llm.generate([prompt], G, use_progress=False)[0].token_ids


def drain(llm: LLM) -> dict[str, object]:
    final = {}
    for out in llm.engine.stream():
        llm.engine.check_invariants()
        if out.finished:
            final[out.request_id] = out
    return final


def break_steps(monkeypatch: pytest.MonkeyPatch, eng: Engine,
                fault: Callable[..., object]) -> None:
    """Every step's forward runs ``fault(execute, *args)``, whichever executor the runner chose
    (``engine/worker/executors.py``) -- a fault inside the model's forward."""
    executors = eng.runner.executors
    choose = executors.choose
    monkeypatch.setattr(executors, "choose",
                        lambda meta, n: functools.partial(fault, choose(meta, n)))


def test_a_step_that_raises_fails_its_requests_and_the_next_ones_are_served(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    want = alone(llm, "And God said")
    eng = llm.engine
    calls = {"n": 0}

    def flaky(execute: Callable[..., object], *a: object, **k: object) -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return execute(*a, **k)

    break_steps(monkeypatch, eng, flaky)
    eng.add_request("a", "In the beginning", G)
    eng.add_request("b", "And the earth", G)
    final = drain(llm)
    assert {o.finish_reason for o in final.values()} == {"error"}
    assert all("boom" in (o.error or "") for o in final.values())
    assert eng.stats.step_failures >= 1
    assert eng.blocks.num_free == eng.blocks.capacity and eng.states.num_free == \
        eng.states.capacity
    assert alone(llm, "And God said") == want


def test_scheduling_that_raises_fails_the_running_requests(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = llm.engine
    want = alone(llm, "And God said")
    eng.add_request("c", "In the beginning", G)
    eng.step()  # running now
    real = eng.scheduler.schedule
    monkeypatch.setattr(eng.scheduler, "schedule",
                        lambda: (_ for _ in ()).throw(KeyError("sched")))
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("c", "error")]
    monkeypatch.setattr(eng.scheduler, "schedule", real)
    eng.check_invariants()
    assert alone(llm, "And God said") == want


def test_pools_that_do_not_add_up_after_a_fault_are_rebuilt(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = llm.engine
    want = alone(llm, "And God said")
    eng.add_request("d", "In the beginning", G)
    eng.add_request("e", "And the earth", SamplingParams(max_tokens=4))
    eng.step()

    def corrupt(execute: Callable[..., object], *a: object, **k: object) -> object:
        eng.states._free.clear()  # a bug that loses every free slot
        raise RuntimeError("corrupting bug")

    break_steps(monkeypatch, eng, corrupt)
    outs = eng.step()
    monkeypatch.undo()
    assert {o.request_id for o in outs} == {"d", "e"}
    assert {o.finish_reason for o in outs} == {"error"}
    assert eng.stats.pool_rebuilds == 1
    eng.check_invariants()
    assert eng.states.num_free == eng.states.capacity
    assert alone(llm, "And God said") == want


def test_a_row_whose_sampling_raises_fails_alone(llm: LLM,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedhybrid.engine.worker.sampling as engine_mod

    want = {p: alone(llm, p) for p in ("In the beginning", "And the earth")}
    real = engine_mod.sample

    def picky(logits, params, gens, *rest):  # type: ignore[no-untyped-def]
        if any(p.seed == 666 for p in params):
            raise ValueError("bad row")
        return real(logits, params, gens, *rest)

    monkeypatch.setattr(engine_mod, "sample", picky)
    eng = llm.engine
    eng.add_request("ok1", "In the beginning", G)
    eng.add_request("bad", "Then Jesus", SamplingParams(max_tokens=6, seed=666))
    eng.add_request("ok2", "And the earth", G)
    final = drain(llm)
    assert final["bad"].finish_reason == "error" and "bad row" in final["bad"].error
    assert final["ok1"].token_ids == want["In the beginning"]
    assert final["ok2"].token_ids == want["And the earth"]


def test_rows_sampled_again_after_a_failed_batch_draw_the_same_uniforms(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch draws every row's uniform before it fails; the rows sampled one by one after it
    start from their generators' earlier states, so a seeded request is as when alone."""
    import pagedhybrid.engine.worker.sampling as engine_mod

    seeded = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    want = llm.generate(["In the beginning"], seeded, use_progress=False)[0].token_ids
    real = engine_mod.sample

    def late(logits, params, gens, *rest):  # type: ignore[no-untyped-def]
        out = real(logits, params, gens, *rest)  # a uniform drawn for every row
        if any(p.seed == 666 for p in params):
            raise ValueError("bad row")
        return out

    monkeypatch.setattr(engine_mod, "sample", late)
    eng = llm.engine
    eng.add_request("seeded", "In the beginning", seeded)
    eng.add_request("bad", "Then Jesus", SamplingParams(max_tokens=6, seed=666))
    final = drain(llm)
    assert final["bad"].finish_reason == "error"
    assert final["seeded"].token_ids == want
