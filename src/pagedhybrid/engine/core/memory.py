"""Memory planning: the cache budget from the model and the machine, and how it splits into KV
pages, state slots and state checkpoints (``plan_memory``).

Budget:

* ``num_blocks`` given: that many pages; slots and checkpoints as configured (no budget).
* ``cache_memory_bytes`` given: that many bytes.
* otherwise ``cache_memory_fraction`` (default ``DEFAULT_CACHE_FRACTION``) of the memory there is
  for the cache: the machine's available memory (``MemAvailable`` of ``/proc/meminfo``, or the
  cgroup's limit less its use when that is lower) less the weights (counted as still to be paged
  in: they are memory-mapped, so the kernel counts their pages as reclaimable -- all but the
  private copies made before the plan, already out of the available memory: int8 / int4 codes
  and the projections the runner holds in huge pages) and less the workspace of the largest
  step (``workspace_bytes``; with speculative decoding it includes every state slot's
  verify-step capsules, ``capsule_bytes``).

Split: state slots = ``num_state_slots`` or ``max_num_seqs``; state checkpoints =
``num_state_checkpoints`` or one per slot (prefix caching on); pages = the rest, at most what
``max_num_seqs`` sequences of ``max_model_len`` tokens use. The budget must hold the states and
the pages of one sequence of ``max_model_len`` tokens (``MIN_CONTEXT`` tokens when
``max_model_len`` is not given under the default budget, one page under ``cache_memory_bytes``:
``max_model_len`` then becomes what the pages hold, up to the model's limit).
When it does not, what was not set explicitly shrinks, each time with a warning: checkpoints
first (to none), then slots (to one). When that is not enough, or an explicit setting does not
fit, ``CapacityError`` names the option to change and by how much.

``MemoryPlan.summary()`` is the one start-up line: weights, budget and where it came from,
pages / slots / checkpoints and their bytes, the workspace, and how many sequences run at once at
full context and at ``TYPICAL_CONTEXT`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedhybrid.dtypes import logical_name
from pagedhybrid.engine.core.config import EngineConfig, PoolSizes, page_bytes, slot_bytes
from pagedhybrid.errors import CapacityError
from pagedhybrid.kernels.capsule import capsule_bytes
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.models.qwen35.weights import is_mapped

DEFAULT_CACHE_FRACTION = 0.5  # of the memory there is for the cache (module docstring)
MIN_CONTEXT = 4096  # tokens one sequence must fit when max_model_len is not given
TYPICAL_CONTEXT = 4096  # the start-up line's second concurrency figure
WORKSPACE_FLOOR = 64 << 20  # bytes: torch's allocator, small buffers, the sampler's scratch
ATTENTION_TILE = 512  # keys per attention tile of the prefill kernels (scores scratch)

_GIB = float(1 << 30)


def available_memory(meminfo: str | None = None, cgroup: Path | None = Path("/sys/fs/cgroup")
                     ) -> int:
    """Bytes this process may still take: ``MemAvailable``, or the cgroup v2 limit less its use
    when that is lower."""
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    avail = next(int(line.split()[1]) * 1024 for line in text.splitlines()
                 if line.startswith("MemAvailable:"))
    if cgroup is not None:
        try:
            limit = (cgroup / "memory.max").read_text().strip()
            used = int((cgroup / "memory.current").read_text())
            if limit != "max":
                avail = min(avail, int(limit) - used)
        except (OSError, ValueError):
            pass
    return max(0, avail)


def workspace_bytes(config: Qwen35Config, cfg: EngineConfig) -> int:
    """An upper estimate of the activations of the largest step: ``max_num_batched_tokens`` rows
    through the widest layer (fp32), an attention-scores tile per head, and the sampler's fp32
    copies of the sampled rows' logits (one per running sequence, a few copies each)."""
    t = cfg.max_num_batched_tokens
    q_width = config.num_attention_heads * config.head_dim
    per_row = (8 * config.hidden_size + 3 * config.intermediate_size + 2 * config.conv_dim
               + 3 * q_width)
    scores = config.num_attention_heads * t * ATTENTION_TILE
    logits = 4 * cfg.max_num_seqs * config.vocab_size
    spec = cfg.speculative
    capsules = 0 if spec is None else (cfg.num_state_slots or cfg.max_num_seqs) * capsule_bytes(
        config, spec.capacity, torch.float32)
    return WORKSPACE_FLOOR + 4 * (t * per_row + scores + logits) + capsules


def weight_bytes(model: torch.nn.Module, mapped_only: bool = False) -> int:
    """Bytes of the model's parameters, each storage once, and of its int8 / int4 projections
    (codes, scales, zero points; their fp placeholders on the meta device hold nothing);
    ``mapped_only`` counts only the parameters that are still views of the checkpoint's mapping
    (``weights.is_mapped``) -- the rest (quantised codes, weights held in a ``HugePageArena``,
    converted copies) are private memory, already out of the available memory."""
    seen: set[int] = set()
    total = 0
    if not mapped_only:
        total += sum(q.nbytes for m in model.modules()
                     if (q := getattr(m, "quant", None)) is not None)
    for p in model.parameters():
        if p.is_meta or (mapped_only and not is_mapped(p)):
            continue
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class MemoryPlan:
    sizes: PoolSizes
    budget: int | None  # bytes for pages + slots + checkpoints (None: num_blocks was given)
    source: str  # where the budget came from
    weights: int
    workspace: int
    page_bytes: int
    slot_bytes: int
    block_size: int
    dtype: str  # the model's (weights and activations)
    warnings: tuple[str, ...] = ()

    @property
    def cache_bytes(self) -> int:
        s = self.sizes
        return s.num_blocks * self.page_bytes + (s.num_slots + s.num_checkpoints) * self.slot_bytes

    def concurrent(self, context: int) -> int:
        """Sequences of ``context`` tokens that run at once (pages and slots both limit)."""
        pages = -(-min(context, self.sizes.max_model_len) // self.block_size)
        return min(self.sizes.num_slots, self.sizes.num_blocks // max(pages, 1))

    def summary(self) -> str:
        s = self.sizes
        budget = "" if self.budget is None else f" of {self.budget / _GIB:.2f} GiB ({self.source})"
        typical = min(TYPICAL_CONTEXT, s.max_model_len)
        return (f"memory: weights {self.weights / _GIB:.2f} GiB {self.dtype}; cache "
                f"{self.cache_bytes / _GIB:.2f} GiB{budget}: {s.num_blocks} KV pages x "
                f"{self.block_size} tokens ({self.page_bytes} B each, "
                f"{s.num_blocks * self.block_size} tokens), {s.num_slots} state slots and "
                f"{s.num_checkpoints} state checkpoints ({self.slot_bytes} B each); workspace "
                f"{self.workspace / _GIB:.2f} GiB; at once: {self.concurrent(s.max_model_len)} "
                f"sequences at full context ({s.max_model_len} tokens), "
                f"{self.concurrent(typical)} at {typical}")


def plan_memory(config: Qwen35Config, cfg: EngineConfig, dtype: torch.dtype,
                weights: int = 0, available: int | None = None,
                unmapped: int | None = None, draft_head: bool = False) -> MemoryPlan:
    """The pools of an engine for ``config`` in ``dtype`` (module docstring). ``available``:
    the machine's available memory in bytes (default: measured now); ``unmapped``: the part of
    ``weights`` that is not already in private memory, so not yet out of ``available``
    (default: all of it; quantised weights are already there); ``draft_head``: the pages also
    hold the K/V of the model's draft head (a proposer's ``model_head``: the MTP head's layer)."""
    bs = cfg.block_size
    per_page = max(page_bytes(config, bs, cfg.page_dtype(dtype),
                              dtype if draft_head else None), 1)
    per_slot = slot_bytes(config, dtype)
    limit = min(cfg.max_model_len or config.max_position_embeddings,
                config.max_position_embeddings)
    slots = cfg.num_state_slots or cfg.max_num_seqs
    caching = cfg.enable_prefix_caching
    checkpoints = (cfg.num_state_checkpoints or slots) if caching else 0
    workspace = workspace_bytes(config, cfg)

    def plan(blocks: int, budget: int | None, source: str,
             warnings: tuple[str, ...] = ()) -> MemoryPlan:
        max_len = cfg.max_model_len or min(limit, blocks * bs)
        return MemoryPlan(PoolSizes(int(blocks), int(slots), int(max_len), int(checkpoints)),
                          budget, source, weights, workspace, per_page, per_slot, bs,
                          logical_name(dtype), warnings)

    if cfg.num_blocks is not None:
        return plan(cfg.num_blocks, None, "num_blocks")
    if cfg.cache_memory_bytes is not None:
        budget, source, option = cfg.cache_memory_bytes, "cache_memory_bytes", \
            "cache_memory_bytes"
    else:
        fraction = cfg.cache_memory_fraction or DEFAULT_CACHE_FRACTION
        free = available if available is not None else available_memory()
        room = free - (weights if unmapped is None else unmapped) - workspace
        budget = max(0, int(fraction * room))
        source = (f"{fraction:g} of {room / _GIB:.2f} GiB: {free / _GIB:.2f} GiB available less "
                  f"weights and workspace")
        option = "cache_memory_fraction / cache_memory_bytes"
    # one sequence of max_model_len must fit; without one, MIN_CONTEXT tokens under the default
    # budget and one page under an explicit one (its pages then decide max_model_len)
    need_len = cfg.max_model_len or (min(limit, MIN_CONTEXT) if cfg.cache_memory_bytes is None
                                     else bs)
    need_pages = -(-need_len // bs)
    warnings: list[str] = []
    while (slots + checkpoints) * per_slot + need_pages * per_page > budget:
        if checkpoints and cfg.num_state_checkpoints is None:
            fit = max(0, (budget - need_pages * per_page) // per_slot - slots)
            checkpoints_was, checkpoints = checkpoints, int(min(checkpoints - 1, fit))
            warnings.append(f"state checkpoints cut from {checkpoints_was} to {checkpoints} to "
                            f"fit the cache budget ({budget} B): fewer prefixes stay cached")
        elif slots > 1 and cfg.num_state_slots is None:
            fit = max(1, (budget - need_pages * per_page) // per_slot - checkpoints)
            slots_was, slots = slots, int(min(slots - 1, fit))
            warnings.append(f"state slots cut from {slots_was} to {slots} to fit the cache "
                            f"budget ({budget} B): at most {slots} sequences run at once "
                            f"(max_num_seqs {cfg.max_num_seqs})")
        else:
            short = (slots + checkpoints) * per_slot + need_pages * per_page - budget
            fixes = [f"raise {option} so that the cache gets {short} B more (at least "
                     f"{budget + short} B)"]
            if cfg.max_model_len is not None and cfg.max_model_len > bs:
                fit_pages = (budget - (slots + checkpoints) * per_slot) // per_page
                if fit_pages > 0:
                    fixes.append(f"or lower max_model_len from {cfg.max_model_len} to "
                                 f"{fit_pages * bs}")
            if cfg.num_state_slots is not None and slots > 1:
                fixes.append(f"or lower num_state_slots from {slots}")
            if cfg.num_state_checkpoints is not None and checkpoints:
                fixes.append(f"or lower num_state_checkpoints from {checkpoints}")
            raise CapacityError(
                f"cache budget {budget} B ({source}) does not hold {slots} state slots and "
                f"{checkpoints} state checkpoints of {per_slot} B plus the {need_pages} KV "
                f"pages of {per_page} B one sequence of {need_len} tokens needs: "
                + " ".join(fixes))
    blocks = (budget - (slots + checkpoints) * per_slot) // per_page
    blocks = min(blocks, cfg.max_num_seqs * -(-limit // bs))
    return plan(max(blocks, need_pages), budget, source, tuple(warnings))

