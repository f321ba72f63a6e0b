"""Perplexity: sliding windows, prompt logprobs through the engine, an exported package in
onnxruntime, the CLI, and its typed refusals -- against HF transformers on the built-in model."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Qwen3_5ForCausalLM

from pagedhybrid.cli import main as cli_main
from pagedhybrid.engine import SamplingParams, load_engine
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.models.qwen35 import default_model_dir, load_tokenizer
from pagedhybrid.models.qwen35.default_model import heldout_text_path
from pagedhybrid.perplexity import (
    PerplexityError,
    engine_perplexity,
    package_perplexity,
    windows,
)

CONTEXT, STRIDE, TOKENS = 128, 64, 420


@pytest.fixture(scope="module")
def ids() -> list[int]:
    tok = load_tokenizer(default_model_dir())
    return tok.encode(heldout_text_path().read_text(encoding="utf-8"))[:TOKENS]


@pytest.fixture(scope="module")
def hf_model() -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM.from_pretrained(str(default_model_dir()),
                                              dtype=torch.float32).eval()


def hf_perplexity(hf: Qwen3_5ForCausalLM, ids: list[int], context: int, stride: int) -> float:
    """HF's documented sliding-window recipe, written independently of ``windows``."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg = end - prev_end
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            lp = hf(input_ids=x, use_cache=False).logits[0].double().log_softmax(-1)
        tok_lp = lp[:-1].gather(1, x[0, 1:, None])[:, 0]  # log p(token j+1 | ...)
        take = tok_lp[-trg:] if begin > 0 else tok_lp  # the first window scores tokens 1..
        nll -= take.sum().item()
        count += take.numel()
        prev_end = end
        if end == len(ids):
            break
    assert count == len(ids) - 1
    return math.exp(nll / count)


@given(st.integers(2, 400), st.integers(2, 64), st.data())
def test_windows_score_every_token_once(n: int, context: int, data: st.DataObject) -> None:
    stride = data.draw(st.integers(1, context))
    wins = windows(n, context, stride)
    scored = [t for w in wins for t in range(w.end - w.scored, w.end)]
    assert scored == list(range(1, n))
    assert all(w.end - w.begin <= context and w.scored >= 0 for w in wins)
    # after the first window, every scored token sees context - stride tokens of history or more
    assert all(w.begin == 0 or (w.end - w.scored) - w.begin == context - stride for w in wins)


def test_engine_perplexity_equals_hf(ids: list[int], hf_model: Qwen3_5ForCausalLM) -> None:
    engine = load_engine(None, dtype="float32", max_model_len=CONTEXT + 1,
                         max_num_batched_tokens=96)
    ours = engine_perplexity(engine, ids, CONTEXT, STRIDE)
    ref = hf_perplexity(hf_model, ids, CONTEXT, STRIDE)
    assert ours.tokens == len(ids) - 1 and ours.windows == len(windows(len(ids), CONTEXT,
                                                                       STRIDE))
    assert abs(ours.perplexity - ref) / ref < 5e-5, (ours.perplexity, ref)  # 4 digits
    assert f"{ours.perplexity:.4g}" == f"{ref:.4g}"
    assert 1.0 < ref < 0.5 * engine.model.config.vocab_size  # a trained model
    assert engine.blocks.num_free == engine.blocks.capacity  # every window finished


def test_prompt_logprobs_match_hf_through_chunks_and_preemption(
        ids: list[int], hf_model: Qwen3_5ForCausalLM) -> None:
    """Prompt logprobs are HF's log-softmax at every prompt position, whether the prompt is
    prefilled in small chunks, shares steps with others or is preempted and recomputed."""
    prompts = [ids[:70], ids[100:160], ids[200:203], ids[5:6]]
    engine = load_engine(None, dtype="float32", max_num_batched_tokens=24, num_blocks=9,
                         block_size=16,
                         max_model_len=100)
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    finals = {o.request_id: o for o in engine.stream() if o.finished}
    assert engine.stats.preemptions >= 1
    for i, p in enumerate(prompts):
        out = finals[f"p{i}"]
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(p)
        assert out.prompt_logprobs[0] is None
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor([p])).logits[0].log_softmax(-1)
        for j in range(1, len(p)):
            d = out.prompt_logprobs[j]
            assert p[j] in d and len(d) in (2, 3)  # top-2 plus the prompt token
            assert abs(d[p[j]].logprob - ref[j - 1, p[j]].item()) < 1e-4
            assert d[p[j]].rank == int((ref[j - 1] > ref[j - 1, p[j]]).sum()) + 1
            best = int(ref[j - 1].argmax())
            assert d[best].rank == 1


def test_cli_json_and_bad_input(tmp_path: Path, ids: list[int],
                                capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text(heldout_text_path().read_text(encoding="utf-8")[:1500], encoding="utf-8")
    assert cli_main(["perplexity", "--text", str(text), "--context", "96", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "torch" and doc["context"] == 96 and doc["stride"] == 48
    assert doc["tokens"] > 200 and 1.0 < doc["perplexity"] < 4096
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    bad = [(["--text", str(empty)], "is empty"),
           (["--text", str(tmp_path / "missing.txt")], "readable file"),
           (["--text", str(text), "--context", "4096"], "max_position_embeddings"),
           (["--text", str(text), "--context", "64", "--stride", "65"], "stride"),
           (["--text", str(text), "--backend", "onnxruntime"], "--package"),
           (["--text", str(text), "--max-tokens", "1"], "at least 2 tokens")]
    for argv, why in bad:
        assert cli_main(["perplexity", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: perplexity:") and why in err, (argv, err)
    r = subprocess.run([sys.executable, "-m", "pagedhybrid", "perplexity", "--text", str(empty)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is empty" in r.stderr


@pytest.fixture(scope="module")
def default_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default-package")
    export_package(default_model_dir(), out, ExportOptions(ep="webgpu", dtype="fp16",
                                                           block_size=16, num_blocks=64))
    return out


def test_onnxruntime_package_perplexity_tracks_torch(default_package: Path, ids: list[int]
                                                     ) -> None:
    """The fp16 export on the WebGPU EP (every node it takes) scores the text within 1% of the
    fp32 torch engine; pinned to PagedAttention-only placement it is closer still."""
    short = ids[:200]
    torch_ppl = engine_perplexity(load_engine(None, dtype="float32", max_model_len=65), short, 64,
                                  32)
    ort_ppl = package_perplexity(default_package, default_model_dir(), short, 64, 32)
    pinned = package_perplexity(default_package, default_model_dir(), short, 64, 32,
                                placement="paged_only")
    assert ort_ppl.tokens == pinned.tokens == torch_ppl.tokens == len(short) - 1
    assert ort_ppl.dtype == "float16" and ort_ppl.backend == "onnxruntime/webgpu"
    for got in (ort_ppl, pinned):
        assert abs(got.perplexity / torch_ppl.perplexity - 1) < 1e-2, (got, torch_ppl)


def test_package_from_another_checkpoint_is_refused(default_package: Path, tmp_path: Path,
                                                    ids: list[int]) -> None:
    from pagedhybrid.models.qwen35.synthetic import (
        random_weights,
        tiny_byte_config,
        write_checkpoint,
    )

    other = tmp_path / "other"
    cfg = tiny_byte_config()
    write_checkpoint(other, cfg, random_weights(cfg, 1))
    with pytest.raises(PerplexityError, match=r"another checkpoint.*vocab_size"):
        package_perplexity(default_package, other, ids[:50], 32, 16)
    pruned = tmp_path / "pruned"
    export_package(default_model_dir(), pruned, ExportOptions(
        ep="webgpu", dtype="fp16", block_size=16, num_blocks=64, prune_logits=True,
        weights=False))
    with pytest.raises(PerplexityError, match="logits for every token"):
        package_perplexity(pruned, default_model_dir(), ids[:50], 32, 16)
