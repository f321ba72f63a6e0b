"""Property-based fuzzing of a live server from its own OpenAPI document with the real
``schemathesis`` CLI and all its checks: some 2,500 generated requests a run (valid and
invalid) across every endpoint, every answer one the document declares (status, content type,
body schema, headers), every schema-violating request refused, no response >= 500, the engine
process alive, and a known greedy request answered correctly afterwards; once without an API key
and once with one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import start_server

from pagedhybrid.engine import SamplingParams
from pagedhybrid.serve.llm import LLM

PROMPT = "And it came to pass"


@pytest.mark.parametrize("key", [None, "sesame"], ids=["open", "api-key"])
def test_schemathesis_with_all_checks_finds_nothing(tmp_path: Path, key: str | None) -> None:
    # a short context bounds the work of any generated request; with an API key, schemathesis
    # also sends requests without it (each must be a 401, whatever its body)
    auth = ["--api-key", key] if key else []
    s = start_server(tmp_path, "--max-model-len", "64", "--max-num-seqs", "16", *auth)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # positive_data_acceptance wants every schema-valid request answered 2xx, but what the server
    # accepts also depends on the model, which no schema states: the prompt + max_tokens within
    # max_model_len, token ids inside the vocabulary, a grammar llguidance compiles, one grammar
    # field per request, the tool rules; those are 400s naming the field (the document declares
    # them; tests/serve/test_server_robustness.py), so a schema-valid request may get 2xx or 400
    # -- and nothing else (no 401 with the key, no 404, 405, 422, 5xx)
    config = tmp_path / "schemathesis.toml"
    # and the response-time check's limit is the request timeout: the machine is shared (2 cores)
    config.write_text('[checks]\nmax_response_time = 120.0\n'
                      '[checks.positive_data_acceptance]\nexpected-statuses = ["2xx", "400"]\n')
    try:
        cli = Path(sys.executable).with_name("schemathesis")
        run = subprocess.run(
            [str(cli), "--config-file", str(config), "run", f"{s.base}/openapi.json",
             "--checks", "all",
             *[arg for k, v in headers.items() for arg in ("--header", f"{k}: {v}")],
             "--max-examples", "100", "--workers", "1", "--seed", "2026",
             "--generation-database", "none", "--request-timeout", "120", "--no-color",
             "--output-sanitize", "false"],  # show the bodies (fields named *token* included)
            cwd=tmp_path, capture_output=True, text=True, timeout=600)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-8000:]
        generated = re.search(r"(\d+) generated, (\d+) passed", out)
        assert generated is not None, out[-3000:]
        assert int(generated.group(1)) >= 2000 and generated.group(1) == generated.group(2), \
            out[-3000:]
        assert "Selected: 9/9" in out and "Tested: 9" in out, out[-3000:]
        # no failure and no warning (e.g. an operation whose generated bodies the server mostly
        # refuses: the document would not state its rules)
        assert "No issues found" in out and "Failures:" not in out, out[-3000:]
        assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200
        r = httpx.post(f"{s.url}/completions", timeout=60, headers=headers, json={
            "model": s.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        llm = LLM(None, max_model_len=64)
        want = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8),
                            use_progress=False)[0]
        assert r["choices"][0]["text"] == llm.engine.tokenizer.decode(want.token_ids)
        m = s.metrics()
        assert m["pagedhybrid:request_success_total"] > 100  # the fuzzer reached the engine
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.log.read_text()
