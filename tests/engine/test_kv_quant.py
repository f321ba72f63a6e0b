"""Quantized KV pages (int8 / float8e4m3fn, per-tensor / per-channel) end to end.

* calibration: the scales are the channel absmax of the keys/values the pages hold, over qmax;
  files round-trip and a mismatched file is refused; the CLI writes a file the engine loads
  (by default in the checkpoint's ``kv_scales/``, out of weight loaders' ``*.safetensors``);
* engine: every backend (reference, torch, native) serves quantized pages, agreeing with each
  other to float noise and with the unquantized engine to quantization noise (but not exactly:
  the pages really are int8 / fp8); a prefix-cache hit on quantized pages equals no hit;
* pools: a memory budget holds 4x the fp32 pages (2x bf16);
* bad configurations are refused at construction, naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import prompt_of, run_all

from pagedhybrid.calibrate_kv import channel_amax, scales_from_amax
from pagedhybrid.cli import main as cli_main
from pagedhybrid.engine import Engine, EngineConfig, SamplingParams, SequenceOutput
from pagedhybrid.engine.core.memory import plan_memory
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.native import status
from pagedhybrid.kvquant import KV_DTYPES, QMAX, load_scales, quantize, save_scales
from pagedhybrid.models.qwen35 import Qwen35ForCausalLM

COMBOS = [(d, q) for d in KV_DTYPES for q in ("per-channel", "per-tensor")]
BACKENDS = ["reference", "torch"] + (["native"] if status().available else [])
PROMPTS = [prompt_of(s, n) for s, n in ((1, 9), (2, 40), (3, 75), (4, 20))]
SCORE = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0,
                       logprobs=0)


@pytest.fixture(scope="module")
def scale_files(tiny_model: Qwen35ForCausalLM, tmp_path_factory: pytest.TempPathFactory
                ) -> dict[tuple[str, str], Path]:
    """Scales of every combination, calibrated on a token stream unlike the test prompts."""
    amax, _ = channel_amax(tiny_model, prompt_of(99, 600), 256)
    out = tmp_path_factory.mktemp("kv-scales")
    return {(d, q): save_scales(out / f"{d}-{q}.safetensors",
                                scales_from_amax(amax, KV_DTYPES[d], q), KV_DTYPES[d], q)
            for d, q in COMBOS}


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = SCORE
        ) -> list[SequenceOutput]:
    return run_all(engine, prompts, params)


def prompt_lps(outs: list[SequenceOutput]) -> torch.Tensor:
    """Every prompt token's logprob (teacher forced), concatenated."""
    return torch.tensor([next(iter(d.values())).logprob for o in outs
                         for d in (o.prompt_logprobs or ())[1:] if d is not None])


def test_calibration_is_the_absmax_of_what_the_pages_hold(tiny_model: Qwen35ForCausalLM,
                                                          tmp_path: Path) -> None:
    ids = prompt_of(5, 300)
    amax, used = channel_amax(tiny_model, ids, 512)  # one window
    assert used == 300
    with torch.no_grad():  # the same kernels as the calibration pass
        _, cache = tiny_model.forward_dense(torch.tensor([ids]))
    layers = tiny_model.config.full_attention_layers
    assert set(amax) == set(layers)
    for i in layers:
        k, v = cache.keys[i][0].abs(), cache.values[i][0].abs()  # [T, Hkv, D]
        assert torch.equal(amax[i][0], k.amax(0)) and torch.equal(amax[i][1], v.amax(0))
    for d, q in COMBOS:
        dt = KV_DTYPES[d]
        scales = scales_from_amax(amax, dt, q)
        for i in layers:
            s = scales[i]
            cfg = tiny_model.config
            assert s.k.shape == ((1,) if q == "per-tensor" else
                                 (cfg.num_key_value_heads, 1, cfg.head_dim))
            qk = quantize(cache.keys[i][0], s.k, dt).float()
            # nothing saturates on the calibration text and the largest channel reaches qmax
            assert qk.abs().max() == pytest.approx(QMAX[dt], rel=1e-3 if d == "int8" else 0.07)
        path = save_scales(tmp_path / f"{d}{q}.safetensors", scales, dt, q)
        got, quant = load_scales(path, layers, tiny_model.config.num_key_value_heads,
                                 tiny_model.config.head_dim, dt)
        assert quant == q and all(torch.equal(got[i].k, scales[i].k) and
                                  torch.equal(got[i].v, scales[i].v) for i in layers)
    # a percentile clips: the median is below the maximum
    p50, _ = channel_amax(tiny_model, ids, 512, percentile=50.0)
    assert all(bool((p50[i][0] < amax[i][0]).all()) for i in layers)


def test_scale_files_are_checked(tiny_model: Qwen35ForCausalLM,
                                 scale_files: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    cfg = tiny_model.config
    args = (cfg.full_attention_layers, cfg.num_key_value_heads, cfg.head_dim)
    int8_pc = scale_files[("int8", "per-channel")]
    with pytest.raises(ContractViolation, match="calibrated for 'int8'"):
        load_scales(int8_pc, *args, torch.float8_e4m3fn)
    with pytest.raises(ContractViolation, match="per-channel"):
        load_scales(int8_pc, *args, torch.int8, "per-tensor")
    with pytest.raises(ContractViolation, match=r"no 'layers\.7\.k_scale'"):
        load_scales(int8_pc, (7,), cfg.num_key_value_heads, cfg.head_dim, torch.int8)
    with pytest.raises(ContractViolation, match="must be float32"):
        load_scales(int8_pc, cfg.full_attention_layers, cfg.num_key_value_heads + 1,
                    cfg.head_dim, torch.int8)
    with pytest.raises(ContractViolation, match="missing"):
        load_scales(tmp_path / "nothing.safetensors", *args, torch.int8)


def test_calibrate_kv_cli_writes_what_the_engine_loads(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pagedhybrid.engine.loader import load_engine

    text = tmp_path / "calib.txt"
    text.write_text("And God said, Let there be light: and there was light.\n" * 20)
    out = tmp_path / "s.safetensors"
    assert cli_main(["calibrate-kv", "--text", str(text), "--out", str(out), "--dtype", "fp8",
                     "--quant", "per-tensor", "--percentile", "99.9", "--context", "64"]) == 0
    assert "fp8_e4m3 per-tensor scales of 2 layers" in capsys.readouterr().out
    engine = load_engine(None, kv_cache_dtype="fp8", kv_quant="per-tensor", kv_scales=str(out),
                         num_blocks=16, backend="torch")
    assert engine.cache.kv_dtype == torch.float8_e4m3fn
    assert engine.cache.kv_scales[3].k.shape == (1,)
    assert cli_main(["calibrate-kv", "--text", str(text), "--percentile", "0"]) == 2
    assert cli_main(["calibrate-kv", "--text", str(tmp_path / "none.txt")]) == 2
    assert "must be a readable file" in capsys.readouterr().err


def test_calibrate_kv_default_out_is_the_checkpoints_kv_scales_folder(tmp_path: Path) -> None:
    """Without ``--out`` the file goes to ``kv_scales/`` in the checkpoint folder -- not its top,
    whose ``*.safetensors`` weight loaders (vLLM) read -- and the engine finds it there."""
    from pagedhybrid.engine.loader import load_engine
    from pagedhybrid.models.qwen35 import default_model_dir

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        (ckpt / name).symlink_to(default_model_dir() / name)
    text = tmp_path / "calib.txt"
    text.write_text("And God said, Let there be light: and there was light.\n" * 20)
    assert cli_main(["calibrate-kv", "--model", str(ckpt), "--text", str(text), "--dtype", "int8",
                     "--quant", "per-tensor", "--context", "64"]) == 0
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    assert (ckpt / "kv_scales" / "int8-per-tensor.safetensors").is_file()
    engine = load_engine(ckpt, kv_cache_dtype="int8", kv_quant="per-tensor", num_blocks=16,
                         backend="torch")
    assert engine.cache.kv_dtype == torch.int8 and engine.cache.kv_scales[3].k.shape == (1,)


def test_the_builtin_model_ships_its_scales() -> None:
    from pagedhybrid import LLM

    llm = LLM(kv_cache_dtype="int8", num_blocks=16)
    assert llm.engine.cache.kv_dtype == torch.int8 and len(llm.engine.cache.kv_scales) == 2
    text = llm.generate(["In the beginning God created"],
                        SamplingParams(temperature=0.0, max_tokens=12))[0].text
    assert len(text.split()) >= 5


@pytest.mark.parametrize(("dtype", "quant"), COMBOS)
def test_every_backend_serves_quantized_pages(make_engine: Callable[..., Engine],
                                              scale_files: dict[tuple[str, str], Path],
                                              dtype: str, quant: str) -> None:
    base = prompt_lps(run(make_engine(num_blocks=64, backend="torch"), PROMPTS))
    got = {}
    for b in BACKENDS:
        engine = make_engine(num_blocks=64, backend=b, kv_cache_dtype=dtype, kv_quant=quant,
                             kv_scales=str(scale_files[(dtype, quant)]),
                             enable_prefix_caching=b != "reference")
        assert all(t.dtype == KV_DTYPES[dtype] for t in engine.cache.key_cache.values())
        got[b] = prompt_lps(run(engine, PROMPTS))
    for b in BACKENDS[1:]:  # the same quantized pages, read by different kernels
        assert (got[b] - got["reference"]).abs().max() < 2e-4, b
    err = (got["reference"] - base).abs()
    assert 0 < err.max() < (0.05 if dtype == "int8" else 0.25), err.max()


def test_a_prefix_hit_on_quantized_pages_equals_no_hit(make_engine: Callable[..., Engine],
                                                       scale_files: dict[tuple[str, str], Path]
                                                       ) -> None:
    kw = {"num_blocks": 64, "kv_cache_dtype": "int8",
          "kv_scales": str(scale_files[("int8", "per-channel")])}
    on, off = make_engine(**kw), make_engine(enable_prefix_caching=False, **kw)
    prompt = prompt_of(8, 150)
    run(on, [prompt[:140]])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    got, = run(on, [prompt], params)
    want, = run(off, [prompt], params)
    assert got.num_cached_tokens == 128 and got.token_ids == want.token_ids
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(got.logprobs, want.logprobs,
                                                                   strict=True) for t in a)
    assert worst < 1e-4, worst


def test_a_memory_budget_holds_more_quantized_pages(tiny_model: Qwen35ForCausalLM) -> None:
    cfg = tiny_model.config
    budget = 8 << 20
    for model_dtype, ratio in ((torch.float32, 4), (torch.bfloat16, 2)):
        full = plan_memory(cfg, EngineConfig(cache_memory_bytes=budget),
                           model_dtype).sizes.num_blocks
        for d in KV_DTYPES:
            q = plan_memory(cfg, EngineConfig(cache_memory_bytes=budget, kv_cache_dtype=d),
                            model_dtype).sizes.num_blocks
            assert ratio * full <= q <= ratio * full + ratio - 1, (model_dtype, d, full, q)


def test_bad_quantized_configurations_name_the_field(make_engine: Callable[..., Engine],
                                                     tiny_model: Qwen35ForCausalLM,
                                                     scale_files: dict[tuple[str, str], Path]
                                                     ) -> None:
    def where(**kw: object) -> str:
        with pytest.raises(ContractViolation) as info:
            make_engine(num_blocks=16, **kw)
        return info.value.where

    assert where(kv_cache_dtype="int4") == "kv_cache_dtype"
    assert where(kv_cache_dtype="int8", kv_quant="per-block") == "kv_quant"
    with pytest.raises(ContractViolation, match="calibrate-kv --dtype int8 --quant per-channel"):
        make_engine(num_blocks=16, kv_cache_dtype="int8")  # nothing beside the checkpoint
    assert "kv_scales" in where(kv_cache_dtype="int8",
                                kv_scales=str(scale_files[("fp8_e4m3", "per-channel")]))
    assert "kv_scales" in where(kv_cache_dtype="fp8", kv_quant="per-tensor",
                                kv_scales=str(scale_files[("fp8_e4m3", "per-channel")]))
    cache = make_engine(num_blocks=16).cache
    bad = dataclasses.replace(cache, key_cache={i: t.to(torch.int8) for i, t in
                                                cache.key_cache.items()})
    with pytest.raises(ContractViolation, match="kv_scales"):
        tiny_model.check_cache(bad)
