"""Export options of the packed paged hybrid model and their typed rejections.

``ExportOptions`` is what ``pagedhybrid export`` collects; ``check_export(config, options)`` raises
``UnsupportedConfiguration`` with an actionable reason for every combination the export cannot
serve, before any graph is built:

* execution provider: ``cuda`` or ``webgpu``. ``cpu`` is refused: onnxruntime has no CPU kernel for
  ``com.microsoft.PagedAttention`` (``--ep webgpu`` runs on a CPU-only machine through Mesa's
  lavapipe Vulkan driver);
* dtype: ``fp16`` or ``bf16`` (PagedAttention has no float32 type); WebGPU's PagedAttention is
  float16 only;
* block size: a power of two >= 16 (PagedAttention's rule); ``head_dim % 8 == 0``;
* page budget: at most one of ``num_blocks`` / ``gpu_utilization``; a non-CUDA runtime cannot size
  pages from free device memory, so without ``num_blocks`` a ``webgpu`` export gets a page count
  by the rule of ``export/pages.py`` (``max_batch_size`` sequences of ``max_length`` tokens within
  a 1 GiB budget and WebGPU's 128 MiB buffer binding), refused when one sequence's context cannot
  fit; ``max_length`` (``search.max_length``) at most the model's context;
* at least one full-attention layer (the Engine needs one paged_kv state group);
* quantized KV pages (``kv_cache_dtype`` int8 | fp8): CUDA only -- ORT's WebGPU PagedAttention
  registers float16 caches only, and a session with an int8 / float8e4m3fn cache fails at
  initialization (measured with onnxruntime 1.32.0 + onnxruntime-ep-webgpu 0.4.0; the answer is
  ``kernels.onnxruntime.paged_attention.QUANTIZED_CACHE``);
* projections in 8 / 4 bits (``weight_format``, ``--weights int4|int8[:BLOCK][:asym]``): one
  ``com.microsoft.MatMulNBits`` per projection, float16 only, per-channel int8 only where every
  K padded to 32 is a power of two; ``accuracy_level`` defaults to onnxruntime-genai's builder's
  choice for the EP (``export/nbits.py`` has the rules and what was measured). The embedding
  table stays in the activation dtype.

A mixture-of-experts model (``qwen3_5_moe_text``) exports with one ``com.microsoft.MoE`` per
layer (``export/moe.py``); every MoE config the model serves is expressible (the config already
refuses, naming the field, what the op cannot compute: ``norm_topk_prob`` false,
``mlp_only_layers``, ``decoder_sparse_step`` != 1, ``num_experts_per_tok`` outside
``[1, num_experts]``), and the rules above hold for it as for a dense model (bfloat16 has no CPU
or WebGPU MoE kernel either: the webgpu/bf16 refusal covers it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedhybrid import dtypes
from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.export import constants as c
from pagedhybrid.export.nbits import (
    NBitsWeights,
    check_weight_options,
    genai_accuracy_level,
    parse_format,
)
from pagedhybrid.export.pages import PagePlan, plan_pages
from pagedhybrid.kernels.onnxruntime.paged_attention import QUANTIZED_CACHE
from pagedhybrid.models.qwen35.config import Qwen35Config

EPS = ("cuda", "webgpu")
DTYPES = ("fp16", "bf16")
DEFAULT_BLOCK_SIZE = 256
DEFAULT_MAX_BATCH_SIZE = 16
MAX_BATCH_SIZE_LIMIT = 256
KV_CACHE_DTYPES = {"int8": "int8", "fp8": "float8e4m3fn", "fp8_e4m3": "float8e4m3fn"}


@dataclass(frozen=True)
class ExportOptions:
    """What to export. ``weights=False`` writes the graph with weights declared but absent;
    ``weight_format`` (a ``WeightFormat`` spelling, ``--weights``) holds the projections in 8 / 4
    bits (None: the activation dtype)."""

    ep: str = "webgpu"
    dtype: str = "fp16"
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    gpu_utilization: float | None = None
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_length: int | None = None  # search.max_length (None: the model's context_length)
    max_scheduled_tokens: int | None = None
    prefill_chunk_size: int | None = None
    prune_logits: bool = False
    weights: bool = True
    kv_cache_dtype: str | None = None  # None: the activation dtype; int8 | fp8 (e4m3)
    kv_quant: str = "per-channel"  # per-channel | per-tensor
    kv_scales: str | None = None  # scale file; default: kv_scales/ in the checkpoint
    state_update_capacity: int = 0  # compact state updates per linear layer (speculation)
    mtp: bool = False  # also export the checkpoint's MTP head as its own graph (mtp.onnx)
    weight_format: str | None = None  # int4 | int8 [:BLOCK] [:asym] projections (MatMulNBits)
    accuracy_level: int | None = None  # MatMulNBits' (None: genai's builder default for the EP)
    quantize_lm_head: bool = True  # with weight_format: the LM head too (as the engine)

    @property
    def onnx_dtype(self) -> str:
        return dtypes.onnx_name(self.dtype)

    @property
    def weight_quant(self) -> NBitsWeights | None:
        """The projections' format (None: float MatMuls)."""
        if self.weight_format is None:
            return None
        level = self.accuracy_level
        return NBitsWeights(parse_format(self.weight_format),
                            genai_accuracy_level(self.ep) if level is None else level,
                            self.quantize_lm_head)

    @property
    def kv_onnx_dtype(self) -> str:
        """The page buffers' ONNX element type."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] if self.kv_cache_dtype else self.onnx_dtype

    @property
    def quant_type(self) -> str:
        """PagedAttention's ``k_quant_type`` / ``v_quant_type``."""
        if not self.kv_cache_dtype:
            return "NONE"
        return "PER_CHANNEL" if self.kv_quant == "per-channel" else "PER_TENSOR"

    def page_plan(self, config: Qwen35Config) -> PagePlan:
        """``engine.dynamic_batching``'s page budget and ``search.max_length`` for ``config``:
        ``num_blocks`` as given, the utilization factor on CUDA, else the default page count
        (``export/pages.py``)."""
        return plan_pages(config, self.ep, self.block_size, self.max_batch_size,
                          self.num_blocks, self.gpu_utilization, self.max_length,
                          self.kv_onnx_dtype, self.onnx_dtype if self.mtp else None)


def check_options(options: ExportOptions) -> None:
    """Reject option values and combinations the packed paged export cannot serve."""
    o = options
    if o.ep == "cpu":
        raise UnsupportedConfiguration(
            "--ep cpu: onnxruntime has no CPU kernel for com.microsoft.PagedAttention, so the "
            "packed paged graph cannot run on the CPU execution provider; export with --ep webgpu "
            "(it also runs on a CPU-only machine through Mesa lavapipe with "
            "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1) or --ep cuda")
    if o.ep not in EPS:
        raise UnsupportedConfiguration(
            f"--ep {o.ep!r}: the packed paged export targets {list(EPS)} (the execution providers "
            "with a PagedAttention kernel); pick one of them")
    if o.dtype in dtypes.spellings([torch.float32]):
        raise UnsupportedConfiguration(
            "--dtype fp32: com.microsoft.PagedAttention accepts only float16/bfloat16 "
            "activations; export with --dtype fp16 (or bf16 on --ep cuda)")
    if o.dtype not in DTYPES:
        raise UnsupportedConfiguration(
            f"--dtype {o.dtype!r}: use one of {list(DTYPES)}")
    if o.dtype == "bf16" and o.ep == "webgpu":
        raise UnsupportedConfiguration(
            "--dtype bf16 with --ep webgpu: the WebGPU PagedAttention kernel is float16 only; "
            "use --dtype fp16 on webgpu, or --ep cuda for bf16")
    bs = o.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs & (bs - 1):
        raise UnsupportedConfiguration(
            f"--block-size {bs}: PagedAttention needs a power of two >= 16 tokens per page "
            "(e.g. 16, 32, ..., 256)")
    if o.num_blocks is not None and o.gpu_utilization is not None:
        raise UnsupportedConfiguration(
            "--num-blocks and --gpu-utilization are mutually exclusive (genai's "
            "engine.dynamic_batching takes one page budget); pass only one")
    if o.num_blocks is not None and (isinstance(o.num_blocks, bool) or o.num_blocks < 1):
        raise UnsupportedConfiguration(f"--num-blocks {o.num_blocks}: must be >= 1")
    if o.gpu_utilization is not None and not 0.0 < o.gpu_utilization <= 1.0:
        raise UnsupportedConfiguration(
            f"--gpu-utilization {o.gpu_utilization}: must be a fraction in (0, 1]")
    if o.gpu_utilization is not None and o.ep != "cuda":
        raise UnsupportedConfiguration(
            f"--gpu-utilization with --ep {o.ep}: onnxruntime-genai sizes pages from free device "
            "memory only on CUDA; pin --num-blocks N, or leave both out for the default page "
            "count (enough for --max-batch-size sequences of --max-length tokens within 1 GiB)")
    if o.max_length is not None and (isinstance(o.max_length, bool) or o.max_length < 1):
        raise UnsupportedConfiguration(f"--max-length {o.max_length}: must be >= 1")
    if not 1 <= o.max_batch_size <= MAX_BATCH_SIZE_LIMIT:
        raise UnsupportedConfiguration(
            f"--max-batch-size {o.max_batch_size}: must be in [1, {MAX_BATCH_SIZE_LIMIT}]")
    if o.kv_cache_dtype is not None and o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedConfiguration(
            f"--kv-cache-dtype {o.kv_cache_dtype!r}: use int8 or fp8 (e4m3), or leave it out "
            "for pages in the activation dtype")
    if o.kv_quant not in ("per-channel", "per-tensor"):
        raise UnsupportedConfiguration(
            f"--kv-quant {o.kv_quant!r}: use per-channel or per-tensor")
    if o.kv_cache_dtype and o.ep == "webgpu":
        raise UnsupportedConfiguration(
            f"--kv-cache-dtype {o.kv_cache_dtype} with --ep webgpu: ORT's WebGPU PagedAttention "
            f"cannot run quantized pages ({QUANTIZED_CACHE}); export with --ep cuda, or without "
            "--kv-cache-dtype for float16 pages")
    if o.max_scheduled_tokens is not None and o.max_scheduled_tokens < 1:
        raise UnsupportedConfiguration(
            f"--max-scheduled-tokens {o.max_scheduled_tokens}: must be >= 1")
    if o.prefill_chunk_size is not None and o.prefill_chunk_size < 1:
        raise UnsupportedConfiguration(
            f"--prefill-chunk-size {o.prefill_chunk_size}: must be >= 1")
    cap = o.state_update_capacity
    if isinstance(cap, bool) or not isinstance(cap, int) or \
            not 0 <= cap <= c.MAX_STATE_UPDATE_CAPACITY:
        raise UnsupportedConfiguration(
            f"--state-update-capacity {cap}: must be an int in [0, "
            f"{c.MAX_STATE_UPDATE_CAPACITY}] (ONNX Runtime 1.32's GatedDeltaNet / "
            "VarlenCausalConvWithState capture at most 8 tokens per sequence; 0 = off)")
    check_weight_options(o.weight_format, o.dtype, o.accuracy_level, o.quantize_lm_head)


def check_model(config: Qwen35Config) -> None:
    """Reject model shapes the packed paged graph cannot express."""
    if config.head_dim % 8:
        raise UnsupportedConfiguration(
            f"head_dim={config.head_dim}: PagedAttention needs head_dim % 8 == 0; this model "
            "cannot use the paged full-attention kernel")
    if not config.full_attention_layers:
        raise UnsupportedConfiguration(
            "the model has no full_attention layer: the continuous-batching Engine needs exactly "
            "one paged_kv state group with at least one layer")


def check_export(config: Qwen35Config, options: ExportOptions) -> None:
    check_options(options)
    check_model(config)
    options.page_plan(config)  # the page budget's refusals (export/pages.py)
    if options.mtp and config.mtp_num_hidden_layers != 1:
        raise UnsupportedConfiguration(
            f"--mtp: the checkpoint has mtp_num_hidden_layers={config.mtp_num_hidden_layers}; "
            "the MTP head graph needs a checkpoint with one MTP layer and its mtp.* tensors "
            "(onnxruntime-genai 0.18.0 requires model.mtp.num_hidden_layers = 1)")
    if options.mtp and config.linear_attention_layers and options.state_update_capacity < 2:
        raise UnsupportedConfiguration(
            f"--mtp with --state-update-capacity {options.state_update_capacity}: a hybrid "
            "model's drafts are verified by capturing the linear layers' compact state updates "
            "(onnxruntime-genai 0.18.0 turns speculation off without them); pass "
            "--state-update-capacity K >= 2 (the last token and K - 1 drafts)")
