"""Declared capabilities of the torch kernels, and every backend inside the packed model."""

from __future__ import annotations

import importlib
import json

import torch

from pagedhybrid.kernels import cpu
from pagedhybrid.kernels.backend import backend
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, Qwen35Config, build

gdn_ref = importlib.import_module("pagedhybrid.ops.gated_delta_net")
pa_ref = importlib.import_module("pagedhybrid.ops.paged_attention")
conv_ref = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")


def test_coverage_names_every_op_and_delegates_nothing_silently() -> None:
    from pagedhybrid.kernels.backend import REGISTRY

    ops = {"com.microsoft.PagedAttention", "com.microsoft.VarlenCausalConvWithState",
           "com.microsoft.GatedDeltaNet"}
    assert set(cpu.COVERAGE) == ops
    # the one registry carries each fast bundle's op coverage (the reference covers all)
    assert REGISTRY.bundle("torch").ops.coverage is cpu.COVERAGE
    assert set(REGISTRY.bundle("native").ops.coverage) == ops
    assert REGISTRY.bundle("reference").ops.coverage == {}
    assert set(REGISTRY.bundle("native").describe()["op_coverage"]) == ops
    for cap in cpu.COVERAGE.values():
        json.dumps(cap.describe())
        assert cap.delegated == {}  # every contract feature runs on the fast path
        assert torch.float32 in cap.dtypes and torch.bfloat16 in cap.dtypes
    pa = cpu.COVERAGE["com.microsoft.PagedAttention"]
    assert pa.supports("softcap") and pa.supports("head_sink") and pa.supports("do_rotary")
    assert not pa.supports("quantized_cache")


def test_signatures_equal_the_references() -> None:
    import inspect

    for fast, ref in ((cpu.paged_attention, pa_ref.paged_attention),
                      (cpu.varlen_causal_conv, conv_ref.varlen_causal_conv),
                      (cpu.gated_delta_net, gdn_ref.gated_delta_net)):
        assert inspect.signature(fast) == inspect.signature(ref), fast.__name__


TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "full_attention_interval": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                        "mrope_interleaved": True},
}


def test_packed_model_steps_equal_on_every_backend() -> None:
    # model-level tolerance 1e-4: per-op differences (~1e-7) compound through the layers
    config = Qwen35Config.from_dict(TINY)
    model = build(config, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else
                                                           p.shape[-1] ** -0.5))
    model.eval()
    bs = 16
    pages = [[3, 0, 5, 7, 9], [1, 2], [4, 6, 8]]
    slots = [2, 0, 1]
    steps = [  # (new tokens per sequence, past lengths): prefill, mixed, decode
        ([list(range(1, 71)), [5, 6, 7], [9]], [0, 0, 0]),
        ([[11], [12, 13, 14, 15], list(range(20, 40))], [70, 3, 1]),
        ([[17], [18], [19]], [71, 7, 21]),
    ]
    caches = {name: PagedHybridCache.allocate(config, num_pages=10, block_size=bs, num_slots=3,
                                              fill=None, generator=torch.Generator()
                                              .manual_seed(1))
              for name in ("reference", "torch", "native")}
    for toks, past in steps:
        batch = PackedBatch.from_sequences(toks, past, pages, slots)
        logits = {}
        for name, cache in caches.items():
            model.use_backend(backend(name))
            logits[name] = model.forward_packed(batch, cache)
        for name in ("torch", "native"):
            torch.testing.assert_close(logits[name], logits["reference"], rtol=1e-4, atol=1e-4)
    ref_c = caches["reference"]
    for fast_c in (caches["torch"], caches["native"]):
        for i in config.full_attention_layers:
            torch.testing.assert_close(fast_c.key_cache[i], ref_c.key_cache[i], rtol=1e-4,
                                       atol=1e-4)
        for i in config.linear_attention_layers:
            torch.testing.assert_close(fast_c.recurrent_state[i], ref_c.recurrent_state[i],
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(fast_c.conv_state[i], ref_c.conv_state[i], rtol=1e-4,
                                       atol=1e-4)
