"""Packed paged forward of the Qwen3.5 model against independent HF runs of every sequence.

A continuous-batching schedule: unequal prompts around the block size, a multi-token
continuation, single-token decode steps, requests reordered and removed between steps, a new
request admitted into freed (not cleared) pages and a freed state slot. Pages and slots come from
shuffled free lists and the pools start filled with garbage. Each sequence's logits, its K/V read
back from the pages, and its conv / recurrent states must match its own HF run.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from qwen35_tiny import HFSequence

from pagedhybrid.engine.worker.executors import EagerExecutor, GraphExecutor, LayersExecutor
from pagedhybrid.errors import ContractViolation
from pagedhybrid.kernels.backend import backend
from pagedhybrid.kernels.native import dense
from pagedhybrid.kernels.registry import StepKernels
from pagedhybrid.kernels.step import StepMetadata
from pagedhybrid.models.qwen35 import PackedBatch, PagedHybridCache, load
from pagedhybrid.weightquant import WeightFormat

TOL = 1e-4
BLOCK = 16
NUM_PAGES = 20
NUM_SLOTS = 6


@dataclass
class Request:
    oracle: HFSequence
    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


class Scheduler:
    """Just enough page/slot bookkeeping to drive the model like an engine would."""

    def __init__(self, model, hf, seed: int) -> None:
        self.model, self.hf = model, hf
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = PagedHybridCache.allocate(model.config, num_pages=NUM_PAGES,
                                               block_size=BLOCK, num_slots=NUM_SLOTS,
                                               fill=None, generator=self.gen)
        self.initial = self.cache.clone()
        self.free_pages = list(range(NUM_PAGES))
        self.rng.shuffle(self.free_pages)
        self.free_slots = [4, 1, 5, 0, 3, 2]
        self.requests: dict[str, Request] = {}
        self.ever_pages: set[int] = set()
        self.ever_slots: set[int] = set()
        self.max_err = 0.0

    def admit(self, name: str) -> Request:
        req = Request(HFSequence(self.hf), self.free_slots.pop())
        self.ever_slots.add(req.slot)
        self.requests[name] = req
        return req

    def remove(self, name: str) -> Request:
        req = self.requests.pop(name)
        self.free_pages.extend(req.pages)  # reused next, without clearing
        self.free_slots.append(req.slot)
        return req

    def step(self, work: list[tuple[str, int]]) -> None:
        vocab = self.model.config.vocab_size
        chunks, reqs = [], []
        for name, n in work:
            req = self.requests.get(name) or self.admit(name)
            while len(req.pages) * BLOCK < req.length + n:
                req.pages.append(self.free_pages.pop())
                self.ever_pages.add(req.pages[-1])
            chunks.append(torch.randint(0, vocab, (n,), generator=self.gen).tolist())
            reqs.append(req)
        batch = PackedBatch.from_sequences(chunks, [r.length for r in reqs],
                                           [r.pages for r in reqs], [r.slot for r in reqs])
        logits = self.model.forward_packed(batch, self.cache)  # [N, V]
        cu = batch.cu_seqlens.tolist()
        for b, (req, chunk) in enumerate(zip(reqs, chunks, strict=True)):
            ref = req.oracle.step(chunk)
            req.length += len(chunk)
            self.check(logits[cu[b]:cu[b + 1]], ref)
        self.check_states()

    def check(self, ours: torch.Tensor, ref: torch.Tensor) -> None:
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        self.max_err = max(self.max_err, err)
        assert err <= TOL, err

    def check_states(self) -> None:
        cfg = self.model.config
        for req in self.requests.values():
            for i in cfg.full_attention_layers:
                k, v = self.cache.gather_kv(i, req.pages, req.length)
                self.check(k, req.oracle.keys(i))
                self.check(v, req.oracle.values(i))
            for i in cfg.linear_attention_layers:
                self.check(self.cache.conv_state[i][req.slot], req.oracle.conv_state(i))
                self.check(self.cache.recurrent_state[i][req.slot],
                           req.oracle.recurrent_state(i))


def test_continuous_batching_schedule_matches_hf(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    s = Scheduler(model, tiny_checkpoint.hf, seed=11)
    s.step([("A", 15), ("B", 16), ("C", 17), ("D", 33)])  # prefill around the block size
    s.step([("C", 3), ("A", 2), ("D", 4), ("B", 1)])  # multi-token continuation, reordered
    b = s.remove("B")
    s.step([("D", 1), ("E", 5), ("A", 1), ("C", 1)])  # E admitted mid-way
    e = s.requests["E"]
    assert e.slot == b.slot and e.pages[0] == b.pages[-1]  # reused slot and page, not cleared
    s.step([("E", 1), ("C", 1), ("A", 1), ("D", 1)])
    s.remove("C")
    s.step([("A", 1), ("E", 12), ("D", 1)])  # E's continuation crosses a page boundary
    s.step([("D", 1), ("A", 1), ("E", 1)])
    # pages and slots never handed out still hold their original garbage
    for i, pool in s.cache.key_cache.items():
        for p in set(range(NUM_PAGES)) - s.ever_pages:
            assert torch.equal(pool[p], s.initial.key_cache[i][p])
    for i, pool in s.cache.recurrent_state.items():
        for slot in set(range(NUM_SLOTS)) - s.ever_slots:
            assert torch.equal(pool[slot], s.initial.recurrent_state[i][slot])
    assert s.max_err <= TOL


def _two_step_batches(model) -> tuple[PagedHybridCache, PackedBatch, PackedBatch]:
    gen = torch.Generator().manual_seed(5)
    cache = PagedHybridCache.allocate(model.config, num_pages=8, block_size=BLOCK, num_slots=4,
                                      fill=None, generator=gen)
    toks = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 18, 3)]
    pages = [[5], [2, 7], [0]]
    first = PackedBatch.from_sequences(toks, [0, 0, 0], pages, [3, 0, 1])
    model.forward_packed(first, cache)
    second = PackedBatch.from_sequences([[1, 2], [3], [4, 5, 6]], [7, 18, 3], pages, [3, 0, 1])
    return cache, first, second


def test_pruned_logits_equal_selected_rows(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    cache, _, batch = _two_step_batches(model)
    full_cache, pruned_cache = cache.clone(), cache.clone()
    full = model.forward_packed(batch, full_cache)
    last = batch.last_token_rows()
    assert last.tolist() == [1, 2, 5]
    pruned = model.forward_packed(batch, pruned_cache, logits_rows=last)
    assert pruned.shape == (3, 96)
    assert (pruned - full[last]).abs().max() <= 1e-5
    rows = torch.tensor([4, 0, 4], dtype=torch.int32)
    assert (model.forward_packed(batch, cache.clone(), rows) - full[rows.long()]).abs().max() \
        <= 1e-5
    for i in full_cache.recurrent_state:  # pruning does not change what is cached
        assert torch.equal(full_cache.recurrent_state[i], pruned_cache.recurrent_state[i])
    for i in full_cache.key_cache:
        assert torch.equal(full_cache.key_cache[i], pruned_cache.key_cache[i])


def _bad(batch: PackedBatch, **changes) -> PackedBatch:
    return batch._replace(**changes)


@pytest.mark.parametrize("change,match", [
    (lambda b: _bad(b, state_slots=torch.tensor([3, 3, 1], dtype=torch.int32)), "state_slots"),
    (lambda b: _bad(b, state_slots=torch.tensor([3, 0, 4], dtype=torch.int32)), "state_slots"),
    (lambda b: _bad(b, cu_seqlens=b.cu_seqlens.long()), "cu_seqlens"),
    (lambda b: _bad(b, position_ids=b.position_ids[:1]), "position_ids"),
    (lambda b: _bad(b, input_ids=b.input_ids.clone().fill_(96)), "input_ids"),
    (lambda b: _bad(b, past_seqlens=b.past_seqlens[:2]), "past_seqlens"),
])
def test_bad_packed_inputs_are_typed(tiny_checkpoint, change, match):
    model = load(tiny_checkpoint.path)
    cache, _, batch = _two_step_batches(model)
    with pytest.raises(ContractViolation, match=match):
        model.forward_packed(change(batch), cache)


def test_bad_cache_and_rows_are_typed(tiny_checkpoint):
    model = load(tiny_checkpoint.path)
    cache, _, batch = _two_step_batches(model)
    with pytest.raises(ContractViolation, match="logits_rows"):
        model.forward_packed(batch, cache, torch.tensor([6]))
    broken = PagedHybridCache(cache.key_cache, cache.value_cache, cache.conv_state,
                              {i: t.double() for i, t in cache.recurrent_state.items()},
                              cache.block_size, cache.num_pages, cache.num_slots)
    with pytest.raises(ContractViolation, match="recurrent_state"):
        model.forward_packed(batch, broken)


def test_distinct_mrope_planes_match_hf(tiny_checkpoint):
    """Vision-style positions (T, H, W planes differ): the interleaved MRoPE sections matter."""
    model = load(tiny_checkpoint.path)
    gen = torch.Generator().manual_seed(9)
    lengths = (6, 9)
    toks = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]
    planes = [torch.randint(0, 40, (3, n), generator=gen) for n in lengths]  # [3, S] each
    cache = PagedHybridCache.allocate(model.config, num_pages=4, block_size=BLOCK, num_slots=2)
    batch = PackedBatch.from_sequences(toks, [0, 0], [[1], [3]], [1, 0])
    batch = batch._replace(position_ids=torch.cat(planes, dim=1))
    ours = model.forward_packed(batch, cache)
    cu = batch.cu_seqlens.tolist()
    for b, (ids, pos) in enumerate(zip(toks, planes, strict=True)):
        with torch.no_grad():
            ref = tiny_checkpoint.hf(input_ids=torch.tensor([ids]), position_ids=pos[:, None, :],
                                     use_cache=False).logits[0]
        err = (ours[cu[b]:cu[b + 1]] - ref).abs().max().item()
        assert err <= TOL, err
    text = batch._replace(position_ids=planes_as_text(batch.position_ids))
    assert (model.forward_packed(text, cache.clone()) - ours).abs().max() > 1e-3  # planes count


def planes_as_text(position_ids: torch.Tensor) -> torch.Tensor:
    return position_ids[:1].expand(3, -1).contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 0.04), (torch.bfloat16, 0.25)])
def test_half_precision_packed_tracks_fp32_hf(tiny_checkpoint, dtype, tol):
    """fp16/bf16 pages and conv states, fp32 recurrent states (HF itself deviates similarly)."""
    model = load(tiny_checkpoint.path, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    cache = PagedHybridCache.allocate(model.config, num_pages=6, block_size=BLOCK, num_slots=3,
                                      dtype=dtype, fill=None, generator=gen)
    assert cache.recurrent_state[0].dtype == torch.float32
    oracles = [HFSequence(tiny_checkpoint.hf) for _ in range(3)]
    pages, slots, past = [[4, 1], [0, 5], [2]], [2, 0, 1], [0, 0, 0]
    worst = 0.0
    for lengths in ((17, 9, 3), (1, 1, 1), (2, 1, 1)):
        toks = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]
        batch = PackedBatch.from_sequences(toks, past, pages, slots)
        logits = model.forward_packed(batch, cache)
        cu = batch.cu_seqlens.tolist()
        for b, oracle in enumerate(oracles):
            ref = oracle.step(toks[b])
            worst = max(worst, (logits[cu[b]:cu[b + 1]] - ref).abs().max().item())
        past = [p + n for p, n in zip(past, lengths, strict=True)]
    assert worst <= tol, worst


def test_ops_are_called_through_the_backend_seam(tiny_checkpoint):
    calls: dict[str, int] = {}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    ref = backend("reference")
    seam = dataclasses.replace(ref, name="counting", step=StepKernels(
        counting("attention", ref.step.attention), counting("causal_conv", ref.step.causal_conv),
        counting("gated_delta", ref.step.gated_delta)))
    model = load(tiny_checkpoint.path, backend=seam)
    cfg = model.config
    model.forward_dense(torch.zeros(2, 3, dtype=torch.int64))
    n_lin, n_full = len(cfg.linear_attention_layers), len(cfg.full_attention_layers)
    assert calls == {"causal_conv": n_lin, "gated_delta": n_lin}
    calls.clear()
    cache = PagedHybridCache.allocate(cfg, num_pages=2, block_size=BLOCK, num_slots=1)
    model.forward_packed(PackedBatch.from_sequences([[1, 2]], [0], [[1]], [0]), cache)
    assert calls == {"causal_conv": n_lin, "gated_delta": n_lin, "attention": n_full}


def test_large_pools_are_zero_and_cost_nothing_until_used() -> None:
    """A cache of 2 GiB is allocated without writing it: resident memory grows only by the
    pages a sequence touches, and every pool reads as zeros."""

    from pagedhybrid.models.qwen35.synthetic import tiny_byte_config

    def anon() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    cfg = tiny_byte_config()
    per_page = 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4 * len(cfg.full_attention_layers)
    pages = (2 << 30) // per_page
    before = anon()
    cache = PagedHybridCache.allocate(cfg, num_pages=pages, block_size=16, num_slots=4)
    grown = anon() - before
    assert grown < 64 << 20, grown  # not the 2 GiB
    layer = cfg.full_attention_layers[0]
    k = cache.key_cache[layer]
    assert k.dtype == torch.float32 and k.shape[0] == pages
    k[-1].fill_(1.0)  # a write lands, and touches one page's worth
    assert float(k[-1].sum()) == k[-1].numel() and float(k[:-1][::997].abs().sum()) == 0.0
    assert anon() - before < 128 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 3, 9])
@pytest.mark.parametrize("product", ["preferred", "native", "int4", "int8:32:asym"])
def test_fused_decode_layers_equal_the_modules_bit_for_bit(tiny_checkpoint, dtype, batch,
                                                          product):
    """A decode step through the native bundle's fused decoder layers (Gated DeltaNet and full
    attention, and the fused mixer) gives the logits, pages and state pools of the same step run
    module by module, to the bit, at batch sizes on both sides of the product's native / torch
    GEMM switch, with the products this CPU form prefers (bf16 pairs by vdpbf16ps where it has
    AVX512-BF16), with the native kernel throughout (what a CPU without BF16 dot instructions
    runs bf16 with), and with int4 / int8 weights (``--quantization``: the integer kernel in
    both); the fused path is taken (not silently skipped) for every layer."""
    native = backend("native")
    if product == "native":
        native = dataclasses.replace(native, modules=native.modules._replace(
            linear_for=lambda dtype: dense.linear))
    unfused = dataclasses.replace(native, fused=None)
    fused_calls: list[str] = []
    counted = dataclasses.replace(native, fused=native.fused._replace(
        gdn_layer=counting(native.fused.gdn_layer, "gdn_layer", fused_calls),
        attention_layer=counting(native.fused.attention_layer, "attention_layer", fused_calls)))

    model = load(tiny_checkpoint.path, dtype=dtype, backend=native)
    if product.startswith("int"):
        model.quantize(WeightFormat.parse(product))
    cfg = model.config
    gen = torch.Generator().manual_seed(batch)
    cache = PagedHybridCache.allocate(cfg, num_pages=4 * batch, block_size=BLOCK,
                                      num_slots=batch, dtype=dtype, fill=None, generator=gen)
    pages = [[4 * b, 4 * b + 1, 4 * b + 2] for b in range(batch)]
    prompts = [torch.randint(0, cfg.vocab_size, (5 + b,), generator=gen).tolist()
               for b in range(batch)]
    lengths = [len(p) for p in prompts]
    model.forward_packed(PackedBatch.from_sequences(prompts, [0] * batch, pages,
                                                    list(range(batch))), cache)
    for _ in range(3):
        step = PackedBatch.from_sequences(
            [[int(t)] for t in torch.randint(0, cfg.vocab_size, (batch,), generator=gen)],
            lengths, pages, list(range(batch)))
        results = []
        for bundle in (counted, unfused):
            model.use_backend(bundle)
            c = cache.clone()
            results.append((layers_run(model, step, c) if bundle is counted
                            else model.forward_packed(step, c), c))
        (got, got_cache), (want, want_cache) = results
        assert torch.equal(got, want)
        for pools in ("key_cache", "value_cache", "conv_state", "recurrent_state"):
            for i, t in getattr(want_cache, pools).items():
                assert torch.equal(getattr(got_cache, pools)[i], t), (pools, i)
        cache = want_cache
        lengths = [n + 1 for n in lengths]
    kinds = ["attention_layer" if i in cfg.full_attention_layers else "gdn_layer"
             for i in range(cfg.num_hidden_layers)]
    assert fused_calls == kinds * 3


def counting(fn, name, calls):  # type: ignore[no-untyped-def]
    """``fn``, recording ``name`` in ``calls`` each time it runs."""
    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(name)
        return fn(*args, **kwargs)
    return run


def layers_run(model, step, cache, meta=None):  # type: ignore[no-untyped-def]
    """``step`` through the runner's layers executor (each fused layer one native call), which
    must take it."""
    meta = meta if meta is not None else step.metadata(model.config, cache)
    execute, why = LayersExecutor.bind(model, cache)
    assert execute is not None, why
    assert execute.why_not(meta, step.num_tokens) is None
    return execute(step, cache, None, meta, None)


def _fused_setup(tiny_checkpoint, dtype):  # type: ignore[no-untyped-def]
    """The native bundle, the same without its fused layers, the model on it, a generator."""
    native = backend("native")
    unfused = dataclasses.replace(native, fused=None)
    model = load(tiny_checkpoint.path, dtype=dtype, backend=native)
    return native, unfused, model, torch.Generator().manual_seed(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_layers_verify_drafts_as_the_modules_do(tiny_checkpoint, dtype):
    """A speculative step -- two sequences decoding, two verifying 3 and 5 draft tokens --
    through the fused decoder layers gives the logits, pages, state pools (the verify rows
    untouched) and capsules of the same step run module by module, to the bit; the fused path
    is taken for every layer."""
    native, unfused, model, gen = _fused_setup(tiny_checkpoint, dtype)
    cfg = model.config
    cache = PagedHybridCache.allocate(cfg, num_pages=16, block_size=BLOCK, num_slots=4,
                                      dtype=dtype, fill=None, generator=gen, capsule_capacity=6)
    pages = [[4 * b, 4 * b + 1, 4 * b + 2] for b in range(4)]
    prompts = [torch.randint(0, cfg.vocab_size, (5 + b,), generator=gen).tolist()
               for b in range(4)]
    lengths = [len(p) for p in prompts]
    model.forward_packed(PackedBatch.from_sequences(prompts, [0] * 4, pages, [3, 1, 0, 2]),
                         cache)
    new = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 4, 1, 6)]
    step = PackedBatch.from_sequences(new, lengths, pages, [3, 1, 0, 2])
    meta = StepMetadata.build([len(t) for t in new], lengths, pages, [3, 1, 0, 2],
                              block_size=BLOCK, num_pages=16, num_slots=4, verify=(1, 3))
    calls: list[str] = []
    counted = dataclasses.replace(native, fused=native.fused._replace(
        gdn_layer=counting(native.fused.gdn_layer, "gdn_layer", calls),
        attention_layer=counting(native.fused.attention_layer, "attention_layer", calls)))

    results = []
    for bundle in (counted, unfused):
        model.use_backend(bundle)
        c = cache.clone()
        results.append((layers_run(model, step, c, meta) if bundle is counted
                        else model.forward_packed(step, c, None, meta), c))
    (got, got_cache), (want, want_cache) = results
    assert len(calls) == cfg.num_hidden_layers
    assert torch.equal(got, want)
    for pools in ("key_cache", "value_cache", "conv_state", "recurrent_state"):
        for i, t in getattr(want_cache, pools).items():
            assert torch.equal(getattr(got_cache, pools)[i], t), (pools, i)
            if pools in ("conv_state", "recurrent_state"):  # verify rows 1 and 2: untouched
                assert torch.equal(t[[1, 2]], getattr(cache, pools)[i][[1, 2]])
    for i, caps in want_cache.capsules.items():
        for name, t in caps._asdict().items():
            assert torch.equal(getattr(got_cache.capsules[i], name)[[1, 2]], t[[1, 2]]), name


def test_fused_decode_layers_follow_a_replaced_parameter(tiny_checkpoint):
    """The fused layers gather each layer's weights once; a parameter object replaced after
    that (as ``load_weights`` does) is what the next step reads, not the old one."""
    native = backend("native")
    unfused = dataclasses.replace(native, fused=None)
    model = load(tiny_checkpoint.path, backend=native)
    cfg = model.config
    cache = PagedHybridCache.allocate(cfg, num_pages=2, block_size=BLOCK, num_slots=1)
    model.forward_packed(PackedBatch.from_sequences([[1, 2, 3]], [0], [[0]], [0]), cache)
    step = PackedBatch.from_sequences([[4]], [3], [[0]], [0])
    before = layers_run(model, step, cache.clone())
    for i in (cfg.linear_attention_layers[0], cfg.full_attention_layers[0]):
        mlp = model.model.layers[i].mlp
        mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight * 2, requires_grad=False)
    got = layers_run(model, step, cache.clone())
    model.use_backend(unfused)
    want = model.forward_packed(step, cache.clone())
    assert torch.equal(got, want) and not torch.equal(got, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_decode_layers_write_the_same_state_checkpoints(tiny_checkpoint, dtype):
    """A decode step that also emits state checkpoints (prefix caching at a chunk end) writes
    the same checkpoint rows through the fused layers as module by module."""
    native, unfused, model, gen = _fused_setup(tiny_checkpoint, dtype)
    cfg = model.config
    cache = PagedHybridCache.allocate(cfg, num_pages=8, block_size=BLOCK, num_slots=3,
                                      dtype=dtype, fill=None, generator=gen, num_checkpoints=4)
    pages = [[0, 1], [2, 3], [4, 5]]
    model.forward_packed(PackedBatch.from_sequences([[1, 2, 3], [4, 5], [6]], [0, 0, 0], pages,
                                                    [2, 0, 1]), cache)
    meta = StepMetadata.build([1, 1, 1], [3, 2, 1], pages, [2, 0, 1], block_size=BLOCK,
                              num_pages=8, num_slots=3, checkpoints=[(0, 1, 3), (2, 1, 1)],
                              num_checkpoints=4)
    step = PackedBatch.from_metadata(meta, [7, 8, 9])
    runs = []
    for bundle in (native, unfused):
        model.use_backend(bundle)
        c = cache.clone()
        runs.append((layers_run(model, step, c, meta) if bundle is native
                     else model.forward_packed(step, c, None, meta), c))
    (got, got_cache), (want, want_cache) = runs
    assert torch.equal(got, want)
    for pools in ("checkpoint_conv", "checkpoint_recurrent"):
        for i, t in getattr(want_cache, pools).items():
            assert torch.equal(getattr(got_cache, pools)[i], t), (pools, i)
            assert not torch.equal(t[3], getattr(cache, pools)[i][3])  # row 3 was written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("product", ["preferred", "int4", "int8:32:asym"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_the_graph_executor_equals_the_layers_bit_for_bit(tiny_checkpoint, dtype, product,
                                                               batch):
    """A decode step run by the runner's graph executor -- the whole model in one native call
    (``DecodeStack``) -- gives the logits, the pruned rows, the final hidden, the pages, the
    state pools and the chunk-end checkpoints of the same step run by the layers executor (each
    layer one fused call) and by the modules, to the bit; the graph takes the step (not
    silently skipped), and a prefill step is refused by the graph with its reason."""
    native = backend("native")
    unfused = dataclasses.replace(native, fused=None)
    model = load(tiny_checkpoint.path, dtype=dtype, backend=native)
    if product != "preferred":
        model.quantize(WeightFormat.parse(product))
    cfg = model.config
    gen = torch.Generator().manual_seed(batch + 40)
    cache = PagedHybridCache.allocate(cfg, num_pages=3 * batch, block_size=BLOCK,
                                      num_slots=batch, dtype=dtype, fill=None, generator=gen,
                                      num_checkpoints=2)
    pages = [[3 * b, 3 * b + 1, 3 * b + 2] for b in range(batch)]
    slots = list(range(batch))[::-1]
    lengths = [BLOCK - 1 + b % 2 for b in range(batch)]  # the first sequence ends a block
    model.forward_packed(PackedBatch.from_sequences(
        [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths],
        [0] * batch, pages, slots), cache)
    meta = StepMetadata.build([1] * batch, lengths, pages, slots, block_size=BLOCK,
                              num_pages=3 * batch, num_slots=batch,
                              checkpoints=[(0, 1, 1)], num_checkpoints=2)
    step = PackedBatch.from_metadata(meta, torch.randint(0, cfg.vocab_size, (batch,),
                                                         generator=gen).tolist())
    rows = torch.tensor([batch - 1, 0])
    runs = []
    for kind in (GraphExecutor, LayersExecutor, EagerExecutor):
        model.use_backend(unfused if kind is EagerExecutor else native)
        c = cache.clone()
        execute = EagerExecutor(model) if kind is EagerExecutor else kind.bind(model, c)[0]
        assert execute is not None and execute.why_not(meta, 2) is None  # taken, not skipped
        hidden: list[torch.Tensor] = []
        logits = execute(step, c, rows, meta, hidden)
        runs.append((logits, hidden[0], c))
    got = runs[0]
    for want in runs[1:]:
        assert got[0].dtype == torch.float32 and got[0].shape == (2, cfg.vocab_size)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for pools in ("key_cache", "value_cache", "conv_state", "recurrent_state",
                      "checkpoint_conv", "checkpoint_recurrent"):
            for i, t in getattr(want[2], pools).items():
                assert torch.equal(getattr(got[2], pools)[i], t), (pools, i)
    for i, t in got[2].checkpoint_recurrent.items():  # the checkpoint was written
        assert not torch.equal(t[1], cache.checkpoint_recurrent[i][1]), i
    model.use_backend(native)  # a prefill step is not the graph's: the runner runs it eagerly
    graph, _ = GraphExecutor.bind(model, cache.clone())
    assert graph is not None
    prefill = StepMetadata.build([2] * batch, lengths, pages, slots, block_size=BLOCK,
                                 num_pages=3 * batch, num_slots=batch)
    assert graph.why_not(prefill, batch) == "not a decode-only step"
