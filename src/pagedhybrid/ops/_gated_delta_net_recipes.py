"""Conformance recipes of ``com.microsoft.GatedDeltaNet`` and their deterministic inputs.

A recipe is JSON: ``{"name", "dims", "attrs"}``; ``make_inputs(recipe, dtype, seed)`` returns the
full positional input list of the op (None for absent ports) and the attribute dict. Capturing
recipes (compact state updates) add ``dims["capture"]`` (``capture_count``) and optionally
``dims["active"]`` (``state_update_active``).
"""

from __future__ import annotations

from typing import Any

import torch

_GATED = ("gated", "gated_delta")  # update rules that take a decay
_DELTA = ("delta", "gated_delta")  # update rules that take a beta


def conformance_recipes() -> list[dict[str, Any]]:
    """Deterministic JSON-able cases covering layouts, packing, rules, gates, head ratios and
    compact state updates."""

    def r(name: str, seq_lens: list[int], hk: int, hv: int, dk: int, dv: int, *,
          layout: str = "separate", cu: bool = True, decay: str = "head", dt_bias: str = "head",
          state: str = "random", gate_dtype: str = "input", capture: list[int] | None = None,
          active: int | None = None, **attrs: Any) -> dict[str, Any]:
        dims = {"seq_lens": seq_lens, "num_heads_k": hk, "num_heads_v": hv, "head_size_qk": dk,
                "head_size_v": dv, "layout": layout, "cu_seqlens": cu, "decay": decay,
                "dt_bias": dt_bias, "initial_state": state, "gate_dtype": gate_dtype}
        if capture is not None:
            dims["capture"] = capture
        if active is not None:
            dims["active"] = active
        return {"name": name, "dims": dims, "attrs": attrs}

    qwen = {"gate_activation": "qwen", "beta_activation": "sigmoid"}  # the model's form

    return [
        r("prefill_unequal_gqa2", [5, 17, 1, 9], 2, 4, 8, 6),
        r("decode_batch_ratio1", [1, 1, 1, 1, 1, 1], 2, 2, 8, 8),
        r("chunk_boundaries_63_64_65", [63, 64, 65], 1, 2, 8, 4),
        r("gqa_ratio4", [7, 3], 1, 4, 4, 4),
        r("rule_linear", [4, 6], 2, 2, 4, 4, update_rule="linear"),
        r("rule_gated", [6, 3], 1, 2, 4, 6, update_rule="gated"),
        r("rule_delta", [5, 5], 2, 4, 4, 4, update_rule="delta"),
        r("gated_per_key_decay", [4, 7], 1, 2, 8, 4, decay="key", update_rule="gated"),
        r("softplus_per_key_decay_dt_key", [6, 2], 2, 4, 4, 4, decay="key", dt_bias="key",
          gate_activation="softplus", beta_activation="sigmoid"),
        r("gate_softplus_beta_sigmoid", [8, 1, 3], 2, 4, 8, 8, gate_activation="softplus",
          beta_activation="sigmoid"),
        r("gate_kda_flat_dt_bias", [5, 6], 1, 2, 4, 4, decay="key", dt_bias="flat",
          gate_activation="kda", gate_lower_bound=-3.0, qk_l2_norm=1),
        r("gate_sigmoid_per_head", [3, 9], 2, 2, 8, 4, gate_activation="sigmoid",
          beta_activation="sigmoid"),
        r("qwen_config", [7, 1, 12], 2, 4, 16, 16, gate_dtype="float", gate_activation="qwen",
          beta_activation="sigmoid", qk_l2_norm=1),
        r("packed_qkv_varlen", [3, 8, 1], 2, 4, 8, 8, layout="packed", qk_l2_norm=1,
          gate_activation="qwen", beta_activation="sigmoid"),
        r("packed_qkv_uniform_rank3", [4, 4, 4], 1, 2, 8, 4, layout="packed_rank3", cu=False),
        r("rank4_uniform_no_state", [5, 5], 2, 4, 4, 8, layout="rank4", cu=False,
          state="none"),
        r("uniform_rank3_no_cu", [3, 3, 3, 3], 1, 1, 8, 8, cu=False),
        r("no_initial_state", [4, 9], 2, 4, 8, 8, state="none"),
        r("explicit_scale", [6, 2], 1, 2, 4, 4, scale=0.5),
        r("zero_length_sequences", [3, 0, 4, 0], 1, 2, 4, 4),
        # compact state updates: a verify step of drafts (GQA, the model's form: its decode
        # shape runs natively), per-key decay, counts clamped to the capacity and to the
        # sequence (9 -> 3, -1 -> 0, 5 -> 0 for an empty one) with the rules without decay /
        # retrieval, capture switched off, a step capturing nothing
        r("capture_verify_step_gqa", [4, 1, 3, 2], 2, 4, 8, 8, gate_dtype="float",
          capture=[4, 1, 3, 2], state_update_capacity=4, **qwen),
        r("capture_per_key_decay_kda", [5, 3], 1, 2, 4, 4, decay="key", dt_bias="flat",
          capture=[5, 2], state_update_capacity=6, gate_activation="kda", qk_l2_norm=1),
        r("capture_clamped_rule_delta_packed", [5, 2, 3], 1, 2, 4, 4, layout="packed",
          capture=[9, -1, 2], state_update_capacity=3, update_rule="delta"),
        r("capture_clamped_rule_gated", [3, 0, 4], 1, 2, 4, 6, capture=[2, 5, 9],
          state_update_capacity=3, update_rule="gated"),
        r("capture_inactive", [3, 2], 2, 4, 4, 4, capture=[2, 2], active=0,
          state_update_capacity=2, qk_l2_norm=1, **qwen),
        r("capture_none_capacity8", [3, 2], 1, 2, 4, 4, capture=[0, 0],
          state_update_capacity=8),
    ]


def make_inputs(recipe: dict[str, Any], dtype: torch.dtype, seed: int
                ) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Random inputs for a recipe: the 11 positional inputs (None when absent) and attributes.

    Keys are unit-normalised when the op does not normalise them (the delta rules need it) and
    values are scaled by 0.5, so fp16 outputs stay small.
    """
    d, attrs = recipe["dims"], dict(recipe["attrs"])
    gen = torch.Generator().manual_seed(seed)
    lens = d["seq_lens"]
    t, b = sum(lens), len(lens)
    hk, hv, dk, dv = d["num_heads_k"], d["num_heads_v"], d["head_size_qk"], d["head_size_v"]
    rule = attrs.get("update_rule", "gated_delta")
    fused = attrs.get("gate_activation", "none") != "none"
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gate_dtype = dtype if d["gate_dtype"] == "input" else state_dtype

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(t, hk, dk), randn(t, hk, dk)  # [T, Hk, Dk]
    if not attrs.get("qk_l2_norm", 0):
        k = k / k.norm(dim=-1, keepdim=True)
    v = randn(t, hv, dv) * 0.5  # [T, Hv, Dv]
    gshape = (t, hv, dk) if d["decay"] == "key" else (t, hv)
    decay = beta = a_log = dt_bias = None
    if rule in _GATED:
        decay = randn(*gshape) if fused else -(0.02 + 0.3 * rand(*gshape))
    if rule in _DELTA:
        raw = attrs.get("beta_activation", "none") == "sigmoid"
        beta = randn(t, hv) if raw else 0.1 + 0.8 * rand(t, hv)
    if fused:
        a_log = (randn(hv) * 0.5).to(state_dtype)
        dt_shape = {"head": (hv,), "key": (hv, dk), "flat": (hv * dk,)}[d["dt_bias"]]
        dt_bias = (randn(*dt_shape) * 0.5).to(state_dtype)
    state = None
    if d["initial_state"] == "random":
        state = (randn(b, hv, dv, dk) * 0.5).to(state_dtype)  # [B, Hv, Dv, Dk]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    decay = None if decay is None else decay.to(gate_dtype)
    beta = None if beta is None else beta.to(gate_dtype)
    layout = d["layout"]
    if layout in ("rank4", "packed_rank3"):
        s = t // b

        def bs(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.reshape(b, s, *x.shape[1:])

        q, k, v, decay, beta = bs(q), bs(k), bs(v), bs(decay), bs(beta)
    if layout.startswith("packed"):
        q = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)  # [..., W]
        k = v = None
    cu = None
    if d["cu_seqlens"]:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    capture = torch.tensor(d["capture"], dtype=torch.int32) if "capture" in d else None  # [B]
    active = torch.tensor([d["active"]], dtype=torch.int32) if "active" in d else None  # [1]
    return [q, k, v, cu, decay, beta, state, a_log, dt_bias, capture, active], attrs
