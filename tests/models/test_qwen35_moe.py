"""Qwen3.5-MoE hybrids (``qwen3_5_moe_text``) against HF transformers 5.24's
``Qwen3_5MoeForCausalLM``.

* checkpoints in both expert layouts load: the per-expert one transformers saves and publishes
  (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``) and the fused one it holds in memory
  (``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, written by our synthetic
  helper and read back by HF too);
* logits equal HF's (fp32) for several seeds, also when the router ties every expert (a zero
  router: softmax uniform, top-k picks by index in both); the packed forward equals the dense
  one; the engine's greedy outputs equal HF ``generate``;
* fidelity against HF float64 within 3x HF fp32's own distance to it, dense and packed, for
  routers from one-hot (sharp) to near-uniform (flat), with exact and near ties;
* (the experts' computation against a naive per-token loop, for the torch grouping and the
  native kernel alike, is ``tests/kernels/test_moe_kernel.py``'s);
* refusals naming the tensor or field: a checkpoint mixing the layouts, a missing expert, a TP
  degree that does not split the experts' channels (the TP=2 logits themselves are
  ``tests/parallel/test_tp_gloo.py``'s, on real gloo ranks);
* batch-invariant mode serves MoE bitwise (the native kernel's invariant form).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedhybrid.engine import SamplingParams
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, Qwen35Config, load
from pagedhybrid.models.qwen35.errors import CheckpointError
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_moe_config, write_checkpoint
from pagedhybrid.serve.llm import LLM


def hf_model(seed: int, zero_router: bool = False):
    cfg = transformers.Qwen3_5MoeTextConfig(**{
        **tiny_moe_config().to_hf_dict(), "tie_word_embeddings": False})
    torch.manual_seed(seed)
    m = transformers.Qwen3_5MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.08 if "norm" not in name else 0.02)
            if zero_router and name.endswith("mlp.gate.weight"):
                p.zero_()
    return m


@pytest.fixture(scope="module", params=[0, 1])
def pair(request, tmp_path_factory) -> tuple[object, Path]:
    m = hf_model(request.param, zero_router=request.param == 1)
    path = tmp_path_factory.mktemp(f"moe{request.param}")
    m.save_pretrained(path)
    return m, path


def test_transformers_saves_experts_one_tensor_each(pair) -> None:
    _, path = pair
    names = load_file(str(path / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    assert Qwen35Config.from_model_dir(path).is_moe


def test_logits_equal_hf_and_packed_equals_dense(pair) -> None:
    m, path = pair
    ours = load(path)
    x = torch.randint(0, 258, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(input_ids=x).logits[0]
        dense = ours.forward_dense(x)[0]
    assert (dense - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    cfg = ours.config
    cache = PagedHybridCache.allocate(cfg, num_pages=4, block_size=16, num_slots=1)
    packed = ours.forward_packed(PackedBatch.from_sequences([x[0].tolist()], [0], [[0, 1, 2]],
                                                            [0]), cache)
    assert (packed - dense).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


# router draws: name -> (std of the router's rows, how the rows are tied)
ROUTERS = {
    "default": (0.08, None),
    "sharp": (1.5, None),     # low temperature: near one-hot routing, large logit gaps
    "flat": (1e-3, None),     # high temperature: near-uniform probabilities, gaps ~1e-4
    "tied": (0.08, 0.0),      # experts in pairs with equal rows: exact ties, broken by index
    "near_tie": (0.08, 1e-5),  # pairs 1e-5 apart: gaps of ~1e-6, above fp32 rounding
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_fidelity_within_hf_fp32_noise_of_float64(router: str, tmp_path) -> None:
    """As the dense model's fidelity test: HF float64 is the truth, HF fp32's distance to it
    is the budget; our dense and packed fp32 logits (the native MoE kernel) lie within 3x of
    it (or 5e-5), for routers from one-hot to flat, with exact and near ties."""
    std, tie = ROUTERS[router]
    seed = sorted(ROUTERS).index(router)  # a seed of its own per router
    m = hf_model(seed)
    gen = torch.Generator().manual_seed(seed + 50)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(std * torch.randn(p.shape, generator=gen))
                if tie is not None:  # expert 2i + 1's row = expert 2i's (+ tie * noise)
                    p[1::2] = p[0::2] + tie * std * torch.randn(p[0::2].shape, generator=gen)
    m.save_pretrained(tmp_path)
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hf32 = m(input_ids=ids).logits.double()
        m.set_experts_implementation("eager")  # grouped_mm has no float64
        hf64 = m.double()(input_ids=ids).logits
    budget = (hf32 - hf64).abs().max().item()
    ours = load(tmp_path)
    assert ours.backend.modules.moe is not None  # the native kernel runs the experts
    dense = ours.forward_dense(ids)[0].double()
    cfg = ours.config
    cache = PagedHybridCache.allocate(cfg, num_pages=8, block_size=16, num_slots=2)
    batch = PackedBatch.from_sequences([ids[0].tolist(), ids[1].tolist()], [0, 0],
                                       [[0, 1, 2], [3, 4, 5]], [0, 1])
    packed = ours.forward_packed(batch, cache).double().view(2, 40, -1)
    for path, got in (("dense", dense), ("packed", packed)):
        err = (got - hf64).abs().max().item()
        print(f"{router:9s} {path:6s} err {err:.2e} hf32 {budget:.2e}")
        assert err <= max(3 * budget, 5e-5), (path, err, budget)


def test_engine_greedy_equals_hf_generate(pair) -> None:
    m, path = pair
    llm = LLM(path, dtype="float32", num_blocks=64)
    prompts = [[5, 17, 42, 99, 3], list(range(60, 100))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True), use_progress=False)
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert list(o.token_ids) == want


def test_the_fused_layout_loads_here_and_in_hf(tmp_path) -> None:
    cfg = tiny_moe_config()
    weights = random_weights(cfg, seed=5)
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    write_checkpoint(tmp_path, cfg, weights)
    ours = load(tmp_path)
    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    x = torch.randint(0, 258, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(input_ids=x).logits[0]
        got = ours.forward_dense(x)[0]
    assert (got - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_bad_moe_checkpoints_and_uses_are_refused(pair, tmp_path) -> None:
    _, path = pair
    tensors = load_file(str(path / "model.safetensors"))
    config = (path / "config.json").read_text()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.json").write_text(config)
    save_file({**tensors, "model.layers.1.mlp.experts.down_proj":
               torch.zeros(8, 64, 32)}, str(mixed / "model.safetensors"))
    with pytest.raises(CheckpointError, match="mixes the fused and the per-expert"):
        load(mixed)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(config)
    save_file({k: v for k, v in tensors.items()
               if k != "model.layers.2.mlp.experts.5.up_proj.weight"},
              str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load(missing)
    assert info.value.what == "model.layers.2.mlp.experts.5.up_proj.weight"
    from pagedhybrid.parallel.linear import ParallelConfig

    cfg = Qwen35Config.from_dict(json.loads(config))
    with pytest.raises(UnsupportedConfiguration, match="moe_intermediate_size=30"):
        dataclasses.replace(cfg, moe_intermediate_size=30).rank_local(
            ParallelConfig(tp_rank=0, tp_world_size=4))  # 30 channels on 4 ranks
    assert cfg.rank_local(ParallelConfig(tp_rank=1, tp_world_size=2)).moe_intermediate_size \
        == cfg.moe_intermediate_size // 2


def test_batch_invariant_mode_is_bitwise_for_moe(pair) -> None:
    """The native batch-invariant bundle serves MoE (its experts in the invariant kernel form):
    every request's tokens and logprobs in a mixed, chunked batch equal the request alone and
    the training-side recompute (``score``), bitwise -- with the zero router's ties too."""
    _, path = pair
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    batch = LLM(path, dtype="float32", num_blocks=64, batch_invariant=True,
                max_num_batched_tokens=16)
    assert batch.engine.model.backend.name == "native_batch_invariant"
    outs = batch.generate(prompts, params, use_progress=False)
    solo = LLM(path, dtype="float32", num_blocks=64, batch_invariant=True)

    def lps(o) -> torch.Tensor:
        return torch.tensor([d[t].logprob for d, t in zip(o.logprobs, o.token_ids,
                                                          strict=True)])

    for p, o in zip(prompts, outs, strict=True):
        ref = solo.generate([p], params, use_progress=False)[0]
        assert list(o.token_ids) == list(ref.token_ids)
        assert torch.equal(lps(o), lps(ref))
    scored = batch.engine.score(prompts, [list(o.token_ids) for o in outs])
    assert all(torch.equal(torch.tensor(s), lps(o)) for s, o in zip(scored, outs, strict=True))


def test_the_35b_a3b_geometry_builds_on_the_meta_device() -> None:
    """transformers 5.24's Qwen3.5-MoE defaults are the 35B-A3B's: 40 layers (30 GDN), hidden
    2048, 256 experts (8 routed + 1 shared) of 512 channels; built without weights it has ~35B
    parameters, ~3B of them active per token (8 of 256 experts)."""
    import math

    from pagedhybrid.models.qwen35.model import build

    cfg = Qwen35Config.from_dict({"model_type": "qwen3_5_moe_text", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}})
    assert (cfg.num_hidden_layers, len(cfg.linear_attention_layers), cfg.hidden_size) == \
        (40, 30, 2048)
    shapes = build(cfg, torch.bfloat16, "meta").expected_shapes()
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    active = total - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    assert 34e9 <= total <= 36e9 and 2.5e9 <= active <= 3.6e9, (total, active)


def test_prefix_cache_chunked_prefill_and_drafts_keep_hf_greedy(pair) -> None:
    """The engine's machinery is model-agnostic: with a prefix-cache hit, prefill chunked
    into small pieces and n-gram drafts verified, the MoE model's greedy tokens still equal
    HF ``generate``."""
    m, path = pair
    llm = LLM(path, dtype="float32", num_blocks=64, max_num_batched_tokens=24,
              state_checkpoint_interval=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = [7, 8, 9, 10] * 12  # repeats: the n-gram drafter finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = llm.generate([prompt], params, use_progress=False)[0]
    again = llm.generate([[*prompt, 11]], params, use_progress=False)[0]
    assert again.num_cached_tokens > 0
    for p, o in ((prompt, first), ([*prompt, 11], again)):
        with torch.no_grad():
            want = m.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert list(o.token_ids) == want
    assert llm.engine.stats.spec.drafts > 0
