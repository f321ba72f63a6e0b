"""Projection weights in int8 / int4 (``EngineConfig.quantization``) through the engine.

* the native engine serves every format and agrees with the reference bundle's product
  (``weightquant.reference_linear``, float64) token for token, logprobs within one activation
  code's flip (the kernels are compared tightly in ``tests/kernels/test_quant_kernel.py``);
* a quantised engine against the fp32 model holding the dequantised weights: the activations'
  int8 codes are the only difference, within the stated tolerance (and the same greedy tokens);
* batch-invariant mode with int4 weights: a request's logprobs equal it run alone, bitwise;
* the model really holds codes: the fp32 weights are released (meta placeholders), the tied
  LM head gets its own codes while the embedding keeps the table, routers stay unquantised;
  the kernel line names the format and the CPU's int8 dot instruction; the codes lie in one
  huge-page arena, exactly sized;
* ``huge_pages`` (default on, ``--no-huge-pages``): plain projections copied out of the
  checkpoint's mapping or left as its views, the same tokens and logprobs either way;
* bad configurations are refused by name: an unknown format, a bundle without a quantised
  product (torch), a model quantised twice in different formats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import prompt_of, run_all

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams, SequenceOutput
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.native import status
from pagedhybrid.models.qwen35 import Qwen35ForCausalLM, load
from pagedhybrid.models.qwen35.weights import HUGE_PAGE, HugePageArena, is_mapped, thp_mode
from pagedhybrid.serve.offline_cli import _engine_kwargs, add_engine_arguments
from pagedhybrid.weightquant import WeightFormat, dequantize, quantized_nbytes

PROMPTS = [prompt_of(s, n) for s, n in ((1, 9), (2, 40), (3, 75), (4, 20))]
SCORE = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0,
                       logprobs=0)
FORMATS = ["int8", "int4", "int4:128:asym"]
# |dlogp| of a quantised engine vs the fp32 model on its dequantised weights: the activations'
# int8 codes per 32 elements (relative error <= 1/254 each) -- measured 0.017-0.025 here
ACT_TOL = 0.08


@pytest.fixture(autouse=True)
def _native_kernels_built() -> None:
    assert status().available, status().reason


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = SCORE
        ) -> list[SequenceOutput]:
    return run_all(engine, prompts, params)


def logprobs(out: SequenceOutput) -> torch.Tensor:
    assert out.prompt_logprobs is not None and out.logprobs is not None
    prompt = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:],
                                           strict=True)]
    gen = [d[t].logprob for d, t in zip(out.logprobs, out.token_ids, strict=True)]
    return torch.tensor(prompt + gen, dtype=torch.float64)


def engine(tiny_dir: Path, **kw: object) -> Engine:
    return Engine(load(tiny_dir, dtype=torch.float32),
                  EngineConfig(num_blocks=64, enable_prefix_caching=False, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", FORMATS)
def test_native_equals_the_reference_product(tiny_dir: Path, spec: str) -> None:
    # one prompt per step keeps every product below the prefill form's DEQUANT_ROWS rows, so
    # both bundles quantise the activations alike
    short = [p for p in PROMPTS if len(p) < 60]
    nat = [run(engine(tiny_dir, quantization=spec, max_num_seqs=1), [p])[0] for p in short]
    ref = [run(engine(tiny_dir, quantization=spec, backend="reference", max_num_seqs=1), [p])[0]
           for p in short]
    for a, b in zip(nat, ref, strict=True):
        assert a.token_ids == b.token_ids
        # the bundles' attention / state kernels differ at float noise, which can move an
        # activation across a rounding boundary: one int8 code apart, ~1/254 of a sub-block
        torch.testing.assert_close(logprobs(a), logprobs(b), rtol=0, atol=0.02)


@pytest.mark.parametrize("spec", FORMATS)
def test_quantised_engine_vs_the_dequantised_fp32_model(tiny_dir: Path, spec: str) -> None:
    quantised = engine(tiny_dir, quantization=spec)
    plain = load(tiny_dir, dtype=torch.float32)
    held = dict(quantised.model.named_modules())
    for name, m in plain.named_modules():  # the very values the codes stand for
        q = getattr(held.get(name), "quant", None)
        if q is not None:
            m.weight = torch.nn.Parameter(dequantize(q), requires_grad=False)
    reference = Engine(plain, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    a, b = run(quantised, PROMPTS), run(reference, PROMPTS)
    worst = max((logprobs(x) - logprobs(y)).abs().max().item() for x, y in zip(a, b, strict=True))
    assert worst < ACT_TOL, worst
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)) >= len(PROMPTS) - 1


def test_batch_invariant_with_int4_weights(tiny_dir: Path) -> None:
    e = engine(tiny_dir, quantization="int4", batch_invariant=True, max_num_batched_tokens=2048)
    assert e.runner.kernels.backend.name == "native_batch_invariant"
    together = run(e, PROMPTS)
    for p, out in zip(PROMPTS, together, strict=True):
        alone = run(e, [p])[0]
        assert alone.token_ids == out.token_ids
        assert torch.equal(logprobs(alone), logprobs(out))


def test_the_model_holds_codes(tiny_dir: Path) -> None:
    import dataclasses

    from pagedhybrid.models.qwen35.synthetic import (
        random_weights,
        tiny_byte_config,
        write_checkpoint,
    )

    e = engine(tiny_dir, quantization="int4")
    model = e.model
    assert model.weight_format == WeightFormat.parse("int4")
    proj = model.model.layers[0].mlp.down_proj
    assert proj.quant is not None and proj.weight.is_meta
    assert proj.quant.codes.dtype == torch.uint8 and proj.quant.scales.dtype == torch.float16
    assert not model.model.embed_tokens.weight.is_meta
    # every projection's codes and scales in one huge-page arena, exactly sized
    held = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    ptrs = sorted(t.data_ptr() for q in held for t in (q.codes, q.scales))
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert all(quantized_nbytes(q.shape, q.fmt) == (q.codes.numel(), 2 * q.scales.numel(), 0)
               for q in held)
    assert ptrs[-1] - ptrs[0] < sum(HugePageArena.room(n) for q in held
                                    for n in quantized_nbytes(q.shape, q.fmt))
    summary = e.runner.kernel_summary()
    assert "int4 weights: quant.linear (" in summary
    assert "weights in huge pages: " in summary and f"MiB granted (THP {thp_mode()})" in summary
    assert ("vpdpbusd" if status().isa in ("avx512_bf16", "avx512_vnni") else "vpmaddubsw") \
        in summary
    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    prefetch = "NTA 2 KiB ahead (AMD)" if amd else "T0 4 KiB ahead"
    assert f"codes in groups of 16 rows; prefetched {prefetch}" in summary
    # tied head: its own codes, the table kept; a MoE model's routers stay in the model dtype
    cfg = dataclasses.replace(tiny_byte_config(), num_hidden_layers=2,
                              layer_types=("linear_attention", "full_attention"),
                              tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=16)
    path = tiny_dir.parent / "tiny-moe-tied"
    if not path.exists():
        write_checkpoint(path, cfg, random_weights(cfg, seed=3))
    moe = load(path, dtype=torch.float32)
    moe.quantize(WeightFormat.parse("int8"))
    assert moe.lm_head.quant is not None and not moe.model.embed_tokens.weight.is_meta
    block = moe.model.layers[0].mlp
    assert block.gate.quant is None and block.shared_expert_gate.quant is None
    assert block.shared_expert.down_proj.quant is not None
    out = run(Engine(moe, EngineConfig(num_blocks=64)), PROMPTS[:2])
    assert all(len(o.token_ids) == SCORE.max_tokens for o in out)


def test_bad_configurations_are_refused_by_name(tiny_dir: Path) -> None:
    with pytest.raises(ContractViolation, match="'quantization' must be int8 or int4"):
        EngineConfig(quantization="int5")
    with pytest.raises(UnsupportedConfiguration, match=r"torch: .*int4 weights are unsupported"):
        engine(tiny_dir, quantization="int4", backend="torch")
    model = load(tiny_dir, dtype=torch.float32)
    model.quantize(WeightFormat.parse("int4"))
    with pytest.raises(UnsupportedConfiguration, match="already held as int4"):
        model.quantize(WeightFormat.parse("int8"))
    model.quantize(WeightFormat.parse("int4"))  # the same format again: nothing to do
    assert isinstance(model, Qwen35ForCausalLM)


def test_huge_pages_option(tiny_dir: Path) -> None:
    """Default (``huge_pages``): the plain projections leave the checkpoint's mapping for one
    huge-page arena; off (``--no-huge-pages``): they stay views of it. Same tokens either way."""
    import argparse

    outs = []
    for huge in (True, False):
        e = engine(tiny_dir, huge_pages=huge)
        projs = [m.weight for m in e.model.modules() if hasattr(m, "quant")]
        assert all(is_mapped(w) != huge for w in projs)
        if huge:
            assert min(w.data_ptr() for w in projs) % HUGE_PAGE == 0
        else:
            assert "ordinary pages (--no-huge-pages)" in e.runner.kernel_summary()
        outs.append(run(e, PROMPTS[:2]))
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(torch.equal(logprobs(a), logprobs(b)) for a, b in zip(*outs, strict=True))
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert _engine_kwargs(p.parse_args([]))["huge_pages"] is True
    assert _engine_kwargs(p.parse_args(["--no-huge-pages"]))["huge_pages"] is False
