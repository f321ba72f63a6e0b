"""A Qwen3.5-0.8B-geometry checkpoint (random bf16 weights, sharded, 248,320-token vocabulary,
the published tokenizer): loaded without a second copy of the weights, and served by ``LLM``
with no options at all (dtype auto keeps it bf16; memory sized from the machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedhybrid.engine import SamplingParams
from pagedhybrid.engine.core.memory import available_memory
from pagedhybrid.models.qwen35.synthetic import INDEX_FILE, published_checkpoint
from pagedhybrid.serve.llm import LLM

LOAD_RSS_BOUND = 1.2  # RSS growth while loading and reading, in units of the weights' bytes

_LOAD = """
import json, sys, torch
from pagedhybrid.kernels.backend import backend
from pagedhybrid.models.qwen35 import load

def status():
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f
                 if line.startswith(("RssAnon", "RssFile", "VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) * 1024 for k, v in d.items()}

before = status()
model = load(sys.argv[1], dtype=torch.bfloat16)
loaded = status()
# read one element of every 4 KiB page of every weight (no converted copy of a tensor is made)
total = sum(float(p.detach().reshape(-1)[::4096 // p.element_size()].double().sum())
            for p in model.parameters())
read = status()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
# the native bundle multiplies the weights as they are mapped (kernels/native/dense.py): setting
# it copies nothing, and the tied LM head stays the embedding table
where = [p.data_ptr() for p in model.parameters()]
model.use_backend(backend("native"))
print(json.dumps({"before": before, "loaded": loaded, "read": read, "held": status(),
                  "weights": weights, "finite": total == total,
                  "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                  "unmoved": where == [p.data_ptr() for p in model.parameters()]}))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # one folder per test session, shared with tests/serve/test_server_real_size.py
    return published_checkpoint(tmp_path_factory.getbasetemp() / "qwen35-0.8B", "0.8B")


def test_the_checkpoint_is_sharded_bf16_at_the_published_size(ckpt: Path) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3
    assert index["metadata"]["total_size"] == 2 * 752_393_024  # bf16, the text model's params


def test_loading_maps_the_weights_without_a_second_copy(ckpt: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(ckpt)], capture_output=True,
                          text=True, timeout=600, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    b, w = r["before"], r["weights"]
    anon = {k: r[k]["RssAnon"] - b["RssAnon"] for k in ("loaded", "read")}
    file = r["read"]["RssFile"] - b["RssFile"]
    assert r["finite"]
    # no second copy: what loading and reading every weight page adds in private memory stays a
    # small part of the weights; the weights themselves are the mapped file's pages
    assert max(anon.values()) <= (LOAD_RSS_BOUND - 1.0) * w, (anon, w)
    assert file <= LOAD_RSS_BOUND * w, (file, w)
    # the peak: this process's own high-water mark (VmHWM; getrusage's ru_maxrss would carry
    # the forking parent's over exec)
    peak = r["read"]["VmHWM"] - b["VmRSS"]
    assert peak <= LOAD_RSS_BOUND * w, (
        f"peak RSS grew by {peak / 2**30:.2f} GiB while loading {w / 2**30:.2f} GiB of weights")
    # the native bundle set: no copy of any weight, the tied head still the table
    assert r["tied"] and r["unmoved"]
    held, bound = r["held"], LOAD_RSS_BOUND * w
    assert held["VmRSS"] - b["VmRSS"] <= bound, (held, w)
    assert held["VmHWM"] - b["VmRSS"] <= bound, (held, w)


def test_llm_with_no_options_starts_and_answers(ckpt: Path) -> None:
    free = available_memory()
    llm = LLM(ckpt)
    plan = llm.engine.memory
    assert plan.budget is not None and plan.cache_bytes <= plan.budget
    assert plan.weights + plan.workspace + plan.cache_bytes <= free
    assert llm.engine.model.dtype == torch.bfloat16
    assert llm.engine.model.config.vocab_size == 248320
    assert plan.sizes.num_slots == 32 and plan.concurrent(4096) >= 1
    out = llm.generate([list(range(100, 140))], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_progress=False)
    assert len(out[0].token_ids) == 4
    assert all(0 <= t < 248320 for t in out[0].token_ids)
    tok = llm.engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello 世界"}])
    out = llm.generate([tok.encode(prompt, add_special_tokens=False)],
                       SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2),
                       use_progress=False)[0]
    assert len(out.token_ids) == 3 and len(out.logprobs) == 3
    assert all(len(top) >= 2 for top in out.logprobs)
