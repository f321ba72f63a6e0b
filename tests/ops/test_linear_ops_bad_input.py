"""Malformed calls to GatedDeltaNet and VarlenCausalConvWithState raise typed errors.

Each case starts from a valid call, breaks one thing, and asserts the exception type and the
port/attribute it names (``exc.where``) -- never an IndexError, a hang or a silent answer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedhybrid.errors import ContractViolation, UnsupportedConfiguration

gdn_mod = importlib.import_module("pagedhybrid.ops.gated_delta_net")
conv_mod = importlib.import_module("pagedhybrid.ops.varlen_causal_conv")

Call = tuple[list[Any], dict[str, Any]]


def conv_call() -> Call:
    """T=7 tokens in sequences [3, 4], C=4, K=4, silu."""
    recipe = {"name": "base", "dims": {"seq_lens": [3, 4], "channels": 4, "kernel_size": 4,
                                       "bias": True, "state": "random"},
              "attrs": {"activation": "silu"}}
    return conv_mod.make_inputs(recipe, torch.float32, 0)


def gdn_call(layout: str = "separate", decay: str = "head", gate: str = "none") -> Call:
    """T=8 tokens in sequences [3, 5], Hk=2, Hv=4, Dk=4, Dv=3, gated_delta."""
    attrs: dict[str, Any] = {"update_rule": "gated_delta"}
    if gate != "none":
        attrs |= {"gate_activation": gate, "beta_activation": "sigmoid"}
    recipe = {"name": "base", "attrs": attrs, "dims": {
        "seq_lens": [3, 5], "num_heads_k": 2, "num_heads_v": 4, "head_size_qk": 4,
        "head_size_v": 3, "layout": layout, "cu_seqlens": True, "decay": decay,
        "dt_bias": "head", "initial_state": "random", "gate_dtype": "input"}}
    return gdn_mod.make_inputs(recipe, torch.float32, 0)


def edit(call: Call, index: int | None = None, value: Any = None, **attrs: Any) -> Call:
    ins, a = call
    ins = list(ins)
    if index is not None:
        ins[index] = value
    return ins, {**a, **attrs}


def i32(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32)


C_IN, C_W, C_CU, C_BIAS, C_STATE, C_CAPTURE, C_DELTA = 0, 1, 2, 3, 4, 5, 6
Q, K, V, CU, DECAY, BETA, STATE, ALOG, DT, CAPTURE, ACTIVE = range(11)

# (id, make the call, expected exception, expected where)
CONV_CASES: list[tuple[str, Callable[[], Call], type[Exception], str]] = [
    ("input_rank3", lambda: edit(conv_call(), C_IN, torch.zeros(1, 7, 4)),
     ContractViolation, "input"),
    ("input_int_dtype", lambda: edit(conv_call(), C_IN, torch.zeros(7, 4, dtype=torch.int32)),
     ContractViolation, "input"),
    ("weight_not_depthwise", lambda: edit(conv_call(), C_W, torch.zeros(4, 2, 4)),
     ContractViolation, "weight"),
    ("weight_channel_mismatch", lambda: edit(conv_call(), C_W, torch.zeros(5, 1, 4)),
     ContractViolation, "weight"),
    ("weight_rank2", lambda: edit(conv_call(), C_W, torch.zeros(4, 4)),
     ContractViolation, "weight"),
    ("weight_dtype_mismatch", lambda: edit(conv_call(), C_W, torch.zeros(4, 1, 4).half()),
     ContractViolation, "weight"),
    ("bias_shape", lambda: edit(conv_call(), C_BIAS, torch.zeros(3)), ContractViolation, "bias"),
    ("state_batch_mismatch", lambda: edit(conv_call(), C_STATE, torch.zeros(3, 4, 3)),
     ContractViolation, "initial_state"),
    ("state_channels_last", lambda: edit(conv_call(), C_STATE, torch.zeros(2, 3, 4)),
     ContractViolation, "initial_state"),
    ("state_length_k_not_k_minus_1", lambda: edit(conv_call(), C_STATE, torch.zeros(2, 4, 4)),
     ContractViolation, "initial_state"),
    ("state_dtype_mismatch", lambda: edit(conv_call(), C_STATE, torch.zeros(2, 4, 3).half()),
     ContractViolation, "initial_state"),
    ("cu_non_monotonic", lambda: edit(conv_call(), C_CU, i32(0, 5, 3, 7)),
     ContractViolation, "cumulative_sequence_length"),
    ("cu_not_ending_at_T", lambda: edit(conv_call(), C_CU, i32(0, 3, 6)),
     ContractViolation, "cumulative_sequence_length"),
    ("cu_not_starting_at_0", lambda: edit(conv_call(), C_CU, i32(1, 3, 7)),
     ContractViolation, "cumulative_sequence_length"),
    ("cu_zero_length_sequence", lambda: edit(conv_call(), C_CU, i32(0, 0, 7)),
     ContractViolation, "cumulative_sequence_length"),
    ("cu_int64", lambda: edit(conv_call(), C_CU, torch.tensor([0, 3, 7])),
     ContractViolation, "cumulative_sequence_length"),
    ("cu_rank2", lambda: edit(conv_call(), C_CU, i32(0, 3, 7)[None]),
     ContractViolation, "cumulative_sequence_length"),
    ("unknown_activation", lambda: edit(conv_call(), activation="relu"),
     ContractViolation, "activation"),
    ("dilation_zero", lambda: edit(conv_call(), dilation=0), ContractViolation, "dilation"),
    ("state_update_capacity_9", lambda: edit(conv_call(), state_update_capacity=9),
     ContractViolation, "state_update_capacity"),
    ("capture_count_without_capacity", lambda: edit(conv_call(), C_CAPTURE, i32(1, 1)),
     ContractViolation, "capture_count"),
    ("capacity_without_capture_count", lambda: edit(conv_call(), state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capture_count_wrong_shape",
     lambda: edit(edit(conv_call(), C_CAPTURE, i32(1, 1, 1)), state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capture_count_int64",
     lambda: edit(edit(conv_call(), C_CAPTURE, torch.ones(2, dtype=torch.int64)),
                  state_update_capacity=2), ContractViolation, "capture_count"),
    ("group_size_without_dynamic_mode", lambda: edit(conv_call(), group_size=2),
     ContractViolation, "group_size"),
    ("activation_not_a_string", lambda: edit(conv_call(), activation=1),
     ContractViolation, "activation"),
]

GDN_CASES: list[tuple[str, Callable[[], Call], type[Exception], str]] = [
    ("query_rank5", lambda: edit(gdn_call(), Q, torch.zeros(1, 1, 8, 2, 4)),
     ContractViolation, "query"),
    ("key_without_value", lambda: edit(gdn_call(), V, None), ContractViolation, "value"),
    ("value_without_key", lambda: edit(gdn_call(), K, None), ContractViolation, "key"),
    ("hq_ne_hk", lambda: edit(gdn_call(), K, torch.zeros(8, 1, 4)), ContractViolation, "key"),
    ("key_head_size", lambda: edit(gdn_call(), K, torch.zeros(8, 2, 5)), ContractViolation,
     "key"),
    ("hv_not_multiple_of_hk", lambda: edit(gdn_call(), V, torch.zeros(8, 3, 3)),
     ContractViolation, "value"),
    ("value_token_mismatch", lambda: edit(gdn_call(), V, torch.zeros(7, 4, 3)),
     ContractViolation, "value"),
    ("key_rank_differs", lambda: edit(gdn_call(), K, torch.zeros(1, 8, 2, 4)),
     ContractViolation, "key"),
    ("key_dtype_mismatch", lambda: edit(gdn_call(), K, torch.zeros(8, 2, 4).half()),
     ContractViolation, "key"),
    ("cu_non_monotonic", lambda: edit(gdn_call(), CU, i32(0, 5, 3, 8)),
     ContractViolation, "cu_seqlens"),
    ("cu_not_ending_at_T", lambda: edit(gdn_call(), CU, i32(0, 3, 7)),
     ContractViolation, "cu_seqlens"),
    ("cu_wrong_length_vs_state", lambda: edit(gdn_call(), CU, i32(0, 3, 5, 8)),
     ContractViolation, "initial_state"),
    ("cu_with_rank4", lambda: edit(edit(edit(edit(gdn_call(), Q, torch.zeros(2, 4, 2, 4)),
                                              K, torch.zeros(2, 4, 2, 4)),
                                         V, torch.zeros(2, 4, 4, 3)), DECAY,
                                    torch.zeros(2, 4, 4)),
     ContractViolation, "cu_seqlens"),
    ("no_cu_no_state", lambda: edit(edit(gdn_call(), CU, None), STATE, None),
     ContractViolation, "initial_state"),
    ("no_cu_state_batch_not_dividing_T", lambda: edit(edit(gdn_call(), CU, None), STATE,
                                                      torch.zeros(3, 4, 3, 4)),
     ContractViolation, "initial_state"),
    ("zero_tokens", lambda: edit(edit(edit(edit(edit(edit(gdn_call(), Q, torch.zeros(0, 2, 4)),
                                                     K, torch.zeros(0, 2, 4)),
                                                V, torch.zeros(0, 4, 3)), CU, i32(0, 0)),
                                      DECAY, torch.zeros(0, 4)), BETA, torch.zeros(0, 4)),
     ContractViolation, "query"),
    ("decay_shape", lambda: edit(gdn_call(), DECAY, torch.zeros(8, 5)), ContractViolation,
     "decay"),
    ("decay_per_key_wrong_dk", lambda: edit(gdn_call(), DECAY, torch.zeros(8, 4, 3)),
     ContractViolation, "decay"),
    ("decay_missing_for_gated_delta", lambda: edit(gdn_call(), DECAY, None),
     ContractViolation, "decay"),
    ("decay_present_for_delta", lambda: edit(gdn_call(), update_rule="delta"),
     ContractViolation, "decay"),
    ("decay_fp16_with_fp32_query", lambda: edit(edit(gdn_call(), DECAY, torch.zeros(8, 4).half()),
                                                BETA, torch.zeros(8, 4).half()),
     ContractViolation, "decay"),
    ("beta_shape", lambda: edit(gdn_call(), BETA, torch.zeros(8, 4, 1)), ContractViolation,
     "beta"),
    ("beta_missing_for_gated_delta", lambda: edit(gdn_call(), BETA, None), ContractViolation,
     "beta"),
    ("state_fp16", lambda: edit(gdn_call(), STATE, torch.zeros(2, 4, 3, 4).half()),
     ContractViolation, "initial_state"),
    ("state_k_major", lambda: edit(gdn_call(), STATE, torch.zeros(2, 4, 4, 3)),
     ContractViolation, "initial_state"),
    ("a_log_shape", lambda: edit(gdn_call(gate="softplus"), ALOG, torch.zeros(5)),
     ContractViolation, "a_log"),
    ("dt_bias_key_shape_with_head_decay", lambda: edit(gdn_call(gate="softplus"), DT,
                                                       torch.zeros(4, 4)),
     ContractViolation, "dt_bias"),
    ("dt_bias_wrong_length", lambda: edit(gdn_call(decay="key", gate="kda"), DT,
                                          torch.zeros(15)),
     ContractViolation, "dt_bias"),
    ("softplus_without_a_log", lambda: edit(gdn_call(gate="softplus"), ALOG, None),
     ContractViolation, "a_log"),
    ("dt_bias_without_fused_gate", lambda: edit(gdn_call(), DT, torch.zeros(4)),
     ContractViolation, "dt_bias"),
    ("unknown_update_rule", lambda: edit(gdn_call(), update_rule="mamba"), ContractViolation,
     "update_rule"),
    ("unknown_gate_activation", lambda: edit(gdn_call(), gate_activation="relu"),
     ContractViolation, "gate_activation"),
    ("unknown_beta_activation", lambda: edit(gdn_call(), beta_activation="tanh"),
     ContractViolation, "beta_activation"),
    ("qk_l2_norm_2", lambda: edit(gdn_call(), qk_l2_norm=2), ContractViolation, "qk_l2_norm"),
    ("gate_lower_bound_positive", lambda: edit(gdn_call(), gate_lower_bound=1.0),
     ContractViolation, "gate_lower_bound"),
    ("chunk_size_zero", lambda: edit(gdn_call(), chunk_size=0), ContractViolation,
     "chunk_size"),
    ("scale_string", lambda: edit(gdn_call(), scale="0.5"), ContractViolation, "scale"),
    ("packed_width_inconsistent", lambda: edit(gdn_call("packed"), Q, torch.zeros(8, 2 * 8 + 13)),
     ContractViolation, "query"),
    ("packed_without_state", lambda: edit(gdn_call("packed"), STATE, None), ContractViolation,
     "initial_state"),
    ("packed_rank4", lambda: edit(gdn_call("packed"), Q, torch.zeros(2, 4, 1, 28)),
     ContractViolation, "query"),
    ("state_update_capacity_9", lambda: edit(gdn_call(), CAPTURE, i32(1, 1),
                                             state_update_capacity=9),
     ContractViolation, "state_update_capacity"),
    ("capture_count_without_capacity", lambda: edit(gdn_call(), CAPTURE, i32(1, 1)),
     ContractViolation, "capture_count"),
    ("capacity_without_capture_count", lambda: edit(gdn_call(), state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capacity_without_capture_count_inactive",
     lambda: edit(gdn_call(), ACTIVE, i32(0), state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capture_count_wrong_shape", lambda: edit(gdn_call(), CAPTURE, i32(1, 1, 1),
                                               state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capture_count_rank2", lambda: edit(gdn_call(), CAPTURE, i32(1, 1)[None],
                                         state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("capture_count_int64", lambda: edit(gdn_call(), CAPTURE, torch.ones(2, dtype=torch.int64),
                                         state_update_capacity=2),
     ContractViolation, "capture_count"),
    ("state_update_active_wrong_shape",
     lambda: edit(edit(gdn_call(), CAPTURE, i32(1, 1), state_update_capacity=2), ACTIVE,
                  i32(1, 1)),
     ContractViolation, "state_update_active"),
    ("state_update_active_rank0_without_capture",
     lambda: edit(gdn_call(), ACTIVE, torch.tensor(1, dtype=torch.int32)),
     ContractViolation, "state_update_active"),
    ("state_update_active_int64",
     lambda: edit(edit(gdn_call(), CAPTURE, i32(1, 1), state_update_capacity=2), ACTIVE,
                  torch.ones(1, dtype=torch.int64)),
     ContractViolation, "state_update_active"),
]

UNSUPPORTED_CASES: list[tuple[str, Callable[[], Call], str]] = [
    ("conv_kernel_delta", lambda: edit(conv_call(), C_DELTA, torch.zeros(7, 2, 4)), "conv"),
]


def run(op: str, call: Call) -> Any:
    ins, attrs = call
    fn = conv_mod.varlen_causal_conv if op == "conv" else gdn_mod.gated_delta_net
    return fn(*ins, **attrs)


def test_bases_are_valid() -> None:
    run("conv", conv_call())
    for args in (("separate",), ("packed",), ("separate", "key", "kda"), ("separate", "head",
                                                                           "softplus")):
        run("gdn", gdn_call(*args))
    # capturing, switched on / off, and state_update_active without capture (ORT accepts it)
    for active in (None, i32(1), i32(0)):
        out = run("gdn", edit(edit(gdn_call(), CAPTURE, i32(9, -1), state_update_capacity=8),
                              ACTIVE, active))
        assert out[2].shape == (2, 8 * (4 + 2 * 4 + 4 * 3))
    assert len(run("gdn", edit(gdn_call(), ACTIVE, i32(0)))) == 2


@pytest.mark.parametrize(("make", "exc", "where"), [c[1:] for c in CONV_CASES],
                         ids=[c[0] for c in CONV_CASES])
def test_conv_bad_input(make: Callable[[], Call], exc: type[Exception], where: str) -> None:
    with pytest.raises(exc) as info:
        run("conv", make())
    assert type(info.value) is exc
    assert info.value.where == where, str(info.value)
    assert info.value.op == "com.microsoft.VarlenCausalConvWithState"


@pytest.mark.parametrize(("make", "exc", "where"), [c[1:] for c in GDN_CASES],
                         ids=[c[0] for c in GDN_CASES])
def test_gdn_bad_input(make: Callable[[], Call], exc: type[Exception], where: str) -> None:
    with pytest.raises(exc) as info:
        run("gdn", make())
    assert type(info.value) is exc
    assert info.value.where == where, str(info.value)
    assert info.value.op == "com.microsoft.GatedDeltaNet"


@pytest.mark.parametrize(("make", "op"), [c[1:] for c in UNSUPPORTED_CASES],
                         ids=[c[0] for c in UNSUPPORTED_CASES])
def test_unsupported_configurations(make: Callable[[], Call], op: str) -> None:
    with pytest.raises(UnsupportedConfiguration) as info:
        run(op, make())
    assert info.value.reason


def test_validate_rejects_unknown_attribute() -> None:
    ins, attrs = gdn_call()
    with pytest.raises(ContractViolation) as info:
        gdn_mod.validate(*ins, **attrs, num_heads=4)
    assert info.value.where == "num_heads"
