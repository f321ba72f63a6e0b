"""Names and pins of the packed paged hybrid ONNX ABI (one place for every hard-coded string).

The graph ABI (inputs, outputs, cache names) is the one of ``reference/qwen35-model.md`` §5.1:
packed tokens, ``position_ids [3, N]``, block table and sequence lengths, a host-side
``attention_metadata int32[3]``, per full-attention layer ``past_key_values.{i}.key/.value`` page
buffers, per linear layer ``past_key_values.{i}.conv_state`` / ``.recurrent_state``; outputs
``logits`` and ``present.{i}.*``. The runtime pins are the wheels this ABI was verified against.
"""

from __future__ import annotations

from pagedhybrid.models.qwen35.packed import ABI_INPUT_NAMES
from pagedhybrid.ops.spec import MAX_STATE_UPDATE_CAPACITY

__all__ = ["MAX_STATE_UPDATE_CAPACITY"]  # (the ops' limit, re-exported beside the names)

# -- graph inputs (order of the graph) ------------------------------------------------------------
# The names are the model's own PackedBatch ABI map, so the engine and the export cannot disagree.
INPUT_IDS = ABI_INPUT_NAMES["input_ids"]
POSITION_IDS = ABI_INPUT_NAMES["position_ids"]
BLOCK_TABLE = ABI_INPUT_NAMES["block_table"]
CU_SEQLENS = ABI_INPUT_NAMES["cu_seqlens"]
PAST_SEQLENS = ABI_INPUT_NAMES["past_seqlens"]
ATTENTION_METADATA = ABI_INPUT_NAMES["attention_metadata"]
SHARED_INPUTS = (INPUT_IDS, POSITION_IDS, BLOCK_TABLE, CU_SEQLENS, PAST_SEQLENS,
                 ATTENTION_METADATA)
LOGITS = "logits"

# -- per-layer state names (printf templates, as genai_config spells them) ------------------------
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PAST_CONV = "past_key_values.%d.conv_state"
PAST_RECURRENT = "past_key_values.%d.recurrent_state"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"
PRESENT_CONV = "present.%d.conv_state"
PRESENT_RECURRENT = "present.%d.recurrent_state"

# -- compact state updates (--state-update-capacity; onnxruntime-genai 0.18.0's names) -----------
STATE_UPDATE_CAPTURE_COUNT = "state_update_capture_count"  # int32 [B]
STATE_UPDATE_ACTIVE = "state_update_active"  # int32 [1]
STATE_UPDATE_CONV = "state_update.%d.conv_value"  # [B, C, conv_dim] (activation type)
STATE_UPDATE_RECURRENT = "state_update.%d.recurrent_capsule"  # float [B, C (Hv + Hk Dk + Hv Dv)]

# -- the MTP head graph (--mtp; onnxruntime-genai 0.18.0's Qwen3.5 builder's names) -------------
HIDDEN_STATES = "hidden_states"  # main graph output / MTP graph input: final-norm hidden [N, H]
HIDDEN_STATES_OUT = "hidden_states_out"  # MTP graph output: the head's hidden [N, H]
MTP_LAYER = 0  # the head's layer index inside mtp.onnx (its cache names)
MTP_PREFIX = "mtp."  # checkpoint names of the head's weights

# -- symbolic dimensions --------------------------------------------------------------------------
DIM_TOKENS = "num_tokens"
DIM_BATCH = "batch_size"
DIM_BATCH_PLUS_1 = "batch_size + 1"
DIM_MAX_BLOCKS = "max_blocks_per_sequence"
DIM_BLOCKS = "num_blocks"

# -- state-group kinds of onnxruntime-genai 0.18.0 ------------------------------------------------
GROUP_PAGED_KV = "paged_kv"
GROUP_FIXED_CONV = "fixed_conv"
GROUP_FIXED_RECURRENT = "fixed_recurrent"

# -- operators ------------------------------------------------------------------------------------
MS_DOMAIN = "com.microsoft"
OPSET = 21
MS_OPSET = 1
IR_VERSION = 10
PAGED_ATTENTION = "PagedAttention"
VARLEN_CONV = "VarlenCausalConvWithState"
GATED_DELTA_NET = "GatedDeltaNet"
MOE = "MoE"  # one per layer of a mixture-of-experts model (export/moe.py)
MATMUL_NBITS = "MatMulNBits"  # a projection in 8 / 4 bits (--weights; export/nbits.py)
# a quantized MoE package's router gates (gate | shared_expert_gate), the one float MatMul left
ROUTER_WEIGHT = ".mlp.gate_and_shared_expert_gate.weight"
PAGED_ATTENTION_INPUTS = 17
PAGED_ATTENTION_METADATA_INDEX = 16
PAGED_ATTENTION_EMPTY = tuple(range(8, 14))
PAGED_ATTENTION_SCALES = (14, 15)  # k_scale, v_scale: initializers with quantized pages
K_SCALE = "model.layers.%d.self_attn.k_scale"
V_SCALE = "model.layers.%d.self_attn.v_scale"

# -- package files --------------------------------------------------------------------------------
MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "model.onnx.data"
MTP_FILE = "mtp.onnx"
MTP_WEIGHTS_FILE = "mtp.onnx.data"
GENAI_CONFIG_FILE = "genai_config.json"
WORKFLOW_FILE = "pagedhybrid_workflow.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
    "pagedhybrid_tokenizer.json",
)

# -- pins recorded in metadata_props --------------------------------------------------------------
ONNXRUNTIME_PIN = "1.32.0"
ONNXRUNTIME_GPU_PIN = "1.31.1"
ONNXRUNTIME_GENAI_PIN = "0.18.0"
ONNXRUNTIME_GENAI_COMMIT = "00d66ef04ec56c0dae66d93ae2690f72e7bb90eb"
WEBGPU_PLUGIN_PIN = "0.4.0"
PRODUCER = "pagedhybrid"

META_PREFIX = "pagedhybrid."
META_ABI = META_PREFIX + "abi"
ABI_NAME = "qwen3_5_text.packed_paged_hybrid.v1"
META_MODEL_TYPE = META_PREFIX + "model_type"
META_BLOCK_SIZE = META_PREFIX + "block_size"
META_FULL_LAYERS = META_PREFIX + "full_attention_layers"
META_LINEAR_LAYERS = META_PREFIX + "linear_attention_layers"
META_EP = META_PREFIX + "execution_provider"
META_DTYPE = META_PREFIX + "dtype"
META_KV_DTYPE = META_PREFIX + "kv_cache_dtype"  # the page buffers' ONNX element type
META_KV_QUANT = META_PREFIX + "kv_quant_type"  # NONE | PER_TENSOR | PER_CHANNEL
META_PRUNE_LOGITS = META_PREFIX + "prune_logits"
META_STATE_UPDATE = META_PREFIX + "state_update_capacity"
META_MTP = META_PREFIX + "mtp"  # "1": the package has the MTP head graph
META_WEIGHTS = META_PREFIX + "weights"
# --weights (export/nbits.py): the format ("none": float projections), MatMulNBits'
# accuracy_level, and whether the LM head is quantized ("1" / "0")
META_WEIGHT_FORMAT = META_PREFIX + "weight_format"
META_ACCURACY_LEVEL = META_PREFIX + "accuracy_level"
META_QUANTIZED_LM_HEAD = META_PREFIX + "quantized_lm_head"
META_PROJECTIONS = META_PREFIX + "projections"  # MatMulNBits node metadata: its B's tensors
# mixture of experts (only in the metadata of a qwen3_5_moe_text export; export/moe.py)
META_MOE_EXPERTS = META_PREFIX + "moe.num_experts"
META_MOE_TOP_K = META_PREFIX + "moe.num_experts_per_tok"
META_MOE_INTERMEDIATE = META_PREFIX + "moe.moe_intermediate_size"
META_MOE_SHARED = META_PREFIX + "moe.shared_expert_intermediate_size"
META_ORT = META_PREFIX + "onnxruntime_version"
META_ORT_GPU = META_PREFIX + "onnxruntime_gpu_version"
META_GENAI = META_PREFIX + "onnxruntime_genai_version"
META_GENAI_COMMIT = META_PREFIX + "onnxruntime_genai_commit"
META_WEBGPU_PLUGIN = META_PREFIX + "onnxruntime_ep_webgpu_version"
