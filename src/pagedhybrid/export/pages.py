"""The KV page budget an export writes into ``engine.dynamic_batching`` (``plan_pages``).

onnxruntime-genai 0.18.0 sizes its paged KV cache from free device memory
(``gpu_utilization_factor``, its builder's default 0.6) on CUDA only: the other devices have no
``GetAvailableMemory``, so a package for any other provider (here ``--ep webgpu``) must name
``num_blocks``. The runtime then caps each request at what the pages hold
(``EngineCapabilities.max_request_length = min(search.max_length, num_blocks * block_size + 1)``,
measured with 0.18.0 on WebGPU).

Without ``--num-blocks`` the export picks ``num_blocks`` for such a provider by the engine's own
rule (``engine/core/memory.py``) with the budget fixed at export time instead of measured:

* demand: ``max_batch_size`` sequences that each reach ``max_length`` tokens, i.e.
  ``max_batch_size * ceil(max_length / block_size)`` pages; ``max_length`` is ``--max-length``,
  else the model's ``context_length`` (``max_position_embeddings``, genai's ``search.max_length``);
* budget: at most ``DEFAULT_KV_BUDGET`` (1 GiB) of pages in all -- a page is ``block_size`` tokens
  of K and V in every full-attention layer (and the MTP head's layer with ``--mtp``) -- and at
  most ``WEBGPU_BINDING_LIMIT`` (128 MiB) in one layer's K (or V) buffer: PagedAttention binds a
  layer's cache as one storage buffer, and 128 MiB is WebGPU's default
  ``maxStorageBufferBindingSize``, the size every adapter (browsers included) grants;
* ``num_blocks = min(demand, budget)``;
* the budget must hold one sequence of ``--max-length`` tokens, or of ``MIN_CONTEXT`` (4096, the
  engine's) tokens when ``--max-length`` is not given (the model's context when shorter); a model
  whose pages cannot is refused with what fits, before anything is written.

``--num-blocks`` always wins (with ``--max-length``, it must hold one sequence of that length).
``search.max_length`` stays the model's context unless ``--max-length`` is given; the graph keeps
``num_blocks`` symbolic (the page count is a runtime allocation).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedhybrid import dtypes
from pagedhybrid.engine.core.memory import MIN_CONTEXT
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35.config import Qwen35Config

DEFAULT_KV_BUDGET = 1 << 30  # bytes of KV pages in all, the default page count's budget
WEBGPU_BINDING_LIMIT = 128 << 20  # WebGPU's default maxStorageBufferBindingSize (bytes)
DEFAULT_GPU_UTILIZATION = 0.6  # onnxruntime-genai's builder default (CUDA sizes pages itself)
SIZES_ITSELF = ("cuda",)  # providers whose genai runtime sizes pages from free device memory

_MIB = float(1 << 20)


def _size(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / _MIB:.1f} MiB"


@dataclass(frozen=True)
class PagePlan:
    """The page budget of one export and where it came from."""

    block_size: int
    num_blocks: int | None  # None: the runtime sizes pages (gpu_utilization_factor)
    gpu_utilization: float | None
    max_length: int  # search.max_length
    page_bytes: int  # one page across every paged layer, K and V
    source: str  # "--num-blocks", "--gpu-utilization", or the default rule's figures

    def budget(self) -> dict[str, int | float]:
        """``engine.dynamic_batching``'s page budget: ``num_blocks`` or the utilization."""
        if self.num_blocks is not None:
            return {"num_blocks": self.num_blocks}
        return {"gpu_utilization_factor": self.gpu_utilization or DEFAULT_GPU_UTILIZATION}

    def summary(self) -> str:
        """The export's ``pages:`` line."""
        if self.num_blocks is None:
            return (f"gpu_utilization_factor {self.budget()['gpu_utilization_factor']:g} of free "
                    f"device memory, pages of {self.block_size} tokens (sized by onnxruntime-genai "
                    f"at load; {self.source})")
        return (f"num_blocks {self.num_blocks} of {self.block_size} tokens = "
                f"{_size(self.num_blocks * self.page_bytes)} ({self.source}); up to "
                f"{min(self.max_length, self.num_blocks * self.block_size)} tokens per sequence")


def page_bytes(config: Qwen35Config, block_size: int, kv_dtype: str, mtp_dtype: str | None
               ) -> tuple[int, int]:
    """(bytes of one page across all paged layers, K and V; bytes of one layer's K page, the
    largest buffer page) for pages in ``kv_dtype`` and the MTP head's in ``mtp_dtype``."""
    tokens = block_size * config.num_key_value_heads * config.head_dim
    layer = tokens * dtypes.itemsize(kv_dtype)
    head = 0 if mtp_dtype is None else tokens * dtypes.itemsize(mtp_dtype)
    return 2 * (layer * len(config.full_attention_layers) + head), max(layer, head)


def _pages(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_pages(config: Qwen35Config, ep: str, block_size: int, max_batch_size: int,
               num_blocks: int | None = None, gpu_utilization: float | None = None,
               max_length: int | None = None, kv_dtype: str = "float16",
               mtp_dtype: str | None = None) -> PagePlan:
    """The page budget by the module docstring's rule; ``UnsupportedConfiguration`` when the
    pages cannot hold the context it asks for."""
    context = config.max_position_embeddings
    if max_length is not None and not 1 <= max_length <= context:
        raise UnsupportedConfiguration(
            f"--max-length {max_length}: must be in [1, {context}] (the model's context_length, "
            "max_position_embeddings)")
    length = context if max_length is None else max_length
    per_page, layer_page = page_bytes(config, block_size, kv_dtype, mtp_dtype)

    def plan(blocks: int | None, source: str) -> PagePlan:
        return PagePlan(block_size, blocks, gpu_utilization, length, per_page, source)

    if num_blocks is not None:
        if max_length is not None and num_blocks * block_size < max_length:
            raise UnsupportedConfiguration(
                f"--num-blocks {num_blocks} x --block-size {block_size} = "
                f"{num_blocks * block_size} tokens cannot hold one sequence of --max-length "
                f"{max_length}; pass --num-blocks {_pages(max_length, block_size)} or more, or a "
                "smaller --max-length")
        return plan(num_blocks, "--num-blocks")
    if ep in SIZES_ITSELF:
        return plan(None, "--gpu-utilization" if gpu_utilization is not None else
                    "onnxruntime-genai's default factor")
    demand = max_batch_size * _pages(length, block_size)
    fit_total, fit_buffer = DEFAULT_KV_BUDGET // per_page, WEBGPU_BINDING_LIMIT // layer_page
    fit = min(fit_total, fit_buffer)
    need_tokens = length if max_length is not None else min(length, MIN_CONTEXT)
    if fit < _pages(need_tokens, block_size):
        bound = (f"{_size(DEFAULT_KV_BUDGET)} of pages in all" if fit_total <= fit_buffer
                 else f"{_size(WEBGPU_BINDING_LIMIT)} in one layer's K or V buffer, WebGPU's "
                 "default maxStorageBufferBindingSize")
        asked = "--max-length" if max_length is not None else "the default minimum context"
        raise UnsupportedConfiguration(
            f"--ep {ep} without --num-blocks: one sequence of {need_tokens} tokens ({asked}) "
            f"needs {_pages(need_tokens, block_size)} pages of {block_size} tokens "
            f"({_size(per_page)} each across {len(config.full_attention_layers)} "
            f"full-attention layers), but the default budget ({bound}) holds {fit} pages = "
            f"{fit * block_size} tokens; pass a smaller --max-length or pin --num-blocks N "
            "(each sequence reaches at most N x block-size tokens)")
    blocks = min(demand, fit)
    bound = ("every sequence reaches max_length" if blocks == demand else
             f"capped at {_size(DEFAULT_KV_BUDGET)} of pages in all" if fit == fit_total else
             f"capped at {_size(WEBGPU_BINDING_LIMIT)} per layer buffer")
    return plan(blocks, f"default for --ep {ep}: {max_batch_size} sequences x "
                f"{_pages(length, block_size)} pages for max_length {length}, {bound}")
