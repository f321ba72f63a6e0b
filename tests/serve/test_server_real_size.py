"""``pagedhybrid serve DIR`` with no other options on a Qwen3.5-0.8B-geometry checkpoint (random
bf16 weights, 248,320-token vocabulary, the published tokenizer and chat format): it starts on
this machine, says what it planned, and answers the real ``openai`` client -- chat through the
Qwen3.5 template, logprobs over the whole vocabulary, and /tokenize as the tokenizer does."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import Server, start_server

from pagedhybrid.models.qwen35 import load_tokenizer
from pagedhybrid.models.qwen35.synthetic import published_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one folder per test session, shared with tests/models/test_real_size.py
    return published_checkpoint(tmp_path_factory.getbasetemp() / "qwen35-0.8B", "0.8B")


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("serve-0.8b"), str(ckpt), name="qwen35-0.8b",
                     dtype=None)  # no option at all: dtype auto
    yield s
    s.stop()


def test_starts_with_no_options_and_says_what_it_planned(server: Server) -> None:
    log = server.log.read_text()
    line = next(x for x in log.splitlines() if "memory: weights" in x)
    # dtype auto: the checkpoint's bf16, not a fp32 copy, and no second copy of the tied table
    assert f"{2 * 752_393_024 / 2**30:.2f} GiB bfloat16" in line, line
    assert "32 state slots" in line and "at once:" in line
    gib = {k: float(v) for k, v in re.findall(r"(weights|cache|workspace) ([\d.]+) GiB", line)}
    # no second copy of the weights: the process holds weights + cache + workspace and the
    # runtime (torch, Python: under 1 GiB), however much of the cache it has touched
    assert server.rss_kib() / 2**20 < sum(gib.values()) + 1.0, (server.rss_kib(), gib)


def test_chat_uses_the_qwen35_template_and_answers(server: Server, ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600)
    messages = [{"role": "user", "content": "What is 2+2? 答えて"}]
    r = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True,
                                                   "chat_template_kwargs":
                                                   {"enable_thinking": False}})
    prompt = tok.apply_chat_template(messages, enable_thinking=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 4
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    t = httpx.post(f"{server.base}/tokenize", timeout=60, json={
        "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert t["tokens"] == ids and t["tokens"][-4:] == tok.encode("<think>\n\n</think>\n\n")
    text = "Grüße, 世界! 🌍"
    t = httpx.post(f"{server.base}/tokenize", timeout=60, json={"prompt": text}).json()
    assert t["tokens"] == tok.encode(text) and max(t["tokens"]) < 248320
    d = httpx.post(f"{server.base}/detokenize", timeout=60, json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == text
