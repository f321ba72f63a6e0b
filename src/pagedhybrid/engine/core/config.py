"""Engine configuration: ``EngineConfig``, ``SpeculativeConfig``, ``PoolSizes`` and the bytes of
one KV page and one state slot (``engine/core/memory.py`` plans the pools from them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagedhybrid.engine.core.kv_events import KVEventsConfig
from pagedhybrid.errors import ContractViolation, from_mapping
from pagedhybrid.kernels.registry import Needs
from pagedhybrid.kvquant import QUANTS, kv_dtype
from pagedhybrid.models.qwen35.config import Qwen35Config
from pagedhybrid.weightquant import WeightFormat

EXECUTORS = ("mp", "ray", "external_launcher")  # how the tensor-parallel ranks are started
MAX_SPECULATIVE_TOKENS = 7  # + the last sampled token = ONNX Runtime's capacity limit of 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``method`` (a registered proposer: ``ngram``, prompt lookup;
    ``mtp``, the checkpoint's MTP head; see ``engine/spec_decode/``), ``num_speculative_tokens`` k
    (1..7: a verify chunk is the last sampled token and k drafts, at most ONNX Runtime's
    state-update capacity of 8), ``prompt_lookup_min`` / ``prompt_lookup_max`` (the n-gram
    window), ``disable_by_batch_size`` (no drafts while more requests than that are running;
    default None, as vLLM's) and ``adaptive`` (ours: the draft budget, ``spec_decode/budget.py``;
    off = every draft verified)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    adaptive: bool = True  # DraftBudget on (ours, not vLLM's: off = every draft verified)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ContractViolation:
            return ContractViolation("speculative_config", name, rule, getattr(self, name))

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.method, str) or not self.method:  # (which: the registry's,
            raise bad("method", "must be a proposer's name")  # at the engine: spec_decode/)
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}]"
                      " (the verify chunk of k + 1 tokens fits a state-update capacity of 8)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not is_int(lo) or lo < 1:
            raise bad("prompt_lookup_min", "must be an int >= 1")
        if not is_int(hi) or hi < lo:
            raise bad("prompt_lookup_max", f"must be an int >= prompt_lookup_min ({lo})")
        d = self.disable_by_batch_size
        if d is not None and (not is_int(d) or d < 1):
            raise bad("disable_by_batch_size", "must be None or an int >= 1")
        if not isinstance(self.adaptive, bool):
            raise bad("adaptive", "must be a bool")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None
           ) -> SpeculativeConfig | None:
        """``value`` as a config: a mapping's unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ContractViolation("EngineConfig", "speculative_config",
                                    "must be a mapping (vLLM's speculative_config) or None",
                                    type(value).__name__)
        return from_mapping(cls, value, "speculative_config")

    @property
    def capacity(self) -> int:
        """Tokens per verify chunk: the last sampled token and the drafts."""
        return self.num_speculative_tokens + 1


@dataclass(frozen=True)
class EngineConfig:
    """Pool sizes and batching limits.

    ``num_blocks``, ``cache_memory_bytes`` and ``cache_memory_fraction`` are exclusive (like ORT
    GenAI's ``num_blocks`` / ``gpu_utilization_factor``); with none, the cache gets
    ``memory.DEFAULT_CACHE_FRACTION`` of the memory the machine has for it, split into
    ``num_state_slots`` slots (default ``max_num_seqs``), checkpoints and as many pages as fit,
    capped at what ``max_num_seqs`` requests of ``max_model_len`` tokens can use
    (``engine/core/memory.py``: defaults shrink to fit, with a warning). ``cache_fill=None`` fills
    the pools with random garbage instead of zeros (outputs must not change). ``backend`` picks the
    kernels (``pagedhybrid.kernels.backend.select``): ``auto`` runs the native kernels when the
    prebuilt extension is present and says why not otherwise; a named backend that cannot serve the
    model's dtype/shape is refused here, at construction.

    Prefix caching (``enable_prefix_caching``, on by default): full KV pages are content-hashed
    and kept after their requests finish, and the linear layers' states are checkpointed every
    ``state_checkpoint_interval`` tokens (a multiple of ``block_size``) into their own pool of
    ``num_state_checkpoints`` rows; a new request starts after its longest prefix that has both
    (``engine/core/scheduler.py``, ``HybridAllocator``).

    Quantized KV pages (``kv_cache_dtype`` ``int8`` | ``fp8_e4m3``; ``auto`` = the model's
    dtype): K/V are stored by ONNX Runtime's PagedAttention rule (``pagedhybrid.kvquant``) with
    calibrated, fixed scales -- ``kv_scales`` names a scale file (``pagedhybrid calibrate-kv``);
    without one the engine loads ``kv_scales/{dtype}-{kv_quant}.safetensors`` in the
    checkpoint folder and refuses to start if there is none (no silent dynamic scales). Pool sizing
    counts the smaller pages: a memory budget holds 2x (bf16) / 4x (fp32) the pages.

    ``batch_invariant=True``: every request's logits are bitwise the same whatever else is in
    the batch, where it sits in the packed stream, how its prefill is chunked, whether it was
    preempted and recomputed, and which pages it holds -- the kernels are selected for the
    property through the kernel registry (``native_batch_invariant``; a backend that does not
    declare it is refused at construction, never substituted). ``Engine.score`` /
    ``LLM.score`` then reproduce the sampled tokens' logprobs exactly.

    ``quantization`` (``int8`` | ``int4`` [``:BLOCK``] [``:asym``], ``pagedhybrid.weightquant``;
    None = the model dtype): every projection weight is quantised at load, round to nearest,
    and multiplied by the bundle's int8 / int4 kernel (activations quantised per row on the fly);
    a bundle without one is refused. The model object is quantised in place.

    ``huge_pages`` (on by default; CPU): every projection weight, plain or quantised, is copied
    into one private mapping advised for transparent huge pages and its checkpoint pages are
    released (``models/qwen35/weights.py``: decode 1.06-1.13x faster on the 141M benchmark
    model). Off, plain weights stay views of the checkpoint's mapping -- which processes serving
    the same files on one machine share through the page cache -- and quantised codes are kept
    in ordinary pages.

    ``adaptive_threads`` (on by default; off in batch-invariant mode): the engine drops to one
    thread while other processes keep the cores busy and returns to its threads when they leave
    room (``engine/worker/contention.py``).

    ``speculative_config`` (vLLM's: a mapping or ``SpeculativeConfig``, e.g. ``{"method":
    "ngram", "num_speculative_tokens": 3}``; None = off): drafts verified in the same packed
    steps, the linear layers' states rolled back by replaying the accepted tokens' compact
    state updates (``engine/spec_decode/``); each state slot gets capsules of ``k + 1``
    tokens (``kernels.capsule.capsule_bytes``); with ``"method": "mtp"`` each KV page also
    holds the MTP head's layer (model dtype) and the model is loaded with its ``mtp.*`` head.

    ``kv_events_config`` (vLLM's ``--kv-events-config``: a mapping, JSON text or
    ``KVEventsConfig``; None = off): every step's stored / removed KV pages are published over
    ZMQ in vLLM's KV-events format, for external prefix-aware routers
    (``engine/core/kv_events.py``).

    ``tensor_parallel_size`` ``W`` > 1 (``engine/worker/distributed.py``): this process is rank 0 --
    it schedules and samples -- and ``W - 1`` more ranks each run the model runner on their shard of
    every step (heads, MLP channels, KV pages and state slots split ``W`` ways), started by
    ``distributed_executor_backend``: ``mp`` (local worker processes, the default), ``ray`` (Ray
    actors in a placement group, on any node of the cluster at ``ray_address``) or
    ``external_launcher`` (every rank started by the user, torchrun-style ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``). ``load_engine`` / ``LLM`` start the ranks.
    """

    block_size: int = 16
    num_blocks: int | None = None
    cache_memory_bytes: int | None = None
    cache_memory_fraction: float | None = None  # of the memory there is for the cache
    num_state_slots: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    seed: int = 0
    device: str = "cpu"
    cache_fill: float | None = 0.0
    backend: str = "auto"  # kernel backend: auto | native | torch | reference
    enable_prefix_caching: bool = True
    state_checkpoint_interval: int | None = None  # tokens; default max(64, block_size)
    num_state_checkpoints: int | None = None  # default: as many as state slots
    prefix_cache_key: str | None = None  # e.g. a model/adapter id, part of every page hash
    kv_cache_dtype: str = "auto"  # auto | int8 | fp8_e4m3 (alias fp8)
    kv_quant: str = "per-channel"  # per-channel | per-tensor (quantized pages)
    kv_scales: str | None = None  # scale file; default: kv_scales/ in the checkpoint
    batch_invariant: bool = False
    quantization: str | None = None  # int8 | int4[:BLOCK][:asym] weights (weightquant)
    adaptive_threads: bool = True  # one thread while other processes keep the cores busy
    huge_pages: bool = True  # projection weights copied into huge pages (CPU)
    speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None
    kv_events_config: KVEventsConfig | Mapping[str, Any] | str | None = None  # vLLM's JSON
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp (default) | ray | external_launcher
    ray_address: str | None = None  # the Ray cluster (None: RAY_ADDRESS, else a local one)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.of(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.of(self.kv_events_config))
        given = [n for n in ("num_blocks", "cache_memory_bytes", "cache_memory_fraction")
                 if getattr(self, n) is not None]
        if len(given) > 1:
            raise ContractViolation("EngineConfig", "/".join(given), "are exclusive: give one",
                                    tuple(getattr(self, n) for n in given))
        f = self.cache_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not 0.0 < f <= 1.0):
            raise ContractViolation("EngineConfig", "cache_memory_fraction",
                                    "must be None or a number in (0, 1]", f)
        for name in ("num_blocks", "cache_memory_bytes", "num_state_slots", "max_model_len",
                     "state_checkpoint_interval", "num_state_checkpoints"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ContractViolation("EngineConfig", name, "must be None or an int >= 1", v)
        if self.kv_cache_dtype != "auto":
            kv_dtype(self.kv_cache_dtype)  # ContractViolation naming the field
        if self.quantization is not None:
            WeightFormat.parse(self.quantization)  # ContractViolation naming the field
        if self.kv_quant not in QUANTS:
            raise ContractViolation("EngineConfig", "kv_quant", f"must be one of {list(QUANTS)}",
                                    self.kv_quant)
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ContractViolation("EngineConfig", "tensor_parallel_size", "must be an int >= 1",
                                    tp)
        if self.distributed_executor_backend not in (None, *EXECUTORS):
            raise ContractViolation("EngineConfig", "distributed_executor_backend",
                                    f"must be one of {list(EXECUTORS)}",
                                    self.distributed_executor_backend)
        if self.state_checkpoint_interval is not None and \
                self.state_checkpoint_interval % self.block_size:
            raise ContractViolation("EngineConfig", "state_checkpoint_interval",
                                    f"must be a multiple of block_size {self.block_size}",
                                    self.state_checkpoint_interval)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding config (None: off)."""
        return self.speculative_config  # type: ignore[return-value]  # (normalised above)

    @property
    def weight_format(self) -> WeightFormat | None:
        """The projections' int8 / int4 format (None: the model dtype)."""
        return None if self.quantization is None else WeightFormat.parse(self.quantization)

    @property
    def executor(self) -> str:
        """How the other tensor-parallel ranks are started (``mp`` unless set)."""
        return self.distributed_executor_backend or "mp"

    @property
    def checkpoint_interval(self) -> int:
        return self.state_checkpoint_interval or max(64, self.block_size)

    def page_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pages' element type."""
        return model_dtype if self.kv_cache_dtype == "auto" else kv_dtype(self.kv_cache_dtype)

    def kernel_needs(self, model_config: Qwen35Config, dtype: torch.dtype,
                     weight_format: WeightFormat | None = None) -> Needs:
        """What this engine needs of the model's kernel bundle (a rank's ``model_config``, the
        model ``dtype``, the weights' format when already quantised): ``auto`` never picks a
        bundle that cannot serve prefix caching, the KV page dtype, batch invariance,
        speculative decoding or the weights' format, and says why."""
        fmt = self.weight_format or weight_format
        return Needs(backend=self.backend, dtype=dtype, config=model_config,
                     prefix_caching=self.enable_prefix_caching,
                     kv_page_dtype=self.page_dtype(dtype), batch_invariant=self.batch_invariant,
                     speculative=self.speculative is not None,
                     weight_format=None if fmt is None else fmt.name)


def page_bytes(config: Qwen35Config, block_size: int, dtype: torch.dtype,
               mtp_dtype: torch.dtype | None = None) -> int:
    """Bytes of one KV page across all full-attention layers (K and V), and the MTP head's
    layer in ``mtp_dtype`` when given."""
    per_token = block_size * config.num_key_value_heads * config.head_dim
    head = 0 if mtp_dtype is None else 2 * per_token * mtp_dtype.itemsize
    return 2 * per_token * dtype.itemsize * len(config.full_attention_layers) + head


def slot_bytes(config: Qwen35Config, dtype: torch.dtype) -> int:
    """Bytes of one state slot across all linear layers (conv in ``dtype``, recurrent fp32)."""
    conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * dtype.itemsize
    rec = (config.linear_num_value_heads * config.linear_value_head_dim
           * config.linear_key_head_dim * 4)
    return (conv + rec) * len(config.linear_attention_layers)


@dataclass(frozen=True)
class PoolSizes:
    num_blocks: int
    num_slots: int
    max_model_len: int
    num_checkpoints: int = 0

