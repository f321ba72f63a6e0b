"""``pagedhybrid serve --quantization int4``: the built-in model with int4 projection weights in a
real server process, driven by the real ``openai`` client -- its start-up line names the format
and the CPU's int8 dot instruction, its weights are counted as held (codes and scales), chat and
completions answer as the in-process engine with the same weights does, and a format it does
not know stops it before it serves, naming the option."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import Server, start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM

PROMPT = "And God said, Let there be"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("serve-int4"), "--quantization", "int4",
                     "--max-num-seqs", "4")
    yield s
    s.stop()


def test_serves_int4_weights_to_the_openai_client(server: Server) -> None:
    log = server.log.read_text()
    assert "int4 weights: quant.linear (" in log, log
    client = openai.OpenAI(base_url=server.url, api_key="none")
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                      temperature=0.0, logprobs=2)
    choice = done.choices[0]
    assert choice.text and choice.logprobs is not None
    assert len(choice.logprobs.token_logprobs) == done.usage.completion_tokens
    local = LLM(None, dtype="float32", quantization="int4", max_num_seqs=4)
    want = local.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0),
                          use_progress=False)[0].text
    assert choice.text == want
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Who made the light?"}],
        max_tokens=16, temperature=0.0)
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_an_unknown_format_stops_the_server_by_name(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pagedhybrid", "serve", "--quantization",
                           "int3", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "quantization" in proc.stderr and "int8 or int4" in proc.stderr, proc.stderr
