"""Property-based fuzzing of a live server from its own OpenAPI schema with the real
``schemathesis`` CLI: about a thousand generated bodies (valid and invalid) across every endpoint,
no response >= 500, the engine process alive, and a known greedy request answered correctly
afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
from conftest import start_server

from pagedhybrid.engine import LLM, SamplingParams

PROMPT = "And it came to pass"


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    # a short context bounds the work of any generated request
    s = start_server(tmp_path, "--max-model-len", "64", "--max-num-seqs", "16")
    try:
        cli = Path(sys.executable).with_name("schemathesis")
        run = subprocess.run(
            [str(cli), "run", f"{s.base}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", "60", "--workers", "1", "--seed", "2026",
             "--generation-database", "none", "--request-timeout", "120", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=900)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        generated = re.search(r"(\d+) generated, (\d+) passed", out)
        assert generated is not None, out[-3000:]
        assert int(generated.group(1)) >= 800 and generated.group(1) == generated.group(2), \
            out[-3000:]
        assert "Selected: 9/9" in out and "Tested: 9" in out, out[-3000:]
        assert httpx.get(f"{s.base}/health", timeout=30).status_code == 200
        r = httpx.post(f"{s.url}/completions", timeout=60, json={
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
