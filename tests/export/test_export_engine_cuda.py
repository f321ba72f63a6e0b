"""CUDA variant of the Engine test: onnxruntime-gpu 1.31.1 + onnxruntime-genai-cuda 0.18.0.

A ``--ep cuda`` export (fp16 and bf16; ``num_blocks`` pinned) is loaded by the real genai Engine
on the CUDA EP, where PagedAttention, GatedDeltaNet and VarlenCausalConvWithState all have CUDA
kernels (the GDN decay/beta inputs are float32, as 1.31.1 requires). Overlapping requests with an
admission mid-decode must give each request's isolated tokens; fp16 must also equal the float32
torch engine. Skips (GPU-only) on machines without a CUDA build of both wheels and a device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from export_helpers import ADMIT_AFTER, MAX_NEW, engine_prompts
from genai_runner import run_schedule

from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.models.qwen35 import default_model_dir


def _cuda_missing() -> str | None:
    import onnxruntime as ort
    import onnxruntime_genai as og

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: install "
                "onnxruntime-gpu==1.31.1 and onnxruntime-genai-cuda==0.18.0 on a CUDA machine")
    if not og.is_cuda_available():
        return "onnxruntime-genai is not the CUDA build (onnxruntime-genai-cuda==0.18.0)"
    return None


pytestmark = pytest.mark.skipif(_cuda_missing() is not None, reason=_cuda_missing() or "")

CUDA = ExportOptions(ep="cuda", dtype="fp16", block_size=16, num_blocks=32, max_batch_size=8)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_engine(dtype: str, tmp_path: Path, torch_tokens: list[list[int]]) -> None:
    import onnxruntime_genai as og

    export_package(default_model_dir(), tmp_path, dataclasses.replace(CUDA, dtype=dtype))
    engine = og.Engine(og.Model(og.Config(str(tmp_path))))
    prompts = engine_prompts()
    overlapped, _ = run_schedule(engine, prompts, MAX_NEW, ADMIT_AFTER)
    alone = [run_schedule(engine, [p], MAX_NEW)[0][0] for p in prompts]
    assert overlapped == alone
    if dtype == "fp16":
        assert overlapped == torch_tokens

