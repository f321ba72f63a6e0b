"""The MTP drafter: drafts from the checkpoint's multi-token-prediction head (``mtp.*``).

* the head's drafts after every step -- its catch-up over the step's committed rows (prefill
  chunks, decodes, verify chunks with rejected drafts) and its k-step chain -- equal a dense run
  of the same head over the whole sequence (causal attention from scratch, no pages);
* greedy output with MTP speculation equals the output without it, with chunked prefill,
  prefix caching, preemption and int8 KV pages; seeded sampling repeats;
* the built-in model's trained head gets most drafts accepted;
* loading: the head is read only when asked (HF transformers still loads the folder), and
  ``method="mtp"`` without a head is refused by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import TINY_LAYERS
from engine_helpers import prompt_of
from test_speculative import run

from pagedhybrid.engine import Engine, EngineConfig, SamplingParams, load_engine
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35 import (
    PackedBatch,
    PagedHybridCache,
    Qwen35ForCausalLM,
    load,
)
from pagedhybrid.models.qwen35.decoder import DenseStep
from pagedhybrid.models.qwen35.rope import mrope_cos_sin
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config, write_checkpoint

K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = dataclasses.replace(tiny_byte_config(), num_hidden_layers=len(TINY_LAYERS),
                              layer_types=TINY_LAYERS, tie_word_embeddings=False,
                              mtp_num_hidden_layers=1)
    path = tmp_path_factory.mktemp("tiny-mtp")
    write_checkpoint(path, cfg, random_weights(cfg, seed=11))
    return path


@pytest.fixture(scope="module")
def mtp_model(mtp_dir: Path) -> Qwen35ForCausalLM:
    return load(mtp_dir, dtype=torch.float32, mtp=True)


def _hidden(model: Qwen35ForCausalLM, tokens: Sequence[int]) -> torch.Tensor:
    """The main model's final-norm hidden of every token ``[S, hidden]`` (one packed step)."""
    n = len(tokens)
    cache = PagedHybridCache.allocate(model.config, num_pages=-(-n // 16), block_size=16,
                                      num_slots=1)
    out: list[torch.Tensor] = []
    model.forward_packed(PackedBatch.from_sequences([list(tokens)], [0],
                                                    [list(range(-(-n // 16)))], [0]),
                         cache, hidden=out)
    return out[0]


def _head_dense(model: Qwen35ForCausalLM, hidden: torch.Tensor, nxt: Sequence[int]
                ) -> torch.Tensor:
    """The MTP head over whole rows from scratch (dense causal attention): ``[S, hidden]``."""
    head = model.mtp
    assert head is not None
    s = hidden.shape[0]
    x = torch.cat([head.pre_fc_norm_embedding(model.model.embed_tokens(
        torch.tensor(list(nxt), dtype=torch.int64))), head.pre_fc_norm_hidden(hidden)], dim=-1)
    h = head.fc(x)
    layer, cfg = head.layer, model.config
    cos, sin = mrope_cos_sin(cfg, torch.arange(s).view(1, -1).expand(3, -1))
    step = DenseStep(cos, sin, StepMetadata.dense(1, s, 0), 1, {}, {}, {}, {}, {}, {},
                     model.backend)  # the layer's program, its attention over no past
    return head.norm(layer(h, step))


def reference_drafts(model: Qwen35ForCausalLM, tokens: Sequence[int], k: int) -> list[int]:
    """The head's k-step chain after ``tokens`` (the last one not yet computed), dense."""
    hidden = _hidden(model, tokens[:-1])  # h_0 .. h_{n-2}
    nxt = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(k):
        out = _head_dense(model, hidden, nxt)
        drafts.append(int(model.lm_head(out[-1:]).float().argmax()))
        hidden = torch.cat([hidden, out[-1:]])
        nxt.append(drafts[-1])
    return drafts


def test_drafts_equal_a_dense_run_of_the_head(mtp_model: Qwen35ForCausalLM) -> None:
    """After every step (chunked prefills of two requests, then decodes and verify chunks whose
    drafts are mostly rejected: the head is random), each drafted request's drafts are the
    dense head's chain over its tokens so far."""
    engine = Engine(mtp_model, EngineConfig(num_blocks=32, max_num_batched_tokens=24,
                                            speculative_config=MTP))
    for rid, (s, n) in (("a", (1, 30)), ("b", (2, 9))):
        engine.add_request(rid, prompt_of(s, n), GREEDY)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
        for req in engine.scheduler.running:
            if req.draft_ids:
                assert list(req.draft_ids) == reference_drafts(mtp_model, req.token_ids, K), \
                    (req.request_id, req.num_tokens)
                checked += 1
    assert checked >= 10
    assert engine.stats.spec.draft_tokens >= 10 * K  # full chains: the lookahead pages held


@pytest.mark.parametrize("extra", [
    {},
    {"num_blocks": 12, "max_num_batched_tokens": 16},  # preemption and chunked prefill
    {"kv_cache_dtype": "int8"},
])
def test_greedy_output_is_unchanged(mtp_model: Qwen35ForCausalLM, mtp_dir: Path,
                                    tmp_path: Path, extra: dict[str, object]) -> None:
    kw: dict[str, object] = {"num_blocks": 64, **extra}
    if "kv_cache_dtype" in kw:
        from pagedhybrid.calibrate_kv import channel_amax, scales_from_amax
        from pagedhybrid.kvquant import KV_DTYPES, save_scales

        amax, _ = channel_amax(mtp_model, prompt_of(99, 300), 256)
        kw["kv_scales"] = str(save_scales(
            tmp_path / "s.safetensors", scales_from_amax(amax, KV_DTYPES["int8"], "per-channel"),
            KV_DTYPES["int8"], "per-channel"))
    work = [(prompt_of(s, n), GREEDY) for s, n in ((1, 40), (2, 9), (3, 23), (1, 40))]
    base = run(Engine(mtp_model, EngineConfig(**kw)), work)  # type: ignore[arg-type]
    spec = Engine(mtp_model, EngineConfig(**kw, speculative_config=MTP))  # type: ignore[arg-type]
    got = run(spec, work)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in base.items()}
    assert spec.stats.spec.draft_tokens > 0


@pytest.mark.parametrize("spec", ["int4", "int8"])
def test_greedy_output_is_unchanged_with_quantized_weights(mtp_dir: Path, spec: str) -> None:
    """The main model, the head's ``fc`` and the LM head in codes (in groups of 16 rows where N
    allows, in rows elsewhere), drafted and verified through the fused native calls: drafting
    changes no token."""
    from pagedhybrid.parallel.linear import ReplicatedLinear

    work = [(prompt_of(s, n), GREEDY) for s, n in ((1, 40), (2, 9), (3, 23))]
    base = run(Engine(load(mtp_dir, dtype=torch.float32, mtp=True),
                      EngineConfig(num_blocks=64, quantization=spec)), work)
    model = load(mtp_dir, dtype=torch.float32, mtp=True)
    engine = Engine(model, EngineConfig(num_blocks=64, quantization=spec,
                                        speculative_config=MTP))
    got = run(engine, work)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in base.items()}
    assert engine.stats.spec.draft_tokens > 0
    held = [m.quant for m in model.modules() if isinstance(m, ReplicatedLinear)
            and m.quant is not None]
    assert any(q.grouped for q in held) and not all(q.grouped for q in held)


def test_prefix_cache_a_b_a(mtp_model: Qwen35ForCausalLM) -> None:
    """A, then B sharing A's first pages, then A again, one at a time (each a prefix hit on
    the pages and checkpoints the others left, the head's K/V among them): every output equals
    a cold engine's without speculation."""
    a = prompt_of(5, 50)
    b = a[:37] + prompt_of(6, 20)
    spec = Engine(mtp_model, EngineConfig(num_blocks=64, state_checkpoint_interval=16,
                                          speculative_config=MTP))
    for i, p in enumerate((a, b, a)):
        cold = run(Engine(mtp_model, EngineConfig(num_blocks=64, enable_prefix_caching=False)),
                   [(p, GREEDY)])
        got = run(spec, [(p, GREEDY)], [f"x{i}"])
        assert got[f"x{i}"].token_ids == cold["r0"].token_ids, i
        if i:
            assert got[f"x{i}"].num_cached_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_head_equals_its_steps_bit_for_bit(mtp_dir: Path, dtype: torch.dtype) -> None:
    """The native bundle's head kernels (``Backend.mtp``) -- ``head_input`` / ``head_output``
    for a catch-up, ``chain`` for a whole chain in one call, ``draft`` for both -- give the
    drafts, the head's hidden and the head's K/V pages of the same head run step by step
    through the modules, to the bit: two chains, one across a page boundary, one of a single
    step."""
    native = backend("native")
    stepwise = dataclasses.replace(native, mtp=None)
    model = load(mtp_dir, dtype=dtype, mtp=True, backend=native)
    cfg, head_layer = model.config, model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(3)
    cache = PagedHybridCache.allocate(cfg, num_pages=8, block_size=16, num_slots=2, dtype=dtype,
                                      fill=None, generator=gen, mtp=True)
    hidden = torch.randn(4, cfg.hidden_size, generator=gen).to(dtype)
    tables = [[4, 1, 6], [2]]
    ids, results = torch.tensor([9, 4, 1, 6]), []
    for bundle in (native, stepwise, native):
        model.use_backend(bundle)
        c = cache.clone()
        if len(results) < 2:  # the catch-up (forward_mtp), then the chains (mtp_chain)
            meta = StepMetadata.build([3, 1], [12, 4], tables, [0, 1], block_size=16,
                                      num_pages=8, num_slots=2, verify=[0])  # a verify chunk's
            picks, out = model.forward_mtp(ids, hidden, meta, c, torch.tensor([2, 3]),
                                           greedy=True)
            drafts, state = model.mtp_chain(picks, out[[2, 3]], [15, 5], [4, 1], tables, c)
            drafts = torch.cat([picks[:, None], drafts], dim=1)
        else:  # both in one call
            fused = model.mtp_draft(ids, hidden, [3, 1], [12, 4], tables, [2, 3], [15, 5],
                                    [4, 1], tables, c)
            assert fused is not None
            drafts, state = fused
        results.append((drafts, state, c.key_cache[head_layer], c.value_cache[head_layer]))
    for got, want, one_call in zip(*results, strict=True):
        assert torch.equal(got, want) and torch.equal(one_call, want)
    drafts = results[0][0]
    assert drafts.shape == (2, 5) and bool((drafts[0] >= 0).all())
    assert bool((drafts[1, :2] >= 0).all()) and bool((drafts[1, 2:] == -1).all())
    model.use_backend(native)  # a catch-up with nothing to draft from picks nothing
    picks, out = model.forward_mtp(ids, hidden, meta, cache.clone(),
                                   torch.zeros(0, dtype=torch.int64), greedy=True)
    assert picks.shape == (0,) and out.shape == hidden.shape


def test_a_failing_drafter_costs_only_its_drafts(mtp_model: Qwen35ForCausalLM) -> None:
    class Broken:
        def propose(self, requests: Sequence[object], k: int) -> None:
            raise RuntimeError("drafter bug")

    work = [(prompt_of(s, 12), GREEDY) for s in (1, 2)]
    base = run(Engine(mtp_model, EngineConfig(num_blocks=64)), work)
    spec = Engine(mtp_model, EngineConfig(num_blocks=64, speculative_config=MTP))
    spec.drafter = Broken()
    got = run(spec, work)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in base.items()}
    assert spec.stats.spec.drafter_failures > 0 and spec.stats.spec.drafts == 0


def test_seeded_sampling_repeats(mtp_model: Qwen35ForCausalLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=24)
    work = [(prompt_of(s, 12), params) for s in (1, 2)]
    outs = [run(Engine(mtp_model, EngineConfig(num_blocks=64, speculative_config=MTP)), work)
            for _ in range(2)]
    assert {k: v.token_ids for k, v in outs[0].items()} == \
        {k: v.token_ids for k, v in outs[1].items()}


def test_the_builtin_models_head_is_accepted() -> None:
    """The shipped model's trained head on four held-out passages: greedy output bitwise
    unchanged, most first drafts accepted (an untrained head gets almost none)."""
    from pagedhybrid.models.qwen35.default_model import heldout_text_path

    lines = [x for x in heldout_text_path().read_text().splitlines() if x.strip()]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    # batch-invariant kernels: a verify chunk's rows round as one-token decodes do, so greedy
    # output is bitwise the same (the default kernels' multi-row products may flip a bf16 tie)
    off = load_engine(None, num_blocks=256, batch_invariant=True)
    on = load_engine(None, num_blocks=256, batch_invariant=True, speculative_config=MTP)
    tok = off.tokenizer
    assert tok is not None
    work = [(tok.encode("\n".join(lines[i:i + 4])), params) for i in (10, 200, 400, 600)]
    want, got = run(off, work), run(on, work)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    spec = on.stats.spec
    assert spec.accepted_per_pos[0] / spec.drafts > 0.55, spec
    assert spec.accepted_tokens / spec.draft_tokens > 0.33, spec


def test_the_head_is_read_only_when_asked(mtp_dir: Path) -> None:
    import transformers

    plain = load(mtp_dir, dtype=torch.float32)
    assert plain.mtp is None and not any(k.startswith("mtp.") for k in plain.state_dict())
    with_head = load(mtp_dir, dtype=torch.float32, mtp=True)
    assert {k for k in with_head.state_dict() if k.startswith("mtp.")} >= {
        "mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight",
        "mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.q_proj.weight"}
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_of(4, 10)])
    with torch.no_grad():
        ours, _ = plain.forward_dense(ids)
        torch.testing.assert_close(ours, hf(ids).logits.float(), atol=1e-4, rtol=1e-4)


def test_mtp_without_a_head_is_refused_by_field(tiny_dir: Path,
                                                tiny_model: Qwen35ForCausalLM) -> None:
    with pytest.raises(ContractViolation, match=r"speculative_config.*method"):
        load_engine(tiny_dir, dtype="float32", num_blocks=16, speculative_config=MTP)
    with pytest.raises(ContractViolation, match=r"speculative_config.*method"):
        Engine(tiny_model, EngineConfig(num_blocks=16, speculative_config=MTP))
    with pytest.raises(UnsupportedConfiguration, match="mtp_num_hidden_layers"):
        load(tiny_dir, dtype=torch.float32, mtp=True)
