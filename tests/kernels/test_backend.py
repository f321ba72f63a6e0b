"""The one kernel registry: selection with reasons, typed refusals, never a silent fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedhybrid.engine import Engine, EngineConfig
from pagedhybrid.errors import UnsupportedConfiguration
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
    assert {"in_place_state", "paged_in_place"} <= sel.backend.features
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
    selection read the same capabilities."""
    from pagedhybrid.attention.backends import build_default_registry
    from pagedhybrid.attention.contract import ReductionSpec

    reg = build_default_registry()
    steps = {b.step.name: b for b in reg.backends if b.step is not None}
    assert list(steps) == list(registry.BACKENDS)  # priority order
    for name, entry in steps.items():
        assert entry.step is registry.backend(name)
        assert entry.capability is entry.step.capability
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
