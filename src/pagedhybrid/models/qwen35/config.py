"""Qwen3.5 hybrid-decoder configuration read from a Hugging Face ``config.json``.

Accepted ``model_type``s:

* ``qwen3_5_text`` -- the text model (``Qwen3_5ForCausalLM``); fields at the top level.
* ``qwen3_5`` -- the vision-language wrapper; the text model is read from ``text_config`` and the
  vision tower is ignored. ``tie_word_embeddings`` of the wrapper wins over the text config's.

Missing fields take the defaults of transformers 5.24 ``Qwen3_5TextConfig`` (as HF does), with two
derivations mirrored exactly:

* ``layer_types``: given explicitly, or built from ``full_attention_interval`` (default 4):
  layer ``i`` is ``full_attention`` iff ``(i + 1) % interval == 0``.
* RoPE: ``rope_parameters`` (or the legacy ``rope_scaling``) carries ``rope_theta`` (10000),
  ``partial_rotary_factor`` (0.25), ``mrope_section`` (HF default ``[11, 11, 10]``) and
  ``mrope_interleaved``; ``rotary_dim = int(head_dim * partial_rotary_factor)`` and the MRoPE
  sections must sum to ``rotary_dim / 2``.

A malformed file (bad JSON, wrong field types, impossible head arithmetic) raises
``CheckpointError`` naming the field; a well-formed config this build does not serve (other model
types, mixture-of-experts variants, non-default RoPE, chunked MRoPE, a missing ``mrope_section``
whose default does not fit) raises ``UnsupportedConfiguration`` with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedhybrid.errors import UnsupportedConfiguration
from pagedhybrid.models.qwen35.errors import CheckpointError

if TYPE_CHECKING:
    from pagedhybrid.parallel.linear import ParallelConfig

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
TEXT_MODEL_TYPE = "qwen3_5_text"
VL_MODEL_TYPE = "qwen3_5"
MOE_TEXT_MODEL_TYPE = "qwen3_5_moe_text"
MOE_VL_MODEL_TYPE = "qwen3_5_moe"
TEXT_TYPES = {VL_MODEL_TYPE: TEXT_MODEL_TYPE, MOE_VL_MODEL_TYPE: MOE_TEXT_MODEL_TYPE}
DEFAULT_MROPE_SECTION = (11, 11, 10)  # HF Qwen3_5TextRotaryEmbedding default

# The text_config of a Qwen3.5-27B-class checkpoint (64 layers: 16 full + 48 linear), for
# structural exports and tests; no weights are implied.
QWEN35_27B_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 64, "full_attention_interval": 4,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "eos_token_id": 248044,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
}

# transformers 5.24 Qwen3_5TextConfig defaults, used for fields a config.json leaves out.
_INT_DEFAULTS: dict[str, int] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# transformers 5.24 Qwen3_5MoeTextConfig defaults (35B-A3B's sizes) where they differ
_MOE_DEFAULTS: dict[str, int] = {
    "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "shared_expert_intermediate_size")
# MoE fields of other families that would change the math; transformers 5.24 Qwen3.5-MoE has
# none of them (every layer sparse, top-k weights renormalised): refused unless at that value
_MOE_FIXED = {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}


@dataclass(frozen=True)
class Qwen35Config:
    """The text decoder of a Qwen3.5-style hybrid model (full attention + Gated DeltaNet)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int  # H
    num_key_value_heads: int  # Hkv
    head_dim: int  # hd
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int  # K
    linear_key_head_dim: int  # Dk
    linear_value_head_dim: int  # Dv
    linear_num_key_heads: int  # Hk
    linear_num_value_heads: int  # Hv
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION
    mrope_interleaved: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "silu"
    source_model_type: str = TEXT_MODEL_TYPE
    checkpoint_dtype: str | None = None  # "dtype"/"torch_dtype" recorded in config.json
    mtp_num_hidden_layers: int = 0  # the checkpoint's multi-token-prediction layers (``mtp.*``)
    # mixture of experts (``qwen3_5_moe_text``; 0 = a dense MLP of ``intermediate_size``)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        _check_consistency(self, "<Qwen35Config>")

    # -- derived dims ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:  # Hk * Dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # Hv * Dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # 2 * Hk * Dk + Hv * Dv
        return 2 * self.key_dim + self.value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def rank_local(self, parallel: ParallelConfig) -> Qwen35Config:
        """The config of one tensor-parallel rank: its query / value heads and MLP (or each
        expert's) channels (``/ W``) and the KV / linear key heads they read (``/ W``, or 1
        replicated when ``W`` is a multiple of them). Pages, state slots and kernels of the
        rank are sized by it; a ``W`` that does not split a count raises
        ``UnsupportedConfiguration`` naming it."""
        if parallel.tp_world_size == 1:
            return self
        return dataclasses.replace(
            self,
            num_attention_heads=parallel.local(self.num_attention_heads, "num_attention_heads"),
            num_key_value_heads=parallel.local(self.num_key_value_heads, "num_key_value_heads",
                                               shared=True),
            linear_num_value_heads=parallel.local(self.linear_num_value_heads,
                                                  "linear_num_value_heads"),
            linear_num_key_heads=parallel.local(self.linear_num_key_heads,
                                                "linear_num_key_heads", shared=True),
            intermediate_size=parallel.local(self.intermediate_size, "intermediate_size"),
            **({"moe_intermediate_size": parallel.local(self.moe_intermediate_size,
                                                         "moe_intermediate_size"),
                "shared_expert_intermediate_size": parallel.local(
                    self.shared_expert_intermediate_size, "shared_expert_intermediate_size")}
               if self.is_moe else {}),
        )

    # -- reading ----------------------------------------------------------------------------------
    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Qwen35Config:
        return cls.from_file(Path(model_dir) / "config.json")

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen35Config:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(str(path), "config.json", "does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(str(path), "config.json", "is not valid JSON", exc) from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Qwen35Config:
        """Parse an HF config dict (``qwen3_5_text`` or ``qwen3_5``)."""
        if not isinstance(data, dict):
            raise CheckpointError(source, "config", "must be a JSON object", type(data).__name__)
        model_type = data.get("model_type")
        if model_type in TEXT_TYPES:
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise CheckpointError(source, "text_config",
                                      f"must be an object in a {model_type} config", text)
            inner = text.get("model_type", TEXT_TYPES[model_type])
            if inner != TEXT_TYPES[model_type]:
                _reject_model_type(inner, source, "text_config.model_type")
            merged = dict(text)
            for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
                if key in data and (key == "tie_word_embeddings" or key not in text):
                    merged[key] = data[key]
            return _parse_text(merged, source, model_type)
        if model_type not in (TEXT_MODEL_TYPE, MOE_TEXT_MODEL_TYPE):
            _reject_model_type(model_type, source, "model_type")
        return _parse_text(data, source, model_type)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``qwen3_5_text`` config.json content HF transformers 5.24 reads back."""
        eos: int | list[int] | None = (
            None if not self.eos_token_id
            else self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        )
        mlp: dict[str, Any] = {"intermediate_size": self.intermediate_size}
        if self.is_moe:
            mlp = {key: getattr(self, key) for key in _MOE_KEYS}
        return {
            "architectures": ["Qwen3_5MoeForCausalLM" if self.is_moe
                              else "Qwen3_5ForCausalLM"],
            "model_type": MOE_TEXT_MODEL_TYPE if self.is_moe else TEXT_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            **mlp,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "layer_types": list(self.layer_types),
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "dtype": self.checkpoint_dtype,
            **({"mtp_num_hidden_layers": self.mtp_num_hidden_layers}
               if self.mtp_num_hidden_layers else {}),
        }


# -- parsing helpers -----------------------------------------------------------------------------
def _reject_model_type(model_type: object, source: str, where: str) -> None:
    if model_type is None:
        raise CheckpointError(source, where, "is missing")
    raise UnsupportedConfiguration(
        f"{source}: {where}={model_type!r} is not a Qwen3.5 hybrid decoder; supported model "
        f"types: {TEXT_MODEL_TYPE!r}, {VL_MODEL_TYPE!r}, {MOE_TEXT_MODEL_TYPE!r}, "
        f"{MOE_VL_MODEL_TYPE!r}"
    )


def _int(d: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = d.get(key, default if default is not None else _INT_DEFAULTS.get(key))
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(source, key, "must be an integer", value)
    if value <= 0:
        raise CheckpointError(source, key, "must be positive", value)
    return value


def _count(d: dict[str, Any], key: str, source: str) -> int:
    """An optional count (0 when absent or null)."""
    value = d.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(source, key, "must be an integer >= 0", value)
    return value


def _float(d: dict[str, Any], key: str, source: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(source, key, "must be a finite number", value)
    return float(value)


def _bool(d: dict[str, Any], key: str, source: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(source, key, "must be true or false", value)
    return value


def _optional_token(d: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(source, key, "must be a token id or a list of token ids", value)
    return tuple(values)


def _layer_types(d: dict[str, Any], n_layers: int, source: str) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is None:
        interval = _int(d, "full_attention_interval", source, default=4)
        return tuple(
            LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)
        )
    if not isinstance(types, list) or len(types) != n_layers:
        raise CheckpointError(source, "layer_types",
                              f"must be a list of num_hidden_layers={n_layers} entries", types)
    for i, t in enumerate(types):
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
            if isinstance(t, str):
                raise UnsupportedConfiguration(
                    f"{source}: layer_types[{i}]={t!r}; only {FULL_ATTENTION!r} and "
                    f"{LINEAR_ATTENTION!r} layers are served"
                )
            raise CheckpointError(source, f"layer_types[{i}]", "must be a string", t)
    return tuple(types)


def _rope(d: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    rope = d.get("rope_parameters")
    if rope is None:
        rope = d.get("rope_scaling")
    if rope is None:
        rope = {}
    if not isinstance(rope, dict):
        raise CheckpointError(source, "rope_parameters", "must be an object", rope)
    merged = {k: d[k] for k in ("rope_theta", "partial_rotary_factor") if k in d} | rope
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise UnsupportedConfiguration(
            f"{source}: rope_parameters.rope_type={rope_type!r}; only the default (unscaled) "
            "interleaved MRoPE of Qwen3.5 is served"
        )
    theta = _float(merged, "rope_theta", source, 10000.0)
    factor = _float(merged, "partial_rotary_factor", source, 0.25)
    if not 0.0 < factor <= 1.0:
        raise CheckpointError(source, "partial_rotary_factor", "must be in (0, 1]", factor)
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(source, "partial_rotary_factor",
                              f"gives rotary_dim={rotary_dim} for head_dim={head_dim}; "
                              "it must be even and >= 2", factor)
    interleaved = _bool(merged, "mrope_interleaved", source, True)
    if not interleaved:
        raise UnsupportedConfiguration(
            f"{source}: mrope_interleaved=false (chunked MRoPE); Qwen3.5 uses the interleaved "
            "layout and only that one is served"
        )
    section = merged.get("mrope_section")
    if section is None:
        if sum(DEFAULT_MROPE_SECTION) != rotary_dim // 2:
            raise UnsupportedConfiguration(
                f"{source}: rope_parameters has no mrope_section and HF's default "
                f"{list(DEFAULT_MROPE_SECTION)} does not fit rotary_dim/2={rotary_dim // 2}; add "
                "an explicit mrope_section (three integers summing to rotary_dim/2)"
            )
        section = list(DEFAULT_MROPE_SECTION)
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in section)):
        raise CheckpointError(source, "mrope_section", "must be a list of three integers", section)
    if sum(section) != rotary_dim // 2:
        raise CheckpointError(source, "mrope_section",
                              f"must sum to rotary_dim/2={rotary_dim // 2}", section)
    return {"rope_theta": theta, "partial_rotary_factor": factor,
            "mrope_section": tuple(section), "mrope_interleaved": interleaved}


def _moe(d: dict[str, Any], source: str, moe: bool) -> dict[str, int]:
    """The MoE fields of a ``qwen3_5_moe_text`` config (checked); none of a dense one."""
    if not moe:
        for key in _MOE_KEYS:
            if d.get(key):
                raise CheckpointError(source, key, "is a mixture-of-experts field; a dense "
                                      f"{TEXT_MODEL_TYPE!r} config has none (model_type "
                                      f"{MOE_TEXT_MODEL_TYPE!r} is the MoE one)", d[key])
        return {}
    for key, value in _MOE_FIXED.items():
        if key in d and d[key] != value:
            raise UnsupportedConfiguration(f"{source}: '{key}'={d[key]!r} is not a Qwen3.5-MoE "
                                           f"field (transformers 5.24: every layer sparse, "
                                           f"top-k weights renormalised); only {value!r} is "
                                           "served")
    out = {key: _int(d, key, source, _MOE_DEFAULTS[key]) for key in _MOE_KEYS}
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise CheckpointError(source, "num_experts_per_tok",
                              f"must be <= num_experts={out['num_experts']}",
                              out["num_experts_per_tok"])
    return out


def _parse_text(d: dict[str, Any], source: str, source_model_type: str) -> Qwen35Config:
    moe = source_model_type in (MOE_TEXT_MODEL_TYPE, MOE_VL_MODEL_TYPE)
    experts = _moe(d, source, moe)
    if moe:  # transformers' MoE defaults for what the file leaves out
        d = {**{k: v for k, v in _MOE_DEFAULTS.items() if k not in _MOE_KEYS}, **d}
        d.setdefault("intermediate_size", experts["moe_intermediate_size"])  # (unused)
    if d.get("attention_bias", False) is not False:
        raise UnsupportedConfiguration(f"{source}: attention_bias=true is not served "
                                       "(Qwen3.5 checkpoints have no attention biases)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfiguration(f"{source}: hidden_act={act!r}; only 'silu' is served")
    if d.get("attn_output_gate", True) is not True:
        raise UnsupportedConfiguration(f"{source}: attn_output_gate=false is not served")
    ints = {key: _int(d, key, source) for key in _INT_DEFAULTS}
    head_dim = ints["head_dim"]
    dtype = d.get("dtype", d.get("torch_dtype"))
    cfg = Qwen35Config(
        **ints,
        layer_types=_layer_types(d, ints["num_hidden_layers"], source),
        **_rope(d, head_dim, source),
        rms_norm_eps=_float(d, "rms_norm_eps", source, 1e-6),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", source, False),
        bos_token_id=(_optional_token(d, "bos_token_id", source) or (None,))[0],
        eos_token_id=_optional_token(d, "eos_token_id", source),
        hidden_act="silu",
        source_model_type=source_model_type,
        checkpoint_dtype=dtype if isinstance(dtype, str) else None,
        mtp_num_hidden_layers=_count(d, "mtp_num_hidden_layers", source),
        **experts,
    )
    _check_consistency(cfg, source)
    return cfg


def _check_consistency(cfg: Qwen35Config, source: str) -> None:
    if cfg.is_moe and not (0 < cfg.num_experts_per_tok <= cfg.num_experts
                           and cfg.moe_intermediate_size > 0
                           and cfg.shared_expert_intermediate_size > 0):
        raise CheckpointError(source, "num_experts_per_tok",
                              f"must be in [1, num_experts={cfg.num_experts}] with positive "
                              "expert sizes", cfg.num_experts_per_tok)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(source, "num_key_value_heads",
                              f"must divide num_attention_heads={cfg.num_attention_heads}",
                              cfg.num_key_value_heads)
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise CheckpointError(source, "linear_num_key_heads",
                              f"must divide linear_num_value_heads={cfg.linear_num_value_heads}",
                              cfg.linear_num_key_heads)
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise CheckpointError(source, "layer_types",
                              f"must have num_hidden_layers={cfg.num_hidden_layers} entries",
                              len(cfg.layer_types))
    if sum(cfg.mrope_section) != cfg.rotary_dim // 2:
        raise CheckpointError(source, "mrope_section",
                              f"must sum to rotary_dim/2={cfg.rotary_dim // 2}",
                              list(cfg.mrope_section))
