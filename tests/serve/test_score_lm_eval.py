"""``LLM.score`` against the real lm-eval harness (0.4.13) scoring through ``pagedhybrid serve``.

lm-eval runs a local multiple-choice task (``data_lm_eval_kjv``: 18 items from the built-in
model's held-out KJV text, a context and 4 four-word choices, one the true next words) with its
``local-completions`` model against a real server of the built-in model (fp32), as its CLI
would: ``--model local-completions --model_args base_url=.../v1/completions,
tokenizer=<model folder>,tokenizer_backend=huggingface,tokenized_requests=True,
add_bos_token=True --log_samples``. ``add_bos_token``: lm-eval then encodes a context with the
tokenizer's special tokens (the BOS), as pagedhybrid encodes a text prompt; token-id requests
(``tokenized_requests``, lm-eval's default): the server scores exactly lm-eval's tokens. Each
request is ``echo: true, logprobs: 1, max_tokens: 1``; lm-eval's loglikelihood of a choice is
the sum of the prompt's ``token_logprobs[ctxlen:-1]``.

lm-eval's rule for a (context, continuation) pair (``TemplateLM._encode_pair``, causal models):
trailing whitespace of the context moves to the front of the continuation; the context is
encoded (with BOS here), and the continuation's tokens are those of ``encode(context +
continuation)`` after the context's tokens. The task's contexts end with a space, a word or a
newline (``target_delimiter: ""``), so the move happens.

Per item and choice, in-process ``LLM(None, dtype="float32").score`` (the sum of its per-token
logprobs) must equal lm-eval's recorded loglikelihood within ``TOL`` and pick the same choice:
once on lm-eval's own token ids (the server's echo logprobs == the training-side recompute) and
once on lm-eval's text arguments (``score`` encodes text as lm-eval does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import start_server

from pagedhybrid.models.qwen35 import default_model_dir
from pagedhybrid.serve.llm import LLM

TASK = "pagedhybrid_kjv_next_words"
DATA = Path(__file__).parent / "data_lm_eval_kjv"
MODEL = "default-model"
TOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class Item:
    doc: dict[str, Any]
    pairs: list[tuple[str, str]]  # lm-eval's (context, continuation) per choice
    lls: list[float]              # lm-eval's loglikelihood per choice (from the server)


@dataclass
class LmEvalRun:
    items: list[Item]
    acc: float
    model_args: dict[str, Any]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``pagedhybrid serve`` of the built-in model (fp32) on a free port."""
    s = start_server(tmp_path_factory.mktemp("lm-eval-serve"), name=MODEL)
    yield s.base
    s.stop()


@pytest.fixture(scope="module")
def lm_eval_run(server_url: str, tmp_path_factory: pytest.TempPathFactory) -> LmEvalRun:
    args = {"base_url": f"{server_url}/v1/completions", "model": MODEL,
            "tokenizer": str(default_model_dir()), "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "add_bos_token": True, "max_retries": 1,
            "timeout": 300}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets-cache")))
        mp.chdir(DATA)  # the task's data_files path is relative to its folder
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        res = simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                              task_manager=TaskManager(include_path=str(DATA),
                                                       include_defaults=False),
                              batch_size=1, log_samples=True, bootstrap_iters=0,
                              random_seed=0)
    assert res is not None
    items = []
    for s in sorted(res["samples"][TASK], key=lambda s: int(s["doc_id"])):
        lls = [float(r[0][0]) for r in s["resps"]]  # [(loglikelihood, is_greedy)] per choice
        items.append(Item(s["doc"], [(str(c), str(x)) for c, x in s["arguments"]], lls))
    return LmEvalRun(items, float(res["results"][TASK]["acc,none"]), args)


def argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def compare(run: LmEvalRun, scores: list[list[float]], what: str) -> None:
    """Every choice's sum within TOL of lm-eval's loglikelihood, and the same choice picked."""
    flat = [ll for it in run.items for ll in it.lls]
    sums = [sum(lp) for lp in scores]
    assert len(sums) == len(flat)
    k = 0
    bad = []
    for i, it in enumerate(run.items):
        mine = sums[k:k + len(it.lls)]
        k += len(it.lls)
        diff = max(abs(a - b) for a, b in zip(mine, it.lls, strict=True))
        if diff > TOL or argmax(mine) != argmax(it.lls):
            bad.append(f"item {i} ({it.doc['kind']}): lm-eval {it.lls} vs {what} {mine}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_lm_eval_scored_every_item_through_the_server(lm_eval_run: LmEvalRun) -> None:
    docs = [json.loads(x) for x in (DATA / "kjv_next_words.jsonl").read_text().splitlines()]
    assert [it.doc["context"] for it in lm_eval_run.items] == [d["context"] for d in docs]
    for it in lm_eval_run.items:
        assert it.pairs == [(it.doc["context"], c) for c in it.doc["choices"]]
        assert all(ll < 0 for ll in it.lls)
    # the task exercises lm-eval's whitespace move: contexts ending in " " and "\n"
    assert {it.doc["context"][-1] for it in lm_eval_run.items} >= {" ", "\n"}
    hits = [argmax(it.lls) == it.doc["label"] for it in lm_eval_run.items]
    assert lm_eval_run.acc == pytest.approx(sum(hits) / len(hits))


@pytest.mark.slow
def test_score_of_lm_evals_token_ids_matches(lm_eval_run: LmEvalRun, llm: LLM) -> None:
    """The server's echo logprobs of lm-eval's token ids == ``score`` of the same ids."""
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions").create_from_arg_obj(lm_eval_run.model_args)
    pairs = [lm._encode_pair(c, x) for it in lm_eval_run.items for c, x in it.pairs]
    bos = llm.engine.tokenizer.encode("")  # what the tokenizer adds: [BOS]
    assert bos and all(ctx[:len(bos)] == bos for ctx, _ in pairs)
    compare(lm_eval_run, llm.score([p for p, _ in pairs], [c for _, c in pairs]),
            "score(token ids)")


@pytest.mark.slow
def test_score_of_lm_evals_text_matches(lm_eval_run: LmEvalRun, llm: LLM) -> None:
    """``score(contexts, continuations)`` on lm-eval's text arguments: the prompt encoded as
    pagedhybrid encodes a text prompt (with BOS), the continuation as lm-eval encodes it (the
    context's trailing whitespace moved onto it, no special tokens, tokens of the whole text
    after the context's) -- lm-eval's loglikelihoods, choice for choice."""
    pairs = [p for it in lm_eval_run.items for p in it.pairs]
    compare(lm_eval_run, llm.score([c for c, _ in pairs], [x for _, x in pairs]),
            "score(text)")
