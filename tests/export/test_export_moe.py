"""Export of Qwen3.5-MoE hybrids (``qwen3_5_moe_text``): one ``com.microsoft.MoE`` per layer.

* the op itself in onnxruntime 1.32's CPU EP: the attributes ``export/moe.py`` chooses reproduce
  the model's routing and SwiGLU experts (softmax of logits, top-k, renormalised, gate rows
  interleaved with up rows); gate/up swapped or not renormalised is far off; the concatenated
  layout (``swiglu_fusion=2``) is refused by the CPU kernel with the message the module quotes;
* the feed-forward graph of every layer, float32 and float16, in the CPU EP against the torch
  model's ``SparseMoE`` (float32); both checkpoint layouts (fused, per expert) export the same
  initializers, in the op's interleaved layout;
* the packed float16 package (PagedAttention on WebGPU/lavapipe, the rest -- MoE included -- on
  the CPU EP) against the float32 torch packed model over a paged schedule: logits of every row
  with all 8 experts active; with top-2 the rows up to each sequence's first token whose routing
  is within float16 noise (``RouterGaps``: such a token may take another expert, as right as
  torch's choice, and its change reaches the later tokens of its sequence);
* the real onnxruntime-genai 0.18.0 Engine on WebGPU/lavapipe runs the MoE package (all experts
  active, so no routing is within noise): each request's greedy tokens are the torch model's
  (teacher-forced: the chosen token's logit is the top one up to float16 noise) and overlapped
  requests equal the same requests run alone up to the first float16 near-tie;
* ``pagedhybrid verify`` checks the MoE nodes and rejects mutated ones; typed rejections;
* structural exports (no weights) of Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B and a
  Qwen3.8-2.4T-A95B-like config: node counts from the config, seconds each.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from export_helpers import BLOCK_SIZE, NUM_BLOCKS, TINY_OPTIONS, tame_weights, tiny_config
from genai_runner import register_webgpu, run_schedule
from safetensors.torch import save_file

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.abi import TensorSpec
from pagedhybrid.export.builder import GraphBuilder
from pagedhybrid.export.cli import main as cli_main
from pagedhybrid.export.moe import emit_moe, single_moe_model
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.export.package import export_package
from pagedhybrid.export.session import PackedGraphSession, batch_inputs
from pagedhybrid.export.verify import verify_package
from pagedhybrid.export.weights import CheckpointWeights
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.errors import CheckpointError
from pagedhybrid.models.qwen35.model import load
from pagedhybrid.models.qwen35.packed import PackedBatch, PagedHybridCache
from pagedhybrid.models.qwen35.synthetic import (
    MOE_GEOMETRIES,
    tiny_moe_config,
    write_checkpoint,
)

LOGITS_TOL = 2.5e-2  # float16 graph vs float32 torch, as the dense numerics test
NUM_SLOTS = 4
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def tiny_moe(**overrides: Any) -> Qwen35Config:
    """The export tests' tiny shape (``Dk 16 != Dv 8``, untied) with ``tiny_moe_config``'s
    experts: 8 routed experts of 32 channels, top-2, a shared expert of 48, in every layer."""
    moe = tiny_moe_config()
    return tiny_config(**{**{k: getattr(moe, k) for k in MOE_FIELDS}, **overrides})


class RouterGaps:
    """Each token's smallest router-logit gap at the top-k boundary (the k-th minus the
    (k+1)-th largest logit) over the layers of the forwards run inside ``with``: a token whose
    gap is within float16 noise may be routed to another expert by a float16 graph, which is
    as right as float32 torch's choice (the two routings differ by more than the logits
    tolerance, so such rows are compared only for being finite)."""

    def __init__(self, model: Any) -> None:
        self.model, self.gaps, self._hooks = model, torch.empty(0), []  # type: ignore[var-annotated]

    def _record(self, mod: Any, args: tuple[torch.Tensor, ...], _out: Any) -> None:
        logits = mod.gate(args[0].reshape(-1, args[0].shape[-1]))  # [N, E]
        if mod.top_k == logits.shape[-1]:  # every expert active: no routing decision
            gap = torch.full(logits.shape[:1], math.inf)
        else:
            top = logits.topk(mod.top_k + 1, dim=-1).values  # [N, k+1]
            gap = top[:, -2] - top[:, -1]
        self.gaps = gap if self.gaps.numel() == 0 else torch.minimum(self.gaps, gap)

    def __enter__(self) -> RouterGaps:
        self.gaps = torch.empty(0)
        self._hooks = [layer.mlp.register_forward_hook(self._record)
                       for layer in self.model.model.layers]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()


AMBIGUOUS = 0.02  # router-logit gap: ~10x the float16 noise of the logits (~2e-3, measured)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-moe")
    config = tiny_moe()
    write_checkpoint(path, config, tame_weights(config, seed=11))
    return path


@pytest.fixture(scope="module")
def moe_packages(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Path, Path]]:
    """``make(top_k)`` -> (checkpoint, webgpu float16 package) of the tiny MoE with ``top_k`` of
    its 8 experts per token, written once per ``top_k``."""
    made: dict[int, tuple[Path, Path]] = {}

    def make(top_k: int) -> tuple[Path, Path]:
        if top_k not in made:
            root = tmp_path_factory.mktemp(f"tiny-moe-top{top_k}")
            config = tiny_moe(num_experts_per_tok=top_k)
            write_checkpoint(root / "ckpt", config, tame_weights(config, seed=11))
            export_package(root / "ckpt", root / "pkg", TINY_OPTIONS)
            made[top_k] = (root / "ckpt", root / "pkg")
        return made[top_k]

    return make


# -- the op ---------------------------------------------------------------------------------------
def _moe_node_run(x: np.ndarray, logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
                  k: int, **changes: int) -> np.ndarray:
    """``single_moe_model`` (the export's node) in the CPU EP, attributes overridden by
    ``changes``."""
    model = single_moe_model(gate_up, down, k)
    for name, value in changes.items():
        attr = next(a for a in model.graph.node[0].attribute if a.name == name)
        attr.i = value
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x, "router_probs": logits})[0]


def _naive_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, k: int) -> torch.Tensor:
    """The model's routed-expert math, one token and one expert at a time."""
    probs = torch.softmax(x @ router.T, dim=-1, dtype=torch.float32)
    top, index = torch.topk(probs, k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            g, u = (gate_up[int(index[t, j])] @ x[t]).chunk(2)
            out[t] += top[t, j] * (down[int(index[t, j])] @ (torch.nn.functional.silu(g) * u))
    return out


def test_moe_attributes_reproduce_the_model_math() -> None:
    e, k, h, inter = 8, 2, 16, 12
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, h, generator=gen)
    router = torch.randn(e, h, generator=gen) / 4
    gate_up = torch.randn(e, 2 * inter, h, generator=gen) / 4  # [E, 2I, H]: gate, then up rows
    down = torch.randn(e, h, inter, generator=gen) / 3  # [E, H, I]
    want = _naive_moe(x, router, gate_up, down, k).numpy()
    logits = (x @ router.T).numpy()
    got = _moe_node_run(x.numpy(), logits, gate_up.numpy(), down.numpy(), k)
    assert np.abs(got - want).max() <= 1e-5
    swapped = torch.cat([gate_up[:, inter:], gate_up[:, :inter]], dim=1)  # up rows first
    off = _moe_node_run(x.numpy(), logits, swapped.numpy(), down.numpy(), k)
    assert np.abs(off - want).max() > 0.1
    plain = _moe_node_run(x.numpy(), logits, gate_up.numpy(), down.numpy(), k,
                          normalize_routing_weights=0)
    assert np.abs(plain - want).max() > 0.1
    with pytest.raises(Exception, match="only supports interleaved SwiGLU format"):
        _moe_node_run(x.numpy(), logits, gate_up.numpy(), down.numpy(), k, swiglu_fusion=2)
    half = _moe_node_run(x.numpy().astype(np.float16), logits.astype(np.float16),
                         gate_up.numpy().astype(np.float16), down.numpy().astype(np.float16), k)
    assert half.dtype == np.float16 and 1e-5 < np.abs(half - want).max() <= 1e-2


# -- the feed-forward graph, float32 and float16 --------------------------------------------------
def _feed_forward_graph(ckpt: Path, config: Qwen35Config, io_dtype: str, path: Path) -> None:
    """Every layer's MoE block on one input ``x [N, H]`` -> outputs ``y{i}``."""
    b = GraphBuilder(CheckpointWeights(ckpt, config, io_dtype), io_dtype)
    x = b.add_input(TensorSpec("x", io_dtype, (c.DIM_TOKENS, config.hidden_size)))
    outputs = []
    for i in range(config.num_hidden_layers):
        y = emit_moe(b, config, i, x)
        y.name, y.type = f"y{i}", ir.TensorType(dtypes.ir_dtype(io_dtype))
        y.shape = ir.Shape([c.DIM_TOKENS, config.hidden_size])
        outputs.append(y)
    ir.save(b.model(outputs, {}), path, external_data=path.name + ".data")


@pytest.mark.parametrize(("io_dtype", "tol"), [("float", 2e-6), ("float16", 1.5e-2)])
def test_feed_forward_in_cpu_ep_matches_torch(io_dtype: str, tol: float, moe_checkpoint: Path,
                                              tmp_path: Path) -> None:
    model = load(moe_checkpoint, torch.float32)
    cfg = model.config
    path = tmp_path / "ffn.onnx"
    _feed_forward_graph(moe_checkpoint, cfg, io_dtype, path)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    np_dtype = np.float32 if io_dtype == "float" else np.float16
    outs = sess.run(None, {"x": x.numpy().astype(np_dtype)})
    events = json.loads(Path(sess.end_profiling()).read_text())
    ran = {e["args"]["provider"] for e in events if e.get("args", {}).get("op_name") == c.MOE}
    assert ran == {"CPUExecutionProvider"}
    errors, skipped = [], 0
    with torch.no_grad():
        for i, got in enumerate(outs):
            mlp = model.model.layers[i].mlp
            with RouterGaps(model) as gaps:
                want = mlp(x).numpy()  # [N, H] float32
            rows = (gaps.gaps >= AMBIGUOUS).numpy() if io_dtype != "float" else slice(None)
            skipped += int(x.shape[0] - np.count_nonzero(rows)) if io_dtype != "float" else 0
            errors.append(float(np.abs(got.astype(np.float32) - want)[rows].max()
                                / max(1.0, float(np.abs(want).max()))))
            assert np.isfinite(got).all()
    print(f"{io_dtype}: max relative error per layer {[f'{e:.1e}' for e in errors]}; "
          f"{skipped} of {x.shape[0] * len(outs)} token-layers routed within float16 noise")
    assert max(errors) <= tol
    assert skipped <= 0.1 * x.shape[0] * len(outs)
    if io_dtype == "float16":
        assert max(errors) > 1e-5  # the float16 rounding is really there


def _per_expert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused experts tensors split one tensor per expert, as transformers publishes them."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def test_both_expert_layouts_export_the_interleaved_weights(moe_checkpoint: Path,
                                                            tmp_path: Path) -> None:
    from safetensors.torch import load_file

    fused = load_file(str(moe_checkpoint / "model.safetensors"))
    per_expert = tmp_path / "per-expert"
    per_expert.mkdir()
    shutil.copy(moe_checkpoint / "config.json", per_expert / "config.json")
    save_file(_per_expert(fused), str(per_expert / "model.safetensors"))
    opts = ExportOptions(ep="cuda", dtype="fp16", block_size=16, num_blocks=8)
    inits = {}
    for tag, ckpt in (("fused", moe_checkpoint), ("per_expert", per_expert)):
        export_package(ckpt, tmp_path / tag, opts)
        assert verify_package(tmp_path / tag).ok
        graph = ir.load(tmp_path / tag / c.MODEL_FILE).graph
        inits[tag] = {n: v.const_value.numpy() for n, v in graph.initializers.items()
                      if v.const_value is not None}
    assert inits["fused"].keys() == inits["per_expert"].keys()
    for name, arr in inits["fused"].items():
        np.testing.assert_array_equal(arr, inits["per_expert"][name], err_msg=name)
    w = "model.layers.3.mlp"
    fc1 = inits["fused"][f"{w}.experts.gate_up_proj.interleave"]  # [E, 2I, H]
    gate_up = fused[f"{w}.experts.gate_up_proj"].half().numpy()
    inter = gate_up.shape[1] // 2
    np.testing.assert_array_equal(fc1[:, 0::2], gate_up[:, :inter])  # gate rows even
    np.testing.assert_array_equal(fc1[:, 1::2], gate_up[:, inter:])  # up rows odd
    np.testing.assert_array_equal(inits["fused"][f"{w}.experts.down_proj"],
                                  fused[f"{w}.experts.down_proj"].half().numpy())
    router = inits["fused"][f"{w}.gate_and_shared_expert.weight.transpose"]  # [H, E + 1 + 2Is]
    want = torch.cat([fused[f"{w}.{n}.weight"] for n in (
        "gate", "shared_expert_gate", "shared_expert.gate_proj", "shared_expert.up_proj")])
    np.testing.assert_array_equal(router, want.t().half().numpy())


# -- the packed package ---------------------------------------------------------------------------
def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("top_k", [8, 2])
def test_packed_moe_package_matches_torch(top_k: int, moe_packages: Callable[..., Any]) -> None:
    """Unequal prefills crossing page boundaries, a reordered step mixing decode and
    continuation, a new sequence on a reused slot: every logits row within float16 tolerance.

    With every expert active (``top_k`` 8 of 8) no routing decision exists, so every row is
    compared. With top-2 a token whose router gap is within float16 noise (``RouterGaps``) may
    take another expert in the graph, and that token's change reaches the later tokens of its
    sequence (conv, recurrent state, pages): a sequence's rows are compared up to its first such
    token, the rest only for being finite."""
    ckpt, pkg = moe_packages(top_k)
    model = load(ckpt, torch.float32)
    cfg = model.config
    cache = PagedHybridCache.allocate(cfg, num_pages=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                      num_slots=NUM_SLOTS)
    graph = PackedGraphSession(pkg, NUM_BLOCKS)
    conv = {i: np.zeros(cache.conv_state[i].shape, np.float16)
            for i in cfg.linear_attention_layers}
    rec = {i: np.zeros(cache.recurrent_state[i].shape, np.float32)
           for i in cfg.linear_attention_layers}
    seqs = {"a": (_tokens(1, 40), [3, 7, 9], 0), "b": (_tokens(2, 30), [1, 12], 1),
            "c": (_tokens(3, 40), [10, 2, 6], 2), "d": (_tokens(4, 24), [12, 1], 1)}
    done = dict.fromkeys(seqs, 0)
    tainted: set[str] = set()
    errors: list[float] = []
    rows = checked = 0
    for step in ([("a", 20), ("b", 5), ("c", 31)], [("c", 1), ("a", 12), ("b", 14)],
                 [("a", 1), ("d", 18), ("c", 3)], [("d", 2), ("a", 1), ("c", 1)]):
        names = [s for s, _ in step]
        batch = PackedBatch.from_sequences(
            [seqs[s][0][done[s]:done[s] + n] for s, n in step], [done[s] for s in names],
            [seqs[s][1] for s in names], [seqs[s][2] for s in names])
        with RouterGaps(model) as gaps:
            ref = model.forward_packed(batch, cache)  # [N, V] float32
        slots = [seqs[s][2] for s in names]
        conv_b = {i: np.ascontiguousarray(a[slots]) for i, a in conv.items()}
        rec_b = {i: np.ascontiguousarray(a[slots]) for i, a in rec.items()}
        for b, s in enumerate(names):
            if done[s] == 0:  # a new sequence starts from zero state
                for pool in (*conv_b.values(), *rec_b.values()):
                    pool[b] = 0
        out = graph.step(**batch_inputs(batch), conv=conv_b, recurrent=rec_b)
        for i in conv:
            conv[i][slots], rec[i][slots] = conv_b[i], rec_b[i]
        assert np.isfinite(out.logits).all()
        diff = np.abs(out.logits - ref.numpy()).max(-1)  # [N]
        clear = gaps.gaps >= AMBIGUOUS if top_k < cfg.num_experts else \
            torch.ones(len(diff), dtype=torch.bool)
        cu = batch.cu_seqlens.tolist()
        for b, (s, n) in enumerate(step):
            first = n if s not in tainted else 0  # rows before the first ambiguous token
            if not bool(clear[cu[b]:cu[b + 1]].all()):
                first = min(first, int((~clear[cu[b]:cu[b + 1]]).nonzero()[0, 0]))
                tainted.add(s)
            if first:
                errors.append(float(diff[cu[b]:cu[b] + first].max()))
            rows, checked = rows + n, checked + first
            done[s] += n
    print(f"top-{top_k}: max logits error {max(errors):.2e} over {checked} of {rows} rows "
          f"(the rest follow a routing within float16 noise)")
    assert max(errors) <= LOGITS_TOL
    assert min(errors) > 0.0  # two independent implementations
    assert checked == rows if top_k == cfg.num_experts else checked >= 0.15 * rows


# -- the genai Engine -----------------------------------------------------------------------------
PROMPTS = ([5, 17, 42, 99, 3, 7, 8, 9], list(range(60, 90)), [1, 2, 3, 4])
MAX_NEW = 14


def _torch_rows(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 logits predicting each of ``tokens`` after ``prompt`` (teacher forcing)."""
    with torch.no_grad():
        logits = model.forward_dense(torch.tensor([prompt + tokens]))[0][0]  # [S, V]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def test_genai_engine_runs_the_moe_package(moe_packages: Callable[..., Any]) -> None:
    """Every expert active (no routing decision within float16 noise, see
    ``test_packed_moe_package_matches_torch``), so each token is checked against torch."""
    import onnxruntime_genai as og

    ckpt, pkg = moe_packages(8)
    assert verify_package(pkg).ok
    register_webgpu()
    engine = og.Engine(og.Model(og.Config(str(pkg))))
    prompts = [list(p) for p in PROMPTS]
    overlapped, steps = run_schedule(engine, prompts, MAX_NEW, (0, 0, 3))
    alone = [run_schedule(engine, [p], MAX_NEW)[0][0] for p in prompts]
    print(f"engine steps {steps}; overlapped {overlapped}; alone {alone}")
    assert steps < MAX_NEW * len(prompts)  # the requests really shared steps
    model = load(ckpt, torch.float32)
    exact = 0
    for prompt, over, solo in zip(prompts, overlapped, alone, strict=True):
        assert len(over) == len(solo) == MAX_NEW
        for tokens in (over, solo):
            rows = _torch_rows(model, prompt, tokens)  # [MAX_NEW, V]
            deficit = rows.max(-1).values - rows[torch.arange(MAX_NEW), torch.tensor(tokens)]
            assert float(deficit.max()) <= LOGITS_TOL, (prompt, tokens, deficit.tolist())
            exact += int((deficit == 0).sum())
        split = next((j for j, (a, b) in enumerate(zip(over, solo, strict=True)) if a != b), None)
        if split is not None:  # only a float16 near-tie may separate them
            top2 = _torch_rows(model, prompt, solo[:split + 1])[split].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * LOGITS_TOL, (prompt, split)
    assert exact >= 0.9 * 2 * MAX_NEW * len(prompts)
    assert len({tuple(t) for t in overlapped}) == len(prompts)  # not a degenerate model


# -- verify ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_structure(moe_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe-structure")
    export_package(moe_checkpoint, out, dataclasses.replace(TINY_OPTIONS, weights=False))
    return out


def _moe_node(m: ir.Model, layer: int) -> ir.Node:
    return next(n for n in m.graph if n.op_type == c.MOE and n.name ==
                f"/model/layers.{layer}/mlp/experts/{c.MOE}")


def _set_attr(layer: int, name: str, value: Any) -> Callable[[ir.Model], None]:
    def edit(m: ir.Model) -> None:
        _moe_node(m, layer).attributes[name] = ir.Attr(
            name, ir.AttributeType.INT if isinstance(value, int) else ir.AttributeType.FLOAT,
            value)
    return edit


def _swap_weights(m: ir.Model) -> None:
    node = _moe_node(m, 4)
    fc1, fc2 = node.inputs[2], node.inputs[4]
    node.replace_input_with(2, fc2)
    node.replace_input_with(4, fc1)


def _drop_node(m: ir.Model) -> None:
    node = _moe_node(m, 1)
    node.outputs[0].replace_all_uses_with(node.inputs[0])
    m.graph.remove(node, safe=True)


def _metadata(key: str, value: str | None) -> Callable[[ir.Model], None]:
    def edit(m: ir.Model) -> None:
        if value is None:
            del m.metadata_props[key]
        else:
            m.metadata_props[key] = value
    return edit


def _unshared(m: ir.Model) -> None:  # the routed output alone, the shared expert dropped
    node = _moe_node(m, 2)
    add = next(u.node for u in node.outputs[0].uses() if u.node.op_type == "Add")
    add.outputs[0].replace_all_uses_with(node.outputs[0])
    m.graph.remove(add, safe=True)


@pytest.mark.parametrize(("mutate", "check"), [
    (_set_attr(0, "k", 3), "MoE attributes"),
    (_set_attr(5, "swiglu_fusion", 2), "MoE attributes"),
    (_set_attr(2, "activation_beta", 1.0), "MoE attributes"),
    (_set_attr(3, "swiglu_limit", 7.0), "MoE attributes"),
    (_swap_weights, "MoE expert weights"),
    (_drop_node, "MoE count"),
    (_unshared, "MoE shared expert"),
    (_metadata(c.META_MOE_EXPERTS, None), "moe metadata"),
    (_metadata(c.META_MOE_INTERMEDIATE, "64"), "MoE expert weights"),
    (_metadata(c.META_MOE_EXPERTS, "16"), "MoE router"),
], ids=["k", "fusion", "beta", "limit", "fc1-fc2", "missing-node", "no-shared-expert",
        "no-metadata", "intermediate", "experts"])
def test_verify_rejects_broken_moe(mutate: Callable[[ir.Model], None], check: str,
                                   moe_structure: Path, tmp_path: Path) -> None:
    pristine = verify_package(moe_structure)
    assert pristine.ok, pristine.format()
    assert sum(f.check == "MoE attributes" for f in pristine.findings) == 6
    pkg = tmp_path / "pkg"
    shutil.copytree(moe_structure, pkg)
    model = ir.load(pkg / c.MODEL_FILE)
    mutate(model)
    ir.save(model, pkg / c.MODEL_FILE)
    report = verify_package(pkg)
    assert not report.ok
    assert check in {f.check for f in report.failures}, report.format()
    assert cli_main(["verify", str(pkg)]) != 0


def test_verify_rejects_moe_nodes_in_a_dense_package(tiny_package: Path, moe_structure: Path,
                                                     tmp_path: Path) -> None:
    """A dense package has no MoE metadata; an MoE node there (or MoE metadata) fails."""
    assert not any("MoE" in f.check or "moe" in f.check
                   for f in verify_package(tiny_package).findings)
    pkg = tmp_path / "pkg"
    shutil.copytree(moe_structure, pkg)
    model = ir.load(pkg / c.MODEL_FILE)
    for key in (c.META_MOE_EXPERTS, c.META_MOE_TOP_K, c.META_MOE_INTERMEDIATE,
                c.META_MOE_SHARED):
        del model.metadata_props[key]
    ir.save(model, pkg / c.MODEL_FILE)
    assert "moe metadata" in {f.check for f in verify_package(pkg).failures}


# -- rejections -----------------------------------------------------------------------------------
def _config_dir(path: Path, config: Qwen35Config, **fields: Any) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**config.to_hf_dict(), **fields}))
    return path


@pytest.mark.parametrize(("fields", "options", "error", "reason"), [
    ({"norm_topk_prob": False}, {}, UnsupportedConfiguration, r"'norm_topk_prob'=False"),
    ({"mlp_only_layers": [1]}, {}, UnsupportedConfiguration, r"'mlp_only_layers'=\[1\]"),
    ({"decoder_sparse_step": 2}, {}, UnsupportedConfiguration, r"'decoder_sparse_step'=2"),
    ({"num_experts_per_tok": 9}, {}, CheckpointError, r"num_experts_per_tok.*<= num_experts=8"),
    ({}, {"dtype": "bf16"}, UnsupportedConfiguration, r"bf16 with --ep webgpu"),
    ({}, {"dtype": "fp32"}, UnsupportedConfiguration, r"--dtype fp32"),
    ({"head_dim": 12, "partial_rotary_factor": 0.5,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1],
                          "mrope_interleaved": True}}, {},
     UnsupportedConfiguration, r"head_dim=12.*% 8"),
    ({"layer_types": ["linear_attention"] * 6}, {}, UnsupportedConfiguration,
     r"no full_attention layer"),
], ids=["norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "top_k", "bf16-webgpu",
        "fp32", "head_dim", "no-full-layer"])
def test_moe_rejections_are_typed(fields: dict[str, Any], options: dict[str, Any],
                                  error: type[Exception], reason: str, tmp_path: Path) -> None:
    src = _config_dir(tmp_path / "model", tiny_moe(), **fields)
    out = tmp_path / "out"
    opts = dataclasses.replace(TINY_OPTIONS, weights=False, **options)
    with pytest.raises(error, match=reason):
        export_package(src, out, opts)
    assert not out.exists()


# -- structural exports of published geometries ---------------------------------------------------
PARAMS_B = {"35B-A3B": (34, 36, 3, 4), "122B-A10B": (119, 125, 9, 11),
            "397B-A17B": (390, 400, 16, 18), "2.4T-A95B": (2350, 2450, 90, 100)}


@pytest.mark.parametrize("name", list(MOE_GEOMETRIES))
def test_structural_export_of_moe_geometries(name: str, tmp_path: Path) -> None:
    """Built from ``config.json`` alone: the geometry's parameter counts are its name's, the
    graph has one PagedAttention per full layer, one conv + GatedDeltaNet per linear layer and
    one MoE per layer with ``k`` and ``[E, 2I, H]`` / ``[E, H, I]`` experts of the config."""
    from pagedhybrid.export.weights import expected_shapes

    cfg = MOE_GEOMETRIES[name]
    src = _config_dir(tmp_path / "model", cfg)
    shapes = expected_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values()) / 1e9
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n) / 1e9
    active = total - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    lo, hi, alo, ahi = PARAMS_B[name]
    assert lo <= total <= hi and alo <= active <= ahi, (total, active)
    tracemalloc.start()
    start = time.perf_counter()
    result = export_package(src, tmp_path / "pkg", ExportOptions(ep="cuda", dtype="bf16",
                                                                 weights=False))
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    n = cfg.num_hidden_layers
    full = [i for i in range(n) if (i + 1) % 4 == 0]  # HF's rule, not the exporter's
    linear = [i for i in range(n) if (i + 1) % 4]
    counts = result.op_counts
    print(f"{name}: {total:.0f}B params ({active:.1f}B active); structural export "
          f"{seconds:.2f} s (traced), Python peak {peak / 2**20:.0f} MiB; PagedAttention "
          f"x{counts['PagedAttention']}, GatedDeltaNet x{counts['GatedDeltaNet']}, "
          f"MoE x{counts['MoE']} of {cfg.num_experts} experts (top-{cfg.num_experts_per_tok})")
    assert counts["PagedAttention"] == len(full)
    assert counts["GatedDeltaNet"] == counts["VarlenCausalConvWithState"] == len(linear)
    assert counts["MoE"] == n
    model = ir.load(tmp_path / "pkg" / c.MODEL_FILE)
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for node in (nd for nd in model.graph if nd.op_type == c.MOE):
        assert node.attributes["k"].value == cfg.num_experts_per_tok
        assert list(node.inputs[2].shape) == [e, 2 * inter, h]
        assert list(node.inputs[4].shape) == [e, h, inter]
        assert node.inputs[2].dtype == ir.DataType.BFLOAT16
    genai = json.loads((tmp_path / "pkg" / c.GENAI_CONFIG_FILE).read_text())
    assert genai["model"]["decoder"]["state_groups"] == [
        {"kind": "paged_kv", "layer_ids": full},
        {"kind": "fixed_conv", "layer_ids": linear},
        {"kind": "fixed_recurrent", "layer_ids": linear}]
    assert not (tmp_path / "pkg" / c.WEIGHTS_FILE).exists()
    report = verify_package(tmp_path / "pkg")
    assert report.ok, report.format()
    assert sum(f.check == "MoE expert weights" for f in report.findings) == n


def test_mtp_head_of_an_moe_model_is_an_moe_layer(tmp_path: Path) -> None:
    src = _config_dir(tmp_path / "model", tiny_moe(mtp_num_hidden_layers=1))
    out = tmp_path / "pkg"
    export_package(src, out, dataclasses.replace(TINY_OPTIONS, weights=False, mtp=True,
                                                 state_update_capacity=4))
    head = ir.load(out / c.MTP_FILE)
    moe = [n for n in head.graph if n.op_type == c.MOE]
    assert len(moe) == 1 and moe[0].inputs[2].name == \
        "mtp.layers.0.mlp.experts.gate_up_proj.interleave"
    report = verify_package(out)
    assert report.ok, report.format()
