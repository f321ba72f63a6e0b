"""The one kernel registry: selection with reasons, typed refusals, never a silent fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedhybrid.engine import Engine, EngineConfig
from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels import backend as registry
from pagedhybrid.kernels import native
from pagedhybrid.models.qwen35 import build
from pagedhybrid.models.qwen35.synthetic import random_weights, tiny_byte_config


def _model(**overrides: object) -> torch.nn.Module:
    cfg = dataclasses.replace(tiny_byte_config(), **overrides)
    model = build(cfg, torch.float32, "cpu")
    model.load_weights(random_weights(cfg, 0))
    return model.eval()


def test_auto_selects_the_prebuilt_native_kernels() -> None:
    st = native.status()
    assert st.available, st.reason  # make test builds the extension before the tests
    sel = registry.select("auto", tiny_byte_config(), torch.bfloat16)
    assert sel.backend.name == "native" and "native" in sel.reason
    assert sel.backend.capability.in_place_state and sel.backend.capability.paged_in_place
    for name in registry.BACKENDS:
        assert registry.select(name, tiny_byte_config()).backend is registry.backend(name)
        assert registry.backend(name).describe()["name"] == name


def test_refusals_are_typed_and_name_the_reason() -> None:
    with pytest.raises(UnsupportedConfiguration, match="unknown kernel backend 'cuda'"):
        registry.select("cuda")
    with pytest.raises(UnsupportedConfiguration, match=r"native.*float64"):
        registry.select("native", tiny_byte_config(), torch.float64)
    wide = dataclasses.replace(tiny_byte_config(), head_dim=272, mrope_section=(12, 11, 11))
    with pytest.raises(UnsupportedConfiguration, match="head_dim <= 256"):
        registry.select("native", wide)
    sel = registry.select("auto", wide)  # auto says why it runs the torch kernels
    assert sel.backend.name == "torch" and "head_dim <= 256" in sel.reason


def test_engine_refuses_at_construction_and_reports_fallbacks(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    wide = _model(head_dim=272, mrope_section=(12, 11, 11))
    with pytest.raises(UnsupportedConfiguration, match="head_dim"):
        Engine(wide, EngineConfig(backend="native", num_blocks=8))
    engine = Engine(wide, EngineConfig(backend="auto", num_blocks=8))
    assert engine.model.backend.name == "torch"
    assert "torch kernels (auto; passed over: native: native attention needs head_dim" in \
        capsys.readouterr().err
    # a missing extension is said once, at engine start
    missing = native.NativeStatus(False, "native extension not built (run `make native`)", None)
    monkeypatch.setattr(native, "status", lambda: missing)
    engine = Engine(_model(), EngineConfig(num_blocks=8))
    assert engine.model.backend.name == "torch" and missing.reason in engine.kernels.reason
    assert capsys.readouterr().err.count("pagedhybrid:") == 1  # one line, at engine start
    with pytest.raises(UnsupportedConfiguration, match="not built"):
        Engine(_model(), EngineConfig(backend="native", num_blocks=8))


def test_one_registry_holds_the_bundles_and_their_batch_invariance() -> None:
    """The model's bundles are the kernel registry's backends: contract dispatch and the model's
    selection read the same capabilities (the contract one derived from the bundle's)."""
    from pagedhybrid.attention.backends import build_default_registry
    from pagedhybrid.attention.capability import AttentionBackendCapability
    from pagedhybrid.attention.contract import ReductionSpec

    reg = build_default_registry()
    steps = {b.step.name: b for b in reg.backends if b.step is not None}
    assert list(steps) == list(registry.BACKENDS)  # priority order
    for name, entry in steps.items():
        assert entry.step is registry.backend(name)
        assert entry.backend_id == entry.step.contract_id
        assert entry.capability == AttentionBackendCapability.from_bundle(entry.step)
        assert entry.capability.batch_invariant == entry.step.capability.batch_invariant
        assert entry.capability.batch_invariant == (name == "native_batch_invariant")
    assert ReductionSpec(batch_invariant=True).batch_invariant
    sel = registry.select("auto", tiny_byte_config(), torch.float32, batch_invariant=True)
    assert sel.backend.name == "native_batch_invariant"
    assert "native: batch-invariant reduction is unsupported" in sel.reason


def test_a_stale_build_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "source_digest", lambda: "0" * 16)
    native.status.cache_clear()
    try:
        st = native.status()
        assert not st.available and "stale" in st.reason
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
    assert native.status().available


def test_needs_go_into_the_choice_and_every_rejection_says_why() -> None:
    """Prefix caching (state checkpoints), KV page dtype and batch invariance are part of the
    choice: ``auto`` passes over a bundle that cannot serve them, naming the reason, instead of
    picking it and failing afterwards."""
    from pagedhybrid.kernels.registry import KernelRegistry, Needs

    ref, torch_ = registry.backend("reference"), registry.backend("torch")
    assert not ref.capability.state_checkpoints and torch_.capability.state_checkpoints
    # a registry whose first bundle cannot checkpoint states
    reg = KernelRegistry((dataclasses.replace(ref, name="fast_no_ckpt", contract_id="a"),
                          dataclasses.replace(torch_, contract_id="b")))
    plain = reg.select(Needs(config=tiny_byte_config()))
    assert plain.backend.name == "fast_no_ckpt" and plain.rejections == {}
    caching = reg.select(Needs(config=tiny_byte_config(), prefix_caching=True))
    assert caching.backend.name == "torch" and caching.needs is not None
    assert list(caching.rejections) == ["fast_no_ckpt"]
    assert "prefix caching needs state checkpoints" in caching.rejections["fast_no_ckpt"][0]
    assert "passed over: fast_no_ckpt: prefix caching" in caching.reason
    # the process registry: auto with prefix caching never lands on the reference bundle
    for needs in (Needs(config=tiny_byte_config(), prefix_caching=True),
                  Needs(config=tiny_byte_config(), prefix_caching=True,
                        kv_page_dtype=torch.int8)):
        assert registry.select(needs=needs).backend.capability.state_checkpoints
    with pytest.raises(UnsupportedConfiguration,
                       match=r"kernel backend 'reference'.*prefix caching.*intermediate states"):
        registry.select(needs=Needs("reference", prefix_caching=True))
    assert registry.select(needs=Needs("reference")).backend is ref
    # KV page dtypes are declared: a bundle without quantized pages is passed over
    narrow = dataclasses.replace(torch_, name="no_int8", contract_id="c", capability=(
        dataclasses.replace(torch_.capability, kv_page_dtypes=(torch.float32,))))
    reg = KernelRegistry((narrow, dataclasses.replace(torch_, contract_id="d")))
    sel = reg.select(Needs(kv_page_dtype=torch.int8))
    assert sel.backend.name == "torch"
    assert sel.rejections == {"no_int8": ("KV pages of int8 are unsupported (it reads fp32)",)}
    with pytest.raises(UnsupportedConfiguration, match=r"no_int8: KV pages of float8_e4m3fn"):
        reg.select(Needs("no_int8", kv_page_dtype=torch.float8_e4m3fn))
    # every bundle's reasons at once, and typed refusals of bad needs
    every = registry.REGISTRY.rejections(Needs(dtype=torch.float16, batch_invariant=True))
    assert list(every) == list(registry.BACKENDS)
    assert every["native_batch_invariant"][0].startswith("dtype=fp16 is unsupported")
    assert all("batch-invariant" in r[0] for n, r in every.items() if n != "native_batch_invariant")
    with pytest.raises(ContractViolation, match="tp_world_size"):
        Needs(tp_world_size=0)
    with pytest.raises(ContractViolation, match="dtype"):
        Needs(dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="either needs"):
        registry.select("torch", needs=Needs())


def test_the_older_call_form_is_the_same_choice() -> None:
    from pagedhybrid.kernels.registry import Needs

    for name in ("auto", *registry.BACKENDS):
        for dtype in (torch.float32, torch.bfloat16):
            for inv in (False, True):
                try:
                    old = registry.select(name, tiny_byte_config(), dtype, batch_invariant=inv)
                except UnsupportedConfiguration as e:
                    with pytest.raises(UnsupportedConfiguration) as new:
                        registry.select(needs=Needs(name, dtype, tiny_byte_config(),
                                                    batch_invariant=inv))
                    assert str(new.value) == str(e)
                    continue
                new_sel = registry.select(needs=Needs(name, dtype, tiny_byte_config(),
                                                      batch_invariant=inv))
                assert new_sel.backend is old.backend and new_sel.reason == old.reason
    # the deprecated string view still says what the engine of today reads
    assert "state_checkpoints" in registry.backend("torch").features
    assert "state_checkpoints" not in registry.backend("reference").features


def test_contract_dispatch_reads_the_bundle_head_dim_limit() -> None:
    """The derived contract capability carries the native tile's head_dim limit."""
    from pagedhybrid.attention.backends import default_registry

    entry = default_registry().backend(registry.backend("native").contract_id)
    assert entry.step is registry.backend("native")
    assert entry.capability is not None and entry.capability.max_head_dim == 256
    assert default_registry().get_op(entry.backend_id) is entry.step.ops.paged_attention


def test_kernels_select_command_prints_the_choice_and_every_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from pagedhybrid.kernels.webgpu.cli import main

    assert main(["select", "--dtype", "bf16", "--kv-cache-dtype", "int8",
                 "--batch-invariant"]) == 0
    text = capsys.readouterr().out
    assert "KV pages int8, prefix caching, batch invariance" in text
    assert "selected: native_batch_invariant kernels (auto; passed over: native: " \
        "batch-invariant reduction is unsupported" in text
    assert "  native_batch_invariant: selected" in text
    assert "  reference: prefix caching needs state checkpoints" in text
    assert main(["select", "--backend", "reference", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["selected"] is None and "intermediate states" in d["reason"]
    assert [b["name"] for b in d["bundles"]] == list(registry.BACKENDS)
    assert main(["select", "--backend", "reference", "--no-prefix-caching"]) == 0
    assert "selected: reference kernels (requested)" in capsys.readouterr().out
