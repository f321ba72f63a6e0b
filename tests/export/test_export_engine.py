"""The real onnxruntime-genai 0.18.0 ``Engine`` runs an exported package as written.

The built-in model's package (webgpu fp16, block size 16, ``num_blocks`` pinned to 32,
conv/recurrent states named ``past_key_values.%d.conv_state`` / ``.recurrent_state`` in
``genai_config.json``) is loaded by ``og.Model`` with the WebGPU plugin EP registered. Three
greedy requests with unequal sentence prompts (14 new tokens each, so every request crosses a
page boundary):

* the first two start together and overlap; the third is admitted after 3 steps, while the others
  decode;
* each request's tokens equal the same request run alone through the Engine,
* and equal the pagedhybrid torch engine (float32) on the same checkpoint.

The package with pruned logits (``[B, vocab]``, no ``logits_indices`` input), exported without
``num_blocks`` (the default page count of ``export/pages.py``: 8 sequences of the model's 2048
tokens), loads with the pages the rule chose and gives the same tokens in the Engine.
"""

from __future__ import annotations

import json
from pathlib import Path

from export_helpers import ADMIT_AFTER, MAX_NEW, engine_prompts
from genai_runner import register_webgpu, run_schedule

from pagedhybrid.export.verify import verify_package


def _genai_engine(package: Path):  # type: ignore[no-untyped-def]
    import onnxruntime_genai as og

    register_webgpu()
    return og.Engine(og.Model(og.Config(str(package))))


def test_engine_runs_package_as_written(engine_package: Path,
                                        torch_tokens: list[list[int]]) -> None:
    assert verify_package(engine_package).ok
    engine = _genai_engine(engine_package)
    caps = engine.get_capabilities()
    assert caps.configured_max_batch_size == 8
    prompts = engine_prompts()
    overlapped, steps = run_schedule(engine, prompts, MAX_NEW, ADMIT_AFTER)
    assert [len(t) for t in overlapped] == [MAX_NEW] * len(prompts)
    alone = [run_schedule(engine, [p], MAX_NEW)[0][0] for p in prompts]
    print(f"engine steps {steps}; tokens {overlapped}")
    assert steps < sum(len(t) for t in alone)  # requests really shared steps
    assert overlapped == alone
    assert overlapped == torch_tokens
    assert len({tuple(t) for t in overlapped}) == len(prompts)  # not a degenerate model


def test_engine_runs_engine_pruned_package(engine_pruned_package: Path,
                                    torch_tokens: list[list[int]]) -> None:
    genai = json.loads((engine_pruned_package / "genai_config.json").read_text())
    assert genai["engine"]["dynamic_batching"]["num_blocks"] == 8 * 2048 // 16  # the default
    assert verify_package(engine_pruned_package).ok
    engine = _genai_engine(engine_pruned_package)
    # every request may reach the model's whole context: the pages do not cut it short
    assert engine.get_capabilities().max_request_length == genai["search"]["max_length"] == 2048
    overlapped, _ = run_schedule(engine, engine_prompts(), MAX_NEW, ADMIT_AFTER)
    assert overlapped == torch_tokens
