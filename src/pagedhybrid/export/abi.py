"""The packed paged hybrid graph ABI, derived from a ``Qwen35Config`` and the export options.

One description feeds the graph builder, ``genai_config.json``, the workflow metadata and the
verifier, so they cannot disagree. ``N`` packed tokens, ``B`` sequences, ``P`` pages of
``block_size`` tokens:

=====================================  =========  ==========================================
name                                   dtype      shape
=====================================  =========  ==========================================
input_ids                              int64      [N]
position_ids                           int64      [3, N]   (MRoPE planes T/H/W)
block_table                            int32      [B, max_blocks_per_sequence]
cumulative_sequence_lengths            int32      [B+1]
past_sequence_lengths                  int32      [B]
attention_metadata                     int32      [3]      (host memory)
past_key_values.{i}.key / .value       T_CACHE    [P, block_size, Hkv, hd]  (full layers)
past_key_values.{i}.conv_state         T          [B, conv_dim, K-1]        (linear layers)
past_key_values.{i}.recurrent_state    float      [B, Hv, Dv, Dk]           (linear, V-major)
logits (output)                        float      [N, vocab] or [B, vocab] when pruned
present.{i}.* (outputs)                as past    same shapes; aliased in place by the runtime
hidden_states (output, --mtp)          T          [N, hidden]  (final-norm hidden, every row)
=====================================  =========  ==========================================

With ``--mtp`` the MTP head is its own graph (``mtp_inputs`` / ``mtp_outputs``): the shared
packed inputs, ``hidden_states [N, hidden]`` (the main graph's, row for row) and its one layer's
pages ``past_key_values.0.key / .value`` (``T``, never quantized); outputs ``logits [N, vocab]``,
``hidden_states_out [N, hidden]`` and ``present.0.*``.

``T`` is float16 or bfloat16; ``T_CACHE`` is ``T`` or, with quantized pages, int8 /
float8e4m3fn (scales are initializers of the PagedAttention nodes). Every name follows
``constants``; the layer partition is the config's ``layer_types``, never hard-coded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedhybrid.export import constants as c
from pagedhybrid.export.nbits import weight_metadata
from pagedhybrid.export.options import ExportOptions
from pagedhybrid.models.qwen35.config import Qwen35Config

Dim = int | str


class TensorSpec(NamedTuple):
    """One graph input or output: name, ONNX element type name, shape (ints or symbols)."""

    name: str
    dtype: str
    shape: tuple[Dim, ...]


class CachePair(NamedTuple):
    """A state input and the output that aliases it, with the layer and the state kind."""

    layer: int
    kind: str  # key | value | conv_state | recurrent_state
    past: str
    present: str


@dataclass(frozen=True)
class PackedAbi:
    config: Qwen35Config
    options: ExportOptions

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def io_dtype(self) -> str:
        return self.options.onnx_dtype

    @property
    def full_layers(self) -> tuple[int, ...]:
        return self.config.full_attention_layers

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return self.config.linear_attention_layers

    # -- shapes ------------------------------------------------------------------------------
    def kv_shape(self) -> tuple[Dim, ...]:
        cfg = self.config
        return (c.DIM_BLOCKS, self.block_size, cfg.num_key_value_heads, cfg.head_dim)

    def conv_shape(self) -> tuple[Dim, ...]:
        cfg = self.config
        return (c.DIM_BATCH, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)

    def recurrent_shape(self) -> tuple[Dim, ...]:
        cfg = self.config
        return (c.DIM_BATCH, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                cfg.linear_key_head_dim)

    def logits_shape(self) -> tuple[Dim, ...]:
        rows = c.DIM_BATCH if self.options.prune_logits else c.DIM_TOKENS
        return (rows, self.config.vocab_size)

    # -- names ---------------------------------------------------------------------------------
    def cache_pairs(self) -> list[CachePair]:
        """Every (past, present) pair in graph order: layer by layer."""
        pairs: list[CachePair] = []
        full = set(self.full_layers)
        for i in range(self.config.num_hidden_layers):
            if i in full:
                pairs.append(CachePair(i, "key", c.PAST_KEY % i, c.PRESENT_KEY % i))
                pairs.append(CachePair(i, "value", c.PAST_VALUE % i, c.PRESENT_VALUE % i))
            else:
                pairs.append(CachePair(i, "conv_state", c.PAST_CONV % i, c.PRESENT_CONV % i))
                pairs.append(CachePair(i, "recurrent_state", c.PAST_RECURRENT % i,
                                       c.PRESENT_RECURRENT % i))
        return pairs

    @property
    def kv_dtype(self) -> str:
        return self.options.kv_onnx_dtype

    def cache_spec(self, kind: str, name: str) -> TensorSpec:
        if kind in ("key", "value"):
            return TensorSpec(name, self.kv_dtype, self.kv_shape())
        if kind == "conv_state":
            return TensorSpec(name, self.io_dtype, self.conv_shape())
        return TensorSpec(name, "float", self.recurrent_shape())

    @property
    def capacity(self) -> int:
        """Tokens per sequence whose compact state updates the graph captures (0: none)."""
        return self.options.state_update_capacity

    def capsule_width(self) -> int:
        """Floats per sequence of a GatedDeltaNet capsule: C (Hv + Hk Dk + Hv Dv)."""
        cfg = self.config
        hv, hk = cfg.linear_num_value_heads, cfg.linear_num_key_heads
        return self.capacity * (hv + hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim)

    def state_update_inputs(self) -> list[TensorSpec]:
        if not self.capacity or not self.linear_layers:
            return []
        return [TensorSpec(c.STATE_UPDATE_CAPTURE_COUNT, "int32", (c.DIM_BATCH,)),
                TensorSpec(c.STATE_UPDATE_ACTIVE, "int32", (1,))]

    def state_update_outputs(self) -> list[TensorSpec]:
        """Per linear layer: the conv's captured input rows and GatedDeltaNet's capsule."""
        if not self.capacity:
            return []
        out = []
        for i in self.linear_layers:
            out.append(TensorSpec(c.STATE_UPDATE_CONV % i, self.io_dtype,
                                  (c.DIM_BATCH, self.capacity, self.config.conv_dim)))
            out.append(TensorSpec(c.STATE_UPDATE_RECURRENT % i, "float",
                                  (c.DIM_BATCH, self.capsule_width())))
        return out

    def inputs(self) -> list[TensorSpec]:
        shared = [
            TensorSpec(c.INPUT_IDS, "int64", (c.DIM_TOKENS,)),
            TensorSpec(c.POSITION_IDS, "int64", (3, c.DIM_TOKENS)),
            TensorSpec(c.BLOCK_TABLE, "int32", (c.DIM_BATCH, c.DIM_MAX_BLOCKS)),
            TensorSpec(c.CU_SEQLENS, "int32", (c.DIM_BATCH_PLUS_1,)),
            TensorSpec(c.PAST_SEQLENS, "int32", (c.DIM_BATCH,)),
            TensorSpec(c.ATTENTION_METADATA, "int32", (3,)),
        ]
        return (shared + [self.cache_spec(p.kind, p.past) for p in self.cache_pairs()]
                + self.state_update_inputs())

    def outputs(self) -> list[TensorSpec]:
        logits = TensorSpec(c.LOGITS, "float", self.logits_shape())
        return ([logits] + [self.cache_spec(p.kind, p.present) for p in self.cache_pairs()]
                + self.state_update_outputs() + self.hidden_outputs())

    def hidden_spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.io_dtype, (c.DIM_TOKENS, self.config.hidden_size))

    def hidden_outputs(self) -> list[TensorSpec]:
        return [self.hidden_spec(c.HIDDEN_STATES)] if self.options.mtp else []

    def mtp_page_spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.io_dtype, self.kv_shape())

    def mtp_inputs(self) -> list[TensorSpec]:
        """The MTP head graph's inputs (module docstring)."""
        return [*self.inputs()[:len(c.SHARED_INPUTS)], self.hidden_spec(c.HIDDEN_STATES),
                self.mtp_page_spec(c.PAST_KEY % c.MTP_LAYER),
                self.mtp_page_spec(c.PAST_VALUE % c.MTP_LAYER)]

    def mtp_outputs(self) -> list[TensorSpec]:
        return [TensorSpec(c.LOGITS, "float", (c.DIM_TOKENS, self.config.vocab_size)),
                self.hidden_spec(c.HIDDEN_STATES_OUT),
                self.mtp_page_spec(c.PRESENT_KEY % c.MTP_LAYER),
                self.mtp_page_spec(c.PRESENT_VALUE % c.MTP_LAYER)]

    def state_groups(self) -> list[dict[str, object]]:
        """onnxruntime-genai 0.18.0 ``model.decoder.state_groups`` (typed kinds)."""
        groups: list[dict[str, object]] = [
            {"kind": c.GROUP_PAGED_KV, "layer_ids": list(self.full_layers)}]
        if self.linear_layers:
            conv: dict[str, object] = {"kind": c.GROUP_FIXED_CONV,
                                       "layer_ids": list(self.linear_layers)}
            rec: dict[str, object] = {"kind": c.GROUP_FIXED_RECURRENT,
                                      "layer_ids": list(self.linear_layers)}
            if self.capacity:
                conv["state_update"] = {"capacity": self.capacity}
                rec["state_update"] = {"capacity": self.capacity,
                                       "key_head_count": self.config.linear_num_key_heads}
            groups += [conv, rec]
        return groups

    def metadata_props(self) -> dict[str, str]:
        o = self.options
        return {
            c.META_ABI: c.ABI_NAME,
            c.META_MODEL_TYPE: "qwen3_5_moe_text" if self.config.is_moe else "qwen3_5_text",
            c.META_BLOCK_SIZE: str(self.block_size),
            c.META_FULL_LAYERS: ",".join(str(i) for i in self.full_layers),
            c.META_LINEAR_LAYERS: ",".join(str(i) for i in self.linear_layers),
            c.META_EP: o.ep,
            c.META_DTYPE: o.onnx_dtype,
            c.META_KV_DTYPE: self.kv_dtype,
            c.META_KV_QUANT: o.quant_type,
            c.META_PRUNE_LOGITS: "1" if o.prune_logits else "0",
            c.META_STATE_UPDATE: str(self.capacity),
            c.META_MTP: "1" if o.mtp else "0",
            c.META_WEIGHTS: "included" if o.weights else "absent",
            c.META_ORT: c.ONNXRUNTIME_PIN,
            c.META_ORT_GPU: c.ONNXRUNTIME_GPU_PIN,
            c.META_GENAI: c.ONNXRUNTIME_GENAI_PIN,
            c.META_GENAI_COMMIT: c.ONNXRUNTIME_GENAI_COMMIT,
            c.META_WEBGPU_PLUGIN: c.WEBGPU_PLUGIN_PIN,
            **weight_metadata(o.weight_quant),
            **self.moe_metadata(),
        }

    def moe_metadata(self) -> dict[str, str]:
        """A mixture-of-experts model's sizes (read back by ``moe.verify_moe``); none if dense."""
        cfg = self.config
        if not cfg.is_moe:
            return {}
        return {c.META_MOE_EXPERTS: str(cfg.num_experts),
                c.META_MOE_TOP_K: str(cfg.num_experts_per_tok),
                c.META_MOE_INTERMEDIATE: str(cfg.moe_intermediate_size),
                c.META_MOE_SHARED: str(cfg.shared_expert_intermediate_size)}
