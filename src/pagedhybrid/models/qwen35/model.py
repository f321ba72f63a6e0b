"""Qwen3.5 hybrid decoder in PyTorch: HF checkpoints, dense forward and packed paged forward.

Stack (HF ``Qwen3_5ForCausalLM``; its modules in ``decoder.py``): ``embed_tokens`` -> layers ->
final OffsetRMSNorm -> ``lm_head``. Each decoder layer is pre-norm residual,
``h = x + mixer(input_layernorm(x))``, ``y = h + mlp(post_attention_layernorm(h))``; the mixer
is ``FullAttention`` where ``layer_types[i] == "full_attention"`` and ``GatedDeltaNet``
otherwise. Parameter names are HF's
state-dict keys, so ``state_dict()`` of this module is the checkpoint layout.

Two forwards share every weight and every layer's math:

* ``forward_dense(input_ids[B, S], past)`` -- the ordinary path (parity with HF, in-repo
  reference). ``DenseCache`` holds a contiguous K/V ``[B, L, Hkv, hd]`` per full layer and the
  conv ``[B, conv_dim, K-1]`` / fp32 recurrent ``[B, Hv, Dv, Dk]`` states per linear layer
  (row b = sequence b). Linear layers run through the same step seam as the packed path on
  copies of ``past``'s states (``past`` itself is never modified).
* ``forward_packed(batch, cache, logits_rows, meta)`` -- the serving path over a ``PackedBatch``
  and a ``PagedHybridCache``: the step's ``StepMetadata`` (built and validated once, by the runner's
  ``InputBatch`` or here from the batch) is read by every layer; pages and state slots are updated
  in place. In a decode-only step a bundle with fused decode layers (the native one:
  ``gdn_decode_layer`` / ``attention_decode_layer``) runs each whole layer -- norms, projections,
  mixer, residuals, MLP -- in one native call, bit for bit what the layer's modules compute (a step
  of ~25 python-level ops per layer becomes one); the runner's graph executor runs the whole stack
  -- embedding, layers, final norm, LM head -- in one call instead (``decode_graph``, ``stack.py``);
  any other step, a TP rank, quantized pages or a product form it does not mirror run the modules.

Kernels come from the one kernel registry (``pagedhybrid.kernels.backend.REGISTRY``;
``select(needs=Needs(...))``): ``auto`` gives the native kernels when the prebuilt extension is
present and the model's needs fit (prefix caching, KV page dtype, batch invariance), else the next
bundle that fits, with every rejection's reason. The model is given its bundle when it is built
(``backend``: ``load_engine`` passes the one the engine's needs chose; a model built without one
takes ``auto``'s for its dtype; ``use_backend`` gives it another): every layer its step seam, every
module that uses kernels (``UsesKernels``) the bundle's ``ModuleKernels``; the weights stay as
loaded (a tied LM head is the embedding table itself).

Tensor parallelism is built in: ``build`` / ``load`` take a ``ParallelConfig`` (``tp_rank``,
``tp_world_size``, process group) and every layer is made of the rank's column- / row-parallel
projections (``pagedhybrid.parallel.linear``; the split rules are in ``attention.py``,
``linear_attention.py`` and ``layers.py``); embeddings, norms and ``lm_head`` are replicated.
Loading calls each parameter's ``weight_loader`` on the full checkpoint tensor, which keeps only
the rank's slice (a view of the memory-mapped file where the slice is contiguous), so a rank
never holds the whole model. ``model.config`` is the rank's config (``Qwen35Config.rank_local``:
local head / channel counts, what its ``PagedHybridCache`` is allocated with);
``model.checkpoint_config`` is the full one. Row-parallel projections all-reduce their partial
sums, so activations and logits are replicated on every rank (equal to TP=1 within float
rounding, not bitwise). At world size 1 (the default) the model is the plain model, bit for bit.

Logits are returned as float32 (as the exported graph does).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration
from pagedhybrid.kernels.backend import Backend, select
from pagedhybrid.kernels.registry import UsesKernels
from pagedhybrid.kernels.step import StepMetadata, int_tensor
from pagedhybrid.kvquant import is_quantized
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.decoder import (
    PARAMETER_EPOCH,
    DenseStep,
    MtpHead,
    PackedStep,
    Qwen35TextModel,
)
from pagedhybrid.models.qwen35.layers import SparseMoE
from pagedhybrid.models.qwen35.packed import OP, PackedBatch, PagedHybridCache
from pagedhybrid.models.qwen35.rope import RopeTable, mrope_cos_sin
from pagedhybrid.models.qwen35.stack import bind_stack
from pagedhybrid.models.qwen35.weights import (
    HugePageArena,
    experts_layout,
    fuse_experts,
    per_expert_shapes,
    read_tensors,
    release_pages,
)
from pagedhybrid.parallel.linear import (
    ParallelConfig,
    ReplicatedLinear,
    checkpoint_shape,
    replicated_weight_loader,
    weight_loader,
)
from pagedhybrid.weightquant import WeightFormat, quantized_nbytes

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DENSE_OP = "pagedhybrid.Qwen35.forward_dense"
LOAD_OP = "pagedhybrid.Qwen35.load_weights"


@dataclass(frozen=True)
class DenseCache:
    """State of a dense batch after ``seq_len`` tokens (all rows advance together)."""

    seq_len: int
    keys: dict[int, torch.Tensor]  # full layer -> [B, L, Hkv, hd]
    values: dict[int, torch.Tensor]  # full layer -> [B, L, Hkv, hd]
    conv: dict[int, torch.Tensor]  # linear layer -> [B, conv_dim, K-1]
    recurrent: dict[int, torch.Tensor]  # linear layer -> fp32 [B, Hv, Dv, Dk]


def _table(tables: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """Page tables as int32 ``[B, M]`` (rows padded with -1)."""
    if isinstance(tables, torch.Tensor):
        return tables.to(torch.int32).contiguous()
    width = max([len(t) for t in tables] + [1])
    return int_tensor((p for t in tables for p in [*t, *[-1] * (width - len(t))]),
                      torch.int32).view(len(tables), width)


class Qwen35ForCausalLM(nn.Module):
    """The Qwen3.5 text decoder (one TP rank of it when ``parallel`` says so), with its MTP
    head when ``mtp`` (``self.mtp``; None otherwise). Build on the meta device and
    ``load_weights``, or use ``load()``."""

    def __init__(self, config: Qwen35Config, dtype: torch.dtype = torch.float32,
                 backend: Backend | None = None, parallel: ParallelConfig | None = None,
                 mtp: bool = False) -> None:
        super().__init__()
        if dtype not in SUPPORTED_DTYPES:
            raise UnsupportedConfiguration(
                f"model dtype {dtype} is not served; use one of {list(SUPPORTED_DTYPES)}")
        self.parallel = parallel if parallel is not None else ParallelConfig()
        self.checkpoint_config = config  # the full model: checkpoint tensor shapes
        self.config = config.rank_local(self.parallel)  # this rank's heads: caches, kernels
        self.dtype = dtype
        self.source_dir: Path | None = None  # the checkpoint folder (set by ``load``)
        self.arenas: list[HugePageArena] = []  # where quantize / hold_projections put weights
        self.model = Qwen35TextModel(config, dtype, self.parallel)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: MtpHead | None = None
        self.rope = RopeTable(config)  # text positions' cos, sin
        if mtp:
            if config.mtp_num_hidden_layers != 1:
                raise UnsupportedConfiguration(
                    f"an MTP head needs a checkpoint with mtp_num_hidden_layers=1 and its mtp.* "
                    f"tensors; this one has mtp_num_hidden_layers="
                    f"{config.mtp_num_hidden_layers}")
            self.mtp = MtpHead(config, dtype, self.parallel)
        self.use_backend(backend if backend is not None else
                         select("auto", self.config, self.dtype).backend)

    # -- ops seam ---------------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The kernel bundle every layer computes with (``use_backend``)."""
        return self._backend

    def use_backend(self, backend: Backend) -> None:
        """Compute with ``backend``: its step seam in every layer, its ``ModuleKernels`` in
        every module that uses them (``UsesKernels``: each projection's product for the model's
        dtype, silu / sigmoid, the norms, a mixture of experts' kernel)."""
        if self.weight_format is not None and backend.modules.quantized_linear is None:
            raise UnsupportedConfiguration(
                f"the {backend.name} kernels have no product for {self.weight_format.name} "
                "weights; use a bundle whose capability has quantized_weights")
        self._backend = backend
        for m in self.modules():
            if isinstance(m, UsesKernels):
                m.use_kernels(backend.modules, self.dtype)

    # -- weights ----------------------------------------------------------------------------------
    @property
    def weight_format(self) -> WeightFormat | None:
        """The format the projections are held in (None: the model dtype)."""
        return self.lm_head.quant.fmt if self.lm_head.quant is not None else None

    def quantize(self, fmt: WeightFormat, huge_pages: bool = True) -> None:
        """Hold every projection weight -- the LM head and the MTP head's included; not the
        embedding table, the norms, the convolution, a mixture of experts' router gates and
        routed experts -- in ``fmt`` (``pagedhybrid.weightquant``), round to nearest from the
        loaded weights, releasing them and their mapped file pages (a tied head gets its own
        codes; the embedding keeps the table), the codes in one ``HugePageArena`` (``huge_pages``;
        else in ordinary pages). The fused decode layers multiply them with the integer
        kernel."""
        routers = {id(r) for block in self.modules() if isinstance(block, SparseMoE)
                   for r in (block.gate, block.shared_expert_gate)}
        table = self.model.embed_tokens.weight
        todo = [(name, m) for name, m in self.named_modules()
                if isinstance(m, ReplicatedLinear) and id(m) not in routers]
        size = sum(HugePageArena.room(n) for _, m in todo if m.quant is None
                   for n in quantized_nbytes(tuple(m.weight.shape), fmt))
        arena = HugePageArena(size) if huge_pages and size else None
        if arena is not None:
            self.arenas.append(arena)
        for name, m in todo:
            plain = m.quantize(fmt, f"{name}.weight")
            if plain is not None:
                q = m.quant
                if arena is not None:
                    m.quant = q._replace(codes=arena.hold(q.codes), scales=arena.hold(q.scales),
                                         zeros=None if q.zeros is None else arena.hold(q.zeros))
                if plain is not table:  # (the embedding reads the table)
                    release_pages(plain)
        self.use_backend(self._backend)  # the bundle's quantised product

    def hold_projections(self) -> None:
        """Copy every plain projection weight -- the ``ReplicatedLinear`` ones not held in 8 / 4
        bits, a tied head's table once -- into one ``HugePageArena`` and release its mapped file
        pages (``weights.py``: decode streams them). The parameters stay the same objects; the
        fused decode layers gather them again."""
        params = {id(m.weight): m.weight for m in self.modules()
                  if isinstance(m, ReplicatedLinear) and not m.weight.is_meta}
        if not params:
            return
        arena = HugePageArena(sum(HugePageArena.room(p.numel() * p.element_size())
                                  for p in params.values()))
        self.arenas.append(arena)
        for p in params.values():
            plain = p.data
            p.data = arena.hold(plain.contiguous())
            release_pages(plain)
        PARAMETER_EPOCH[0] += 1  # (what was gathered from the old tensors is stale)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> full (unsharded) shape (``lm_head.weight`` absent when
        tied)."""
        shapes = {k: checkpoint_shape(v) for k, v in self.state_dict(keep_vars=True).items()}
        if self.config.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        return shapes

    def load_weights(self, state: Mapping[str, torch.Tensor]
                     | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors (HF name -> tensor, a mapping or a stream of pairs):
        each parameter's ``weight_loader`` keeps this rank's slice in the parameter's dtype (the
        tensor itself, no copy, at TP=1 when the dtype matches), adopted as the parameter.
        ``lm_head`` is re-tied when tied (a tied checkpoint's ``lm_head.weight`` is ignored)."""
        tied = self.config.tie_word_embeddings
        expected = self.expected_shapes()
        params = self.state_dict(keep_vars=True)
        loaded: set[str] = set()
        for name, full in state.items() if isinstance(state, Mapping) else state:
            if name not in expected:
                if tied and name == "lm_head.weight":
                    continue
                raise ContractViolation(LOAD_OP, name, "is not a parameter of this model",
                                        tuple(full.shape))
            if tuple(full.shape) != expected[name]:
                raise ContractViolation(LOAD_OP, name, f"must have shape {list(expected[name])}",
                                        list(full.shape))
            old = params[name]
            loader = weight_loader(old)
            new = nn.Parameter(loader(old, full), requires_grad=False)
            if loader is not replicated_weight_loader:
                new.weight_loader = loader  # type: ignore[attr-defined]
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, new)
            loaded.add(name)
        missing = [n for n in expected if n not in loaded]
        if missing:
            raise ContractViolation(LOAD_OP, missing[0],
                                    f"is missing ({len(missing)} missing in all)")
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- dense path -------------------------------------------------------------------------------
    def empty_dense_cache(self, batch: int, device: torch.device | str = "cpu") -> DenseCache:
        cfg = self.config
        hkv, hd = cfg.num_key_value_heads, cfg.head_dim
        return DenseCache(
            seq_len=0,
            keys={i: torch.zeros(batch, 0, hkv, hd, dtype=self.dtype, device=device)
                  for i in cfg.full_attention_layers},
            values={i: torch.zeros(batch, 0, hkv, hd, dtype=self.dtype, device=device)
                    for i in cfg.full_attention_layers},
            conv={i: torch.zeros(PagedHybridCache.conv_state_shape(cfg, batch), dtype=self.dtype,
                                 device=device) for i in cfg.linear_attention_layers},
            recurrent={i: torch.zeros(PagedHybridCache.recurrent_state_shape(cfg, batch),
                                      dtype=torch.float32, device=device)
                       for i in cfg.linear_attention_layers},
        )

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor, past: DenseCache | None = None
                      ) -> tuple[torch.Tensor, DenseCache]:
        """``input_ids`` int64 ``[B, S]`` -> (float32 logits ``[B, S, V]``, new ``DenseCache``)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
                or input_ids.dtype != torch.int64 or input_ids.shape[1] == 0:
            raise ContractViolation(DENSE_OP, "input_ids", "must be int64 [B, S] with S >= 1",
                                    getattr(input_ids, "shape", type(input_ids).__name__))
        self._check_ids(DENSE_OP, input_ids)
        b, s = input_ids.shape
        device = input_ids.device
        if past is None:
            past = self.empty_dense_cache(b, device)
        first = next(iter({**past.keys, **past.conv}.values()), None)
        if first is not None and first.shape[0] != b:
            raise ContractViolation(DENSE_OP, "past", f"was built for batch {first.shape[0]}", b)
        positions = torch.arange(past.seq_len, past.seq_len + s, device=device)  # [S]
        position_ids = positions.repeat(b).view(1, -1).expand(3, -1)  # [3, B*S]
        cos, sin = mrope_cos_sin(self.config, position_ids)  # [B*S, rd] x2
        h = self.model.embed_tokens(input_ids).reshape(b * s, -1)  # [B*S, hidden]
        keys: dict[int, torch.Tensor] = {}
        values: dict[int, torch.Tensor] = {}
        step = DenseStep(cos, sin, StepMetadata.dense(b, s, past.seq_len), b, past.keys,
                         past.values, keys, values,
                         {i: t.clone() for i, t in past.conv.items()},  # advanced in place
                         {i: t.clone() for i, t in past.recurrent.items()}, self.backend)
        for layer in self.model.layers:
            h = layer(h, step)
        logits = self.lm_head(self.model.norm(h)).float().view(b, s, -1)  # [B, S, V]
        return logits, DenseCache(past.seq_len + s, keys, values, step.conv, step.recurrent)

    # -- packed paged path ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_packed(self, batch: PackedBatch, cache: PagedHybridCache,
                       logits_rows: torch.Tensor | None = None,
                       meta: StepMetadata | None = None, hidden: list[torch.Tensor] | None = None,
                       fused: Sequence[bool] = ()) -> torch.Tensor:
        """One packed step; returns float32 logits ``[N, V]`` (or ``[len(logits_rows), V]``);
        ``hidden``, when given, receives the final-norm hidden of every row ``[N, hidden]``
        (what the MTP head reads).

        KV pages of the full layers and the state slots ``batch.state_slots`` of the linear
        layers are updated in place. ``logits_rows`` (int ``[R]``) selects token rows before the
        LM head, e.g. ``batch.last_token_rows()`` for pruned prefill. ``meta`` is the step's
        validated metadata (the runner builds it with the batch, over a cache it checked once
        with ``check_cache``); without it the cache and the batch are validated and the
        metadata is built here, once. ``fused`` (the runner's layers executor, for a step it
        checked the bundle takes): per layer, whether it runs as one fused call.
        """
        given = meta is not None
        if meta is None:
            self.check_cache(cache)
            meta = batch.metadata(self.config, cache)
            n = batch.num_tokens
            if logits_rows is not None:
                ok = (isinstance(logits_rows, torch.Tensor) and logits_rows.dim() == 1
                      and logits_rows.dtype in (torch.int32, torch.int64))
                if ok and logits_rows.numel():
                    ok = int(logits_rows.min()) >= 0 and int(logits_rows.max()) < n
                if not ok:
                    raise ContractViolation(OP, "logits_rows",
                                            f"must be int rows in [0, {n}) [R]",
                                            getattr(logits_rows, "shape", logits_rows))
        backend = self.backend
        # the runner's meta ends each sequence past its positions; a caller's batch is measured
        reach = max(meta.total_lens) if given else None
        cos, sin = self.rope.step(batch.position_ids, reach)  # [N, rd] x2
        h = self.model.embed_tokens(batch.input_ids)  # [N, hidden]
        step = PackedStep(cos, sin, meta, cache, backend)
        for n, layer in enumerate(self.model.layers):
            if fused and fused[n]:  # the whole layer in one native call
                h = layer.fused_forward(h, cos, sin, cache, meta, backend)
            else:  # its program, one module call an op
                h = layer(h, step)
        if hidden is not None:
            hidden.append(self.model.norm(h))
        if logits_rows is not None:
            h = h.index_select(0, logits_rows.long())  # [R, hidden]
        return self.lm_head(self.model.norm(h)).float()  # [N or R, V]

    @torch.no_grad()
    def forward_mtp(self, token_ids: torch.Tensor, hidden: torch.Tensor, meta: StepMetadata,
                    cache: PagedHybridCache, logits_rows: torch.Tensor | None = None,
                    greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP head over a packed step (``MtpHead``): row ``r`` at position
        ``meta.positions[r]`` reads ``hidden[r]`` (the final-norm hidden there) and
        ``token_ids[r]`` (the token after it); its K/V go to the head's pool of ``cache`` on
        the step's pages. Returns (float32 logits ``[R, V]`` of ``logits_rows`` (None: all),
        the head's hidden ``[N, hidden]``); with ``greedy``, each of those rows' first maximum
        (int64 ``[R]``, -1 for a row with a NaN or an infinity: a drafter's pick) in place of
        its logits."""
        head = self._head()
        backend = self.backend
        cos, sin = self.rope.rows(meta.positions, max(meta.total_lens))
        single = self.parallel.tp_world_size == 1
        h = None if not single or backend.mtp is None else backend.mtp.head_input(
            token_ids, hidden, head.input_weights(self.model.embed_tokens.weight), meta,
            head.fc.matmul)
        if h is None:
            x = torch.cat([head.pre_fc_norm_embedding(self.model.embed_tokens(token_ids)),
                           head.pre_fc_norm_hidden(hidden)], dim=-1)
            h = head.fc(x)  # [N, hidden]
        layer = head.layer
        out = layer.head_forward(h, cos, sin, cache, meta, backend, fuse=single)
        lm = self.lm_head
        fused = None if not greedy or backend.mtp is None else \
            backend.mtp.head_output(out, head.norm.weight, head.norm.eps, logits_rows, lm.weight,
                                    lm.quant, lm.matmul)
        if fused is not None:
            return fused[1], fused[0]
        out = head.norm(out)
        rows = out if logits_rows is None else out.index_select(0, logits_rows.long())
        logits = lm(rows).float()
        if not greedy:
            return logits, out
        ids = logits.argmax(dim=-1)
        return ids.masked_fill(~logits.isfinite().all(dim=-1), -1), out

    @torch.no_grad()
    def mtp_chain(self, token_ids: torch.Tensor, hidden: torch.Tensor,
                  positions: Sequence[int], steps: Sequence[int],
                  tables: Sequence[Sequence[int]], cache: PagedHybridCache
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP drafter's chain: row ``b`` feeds draft ``token_ids[b]`` and the head's hidden
        ``hidden[b]`` back at ``positions[b]`` and runs ``steps[b]`` greedy one-token head steps
        (``forward_mtp``), step ``j`` at ``positions[b] + j`` on the pages of ``tables[b]``;
        a non-finite row ends its chain. Returns (drafts int64 ``[B, max(steps)]``, -1 past
        each chain's end; the head's hidden after each chain ``[B, hidden]``). The native
        bundle runs it in one call (``mtp_chain``), here step by step otherwise."""
        self._head()
        ids = token_ids.tolist()
        steps = [n if t >= 0 else 0 for t, n in zip(ids, steps, strict=True)]
        b, most = len(steps), max(steps, default=0)
        kernels = self.backend.mtp
        fused = kernels.chain if kernels is not None and self.parallel.tp_world_size == 1 \
            else None
        if fused is not None and most:
            out = fused(token_ids, hidden, int_tensor(positions, torch.int64),
                        int_tensor(steps, torch.int64), _table(tables), cache.block_size,
                        self.rope.upto(max(map(sum, zip(positions, steps, strict=True)))),
                        *self._head_kernel_args(cache))
            if out is not None:
                return out
        drafts = torch.full((b, most), -1, dtype=torch.int64)
        state, going = hidden.clone(), [n > 0 for n in steps]
        for j in range(most):
            live = [r for r in range(b) if going[r] and steps[r] > j]
            if not live:
                break
            meta = StepMetadata.build([1] * len(live), [positions[r] + j for r in live],
                                      [tables[r] for r in live], range(len(live)),
                                      block_size=cache.block_size, num_pages=cache.num_pages,
                                      num_slots=max(len(live), cache.num_slots))
            rows = int_tensor(live, torch.int64)
            picked, nxt = self.forward_mtp(int_tensor([ids[r] for r in live], torch.int64),
                                           state.index_select(0, rows), meta, cache, greedy=True)
            state.index_copy_(0, rows, nxt)
            for r, t in zip(live, picked.tolist(), strict=True):
                going[r] = t >= 0
                if going[r]:
                    drafts[r, j] = ids[r] = t
        return drafts, state

    @torch.no_grad()
    def mtp_draft(self, token_ids: torch.Tensor, hidden: torch.Tensor, q_lens: Sequence[int],
                  past_lens: Sequence[int], tables: Sequence[Sequence[int]] | torch.Tensor,
                  picks: Sequence[int], positions: Sequence[int], steps: Sequence[int],
                  chain_tables: Sequence[Sequence[int]], cache: PagedHybridCache
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MTP drafter's whole step in one native call (the bundle's ``mtp_draft``): the
        catch-up -- row ``r`` of sequence ``s`` (``q_lens[s]`` rows from position
        ``past_lens[s]`` on the pages of ``tables[s]``) reads ``hidden[r]`` and ``token_ids[r]``
        -- whose greedy picks at rows ``picks`` are the first drafts, then ``mtp_chain`` from
        each (``positions``, ``steps``, ``chain_tables`` per pick). Returns (drafts int64
        ``[D, 1 + max(steps)]``, -1 past each one's end; the head's hidden after each chain),
        or None where the bundle has no such call or would not fuse the step (the caller then
        runs ``forward_mtp`` and ``mtp_chain``)."""
        kernels = self.backend.mtp
        fused = kernels.draft if kernels is not None and self.parallel.tp_world_size == 1 \
            else None
        if fused is None or self.mtp is None:
            return None
        reach = max([p + q for p, q in zip(past_lens, q_lens, strict=True)]
                    + [p + n for p, n in zip(positions, steps, strict=True)])
        return fused(token_ids, hidden, int_tensor(q_lens, torch.int64),
                     int_tensor(past_lens, torch.int64), _table(tables),
                     int_tensor(picks, torch.int64), int_tensor(positions, torch.int64),
                     int_tensor(steps, torch.int64), _table(chain_tables), cache.block_size,
                     self.rope.upto(reach), *self._head_kernel_args(cache))

    def decode_graph(self, cache: PagedHybridCache) -> tuple[Any | None, str]:
        """The whole decode step of this model over ``cache`` bound as one native call
        (``stack.bind_stack``: a ``DecodeStack``), or None and why not -- for the runner's
        graph executor, which calls it with ``rope_upto(reach)``'s tables."""
        if self.parallel.tp_world_size != 1:
            return None, "tensor parallelism"
        return bind_stack(self.backend, self.model, self.lm_head, cache)

    def _head(self) -> MtpHead:
        """The MTP head, or ``UnsupportedConfiguration`` naming how to load it."""
        if self.mtp is None:
            raise UnsupportedConfiguration("this model was loaded without its MTP head "
                                           "(load(..., mtp=True))")
        return self.mtp

    def _head_kernel_args(self, cache: PagedHybridCache) -> tuple[object, ...]:
        """The MTP head's tensors as ``mtp_chain`` / ``mtp_draft`` take them after the rope."""
        head = self._head()
        layer, i = head.layer, head.layer.index
        return (head.input_weights(self.model.embed_tokens.weight), layer.decode_weights(),
                cache.key_cache[i], cache.value_cache[i], head.norm.weight, self.lm_head.weight,
                self.lm_head.quant, head.fc.matmul)

    # -- checks -----------------------------------------------------------------------------------
    def _check_ids(self, op: str, ids: torch.Tensor) -> None:
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ContractViolation(op, "input_ids",
                                        f"must be token ids in [0, {self.config.vocab_size})",
                                        (lo, hi))

    def check_cache(self, cache: PagedHybridCache) -> None:
        """Every pool the layers will touch exists with its shape and dtype (``ContractViolation``
        naming the pool otherwise)."""
        cfg = self.config

        def need(pools: dict[int, torch.Tensor], layers: tuple[int, ...], name: str,
                 shape: tuple[int, ...], dtype: torch.dtype) -> None:
            for i in layers:
                t = pools.get(i)
                if t is None:
                    raise ContractViolation(OP, f"cache.{name}[{i}]", "is missing")
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ContractViolation(OP, f"cache.{name}[{i}]",
                                            f"must be {dtype} {list(shape)}",
                                            (t.dtype, list(t.shape)))

        page = PagedHybridCache.page_shape(cfg, cache.num_pages, cache.block_size)
        kvd = cache.kv_dtype if cfg.full_attention_layers else self.dtype
        if is_quantized(kvd):
            missing = [i for i in cfg.full_attention_layers if i not in cache.kv_scales]
            if missing:
                raise ContractViolation(OP, f"cache.kv_scales[{missing[0]}]",
                                        f"is required for {kvd} pages", "missing")
        elif kvd != self.dtype:
            raise ContractViolation(OP, "cache.key_cache", f"must be {self.dtype} or a "
                                    "quantized type (int8, float8_e4m3fn)", kvd)
        need(cache.key_cache, cfg.full_attention_layers, "key_cache", page, kvd)
        need(cache.value_cache, cfg.full_attention_layers, "value_cache", page, kvd)
        need(cache.conv_state, cfg.linear_attention_layers, "conv_state",
             PagedHybridCache.conv_state_shape(cfg, cache.num_slots), self.dtype)
        need(cache.recurrent_state, cfg.linear_attention_layers, "recurrent_state",
             PagedHybridCache.recurrent_state_shape(cfg, cache.num_slots), torch.float32)


def build(config: Qwen35Config, dtype: torch.dtype = torch.float32,
          device: torch.device | str = "meta", backend: Backend | None = None,
          parallel: ParallelConfig | None = None, mtp: bool = False) -> Qwen35ForCausalLM:
    """An unloaded model (of TP rank ``parallel``, with its MTP head when ``mtp``); on the meta
    device no memory is allocated."""
    with torch.device(device):
        return Qwen35ForCausalLM(config, dtype, backend, parallel, mtp)


def load(model_dir: str | Path, dtype: torch.dtype = torch.float32,
         backend: Backend | None = None, parallel: ParallelConfig | None = None,
         mtp: bool = False) -> Qwen35ForCausalLM:
    """Load an HF Qwen3.5 checkpoint folder (config.json + safetensors), memory-mapped; with
    ``parallel`` the TP rank's slices only (each tensor is read, sliced and cast one at a
    time); with ``mtp`` the MTP head's ``mtp.*`` tensors too (skipped otherwise, as HF
    transformers does)."""
    config = Qwen35Config.from_model_dir(model_dir)
    model = build(config, dtype, "meta", backend, parallel, mtp)
    expected = model.expected_shapes()
    per_expert = config.is_moe and experts_layout(model_dir, mtp) == "per_expert"
    stream = read_tensors(model_dir, per_expert_shapes(expected) if per_expert else expected,
                          optional=frozenset({"lm_head.weight"}), mtp=mtp)
    model.load_weights(fuse_experts(stream, config.num_experts) if per_expert else stream)
    model.source_dir = Path(model_dir)  # where calibrated KV scales are looked for
    return model.eval()
