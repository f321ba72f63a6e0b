"""A decoder layer's fields for the fused ops, resolved from ``kernels/layer_spec.py`` by
``DecoderLayer.decode_weights``: the very tensors (``is``) and scalars the hand-written gathering
gave, and ``DecodeStack``'s per-layer lists in the order it bound them."""

from __future__ import annotations

import pytest
import torch

from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.layer_spec import ATTENTION, GDN
from pagedhybrid.models.qwen35 import load
from pagedhybrid.models.qwen35.linear_attention import QK_L2_NORM_EPS
from pagedhybrid.weightquant import WeightFormat


def _held(p):  # type: ignore[no-untyped-def]
    return p.weight if p.quant is None else p.quant.codes


def _quant(projections):  # type: ignore[no-untyped-def]
    if projections[0].quant is None:
        return []
    return [t for p in projections for t in (p.quant.codes, p.quant.scales, p.quant.zeros)]


def _same(got, want) -> None:  # type: ignore[no-untyped-def]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:  # a symmetric projection's zeros: an empty uint8 tensor
            assert g.numel() == 0 and g.dtype == torch.uint8, i
        elif isinstance(w, torch.Tensor):
            assert g is w, i
        else:
            assert type(g) is type(w) and g == w, i


@pytest.mark.parametrize("product", ["plain", "int8", "int4:32:asym"])
def test_decode_weights_resolve_the_layers_own_tensors(tiny_checkpoint, product: str) -> None:
    model = load(tiny_checkpoint.path, backend=backend("native"))
    if product != "plain":
        model.quantize(WeightFormat.parse(product))
    cfg = model.config
    gdn = model.model.layers[cfg.linear_attention_layers[0]]
    full = model.model.layers[cfg.full_attention_layers[0]]
    pools = torch.zeros(1), torch.zeros(2)

    w = gdn.decode_weights()
    g, mlp = gdn.linear_attn, gdn.mlp
    assert w.spec is GDN and w is gdn.decode_weights()  # gathered once
    conv = w.args["conv_weight"]
    assert conv._base is g.conv1d.weight and conv.shape == (g.conv1d.weight.shape[0], g.kernel)
    projections = [g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a, g.out_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    held = [_held(p) for p in projections]
    tensors, ints, floats = w.bound({"conv_pool": pools[0], "pool": pools[1]})
    _same(tensors, [gdn.input_layernorm.weight, *held[:4], conv, pools[0], g.A_log, g.dt_bias,
                    pools[1], g.norm.weight, held[4], gdn.post_attention_layernorm.weight,
                    *held[5:]])
    _same(ints, [g.num_k_heads])
    _same(floats, [g.head_k_dim ** -0.5, QK_L2_NORM_EPS, g.norm.eps, gdn.input_layernorm.eps])
    _same(w.quant, _quant(projections))
    assert w.quant_bits == (0 if product == "plain" else int(product[3]))

    w = full.decode_weights()
    a, mlp = full.self_attn, full.mlp
    assert w.spec is ATTENTION
    projections = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj]
    held = [_held(p) for p in projections]
    tensors, ints, floats = w.bound({"key_cache": pools[0], "value_cache": pools[1], "split": 7})
    _same(tensors, [full.input_layernorm.weight, *held[:3], a.q_norm.weight, a.k_norm.weight,
                    *pools, held[3], full.post_attention_layernorm.weight, *held[4:]])
    _same(ints, [a.num_heads, a.num_kv_heads, 7])
    _same(floats, [a.head_dim ** -0.5, full.input_layernorm.eps])
    _same(w.quant, _quant(projections))


@pytest.mark.parametrize("path", ["packed", "dense"])
def test_the_modules_run_each_layers_program(tiny_checkpoint, monkeypatch, path: str) -> None:
    """The eager path is the declaration: each layer runs its kind's program
    (``layer_spec.GDN`` / ``ATTENTION``), op by op, in the program's order -- and a program
    changed in the declaration changes what the modules compute."""
    from pagedhybrid.models.qwen35 import decoder
    from pagedhybrid.models.qwen35.packed import PackedBatch, PagedHybridCache

    model = load(tiny_checkpoint.path, backend=backend("torch"))
    cfg = model.config
    ran: list[tuple[int, str]] = []
    for name, impl in list(decoder.LAYER_OPS.items()):
        def record(layer, step, mods, *ins, _name=name, _impl=impl):  # type: ignore[no-untyped-def]
            ran.append((layer.index, _name))
            return _impl(layer, step, mods, *ins)
        monkeypatch.setitem(decoder.LAYER_OPS, name, record)
    ids = [3, 1, 4, 1, 5]

    def forward() -> torch.Tensor:
        if path == "dense":
            return model.forward_dense(torch.tensor([ids]))[0][0]
        cache = PagedHybridCache.allocate(cfg, num_pages=1, block_size=16, num_slots=1)
        return model.forward_packed(PackedBatch.from_sequences([ids], [0], [[0]], [0]), cache)

    before = forward()
    want = [(i, op.op) for i in range(cfg.num_hidden_layers)
            for op in (ATTENTION if i in cfg.full_attention_layers else GDN).program]
    assert ran == want
    # a program without its layers' MLPs (norm, mlp, add dropped): the modules follow it
    monkeypatch.setattr(decoder, "GDN", GDN._replace(program=GDN.program[:-3]))
    monkeypatch.setattr(decoder, "ATTENTION", ATTENTION._replace(program=ATTENTION.program[:-3]))
    ran.clear()
    after = forward()
    assert "mlp" not in {op for _, op in ran} and not torch.equal(before, after)
