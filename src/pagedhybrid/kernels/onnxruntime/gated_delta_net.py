"""ONNX Runtime's CPU ``com.microsoft.GatedDeltaNet`` kernel (1.32), one node per call.

The external oracle for ``pagedhybrid.ops.gated_delta_net``: same signature, same outputs
(``output``, ``final_state``). Inputs go to ORT unvalidated, so ORT's own checks answer for
malformed calls; only the attributes are resolved (defaults filled, kinds coerced) by the SPEC.
The state is not aliased here; a test binds ``initial_state`` as ``final_state`` through
``run_single_node(..., inplace={6: 1})``.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.onnxruntime.session import run_single_node
from pagedhybrid.ops.gated_delta_net import SPEC

EP = "cpu"
DTYPES = (torch.float32, torch.float16)  # bfloat16 is registered too; not exercised here


def gated_delta_net(query: torch.Tensor, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                    decay: torch.Tensor | None = None, beta: torch.Tensor | None = None,
                    initial_state: torch.Tensor | None = None, a_log: torch.Tensor | None = None,
                    dt_bias: torch.Tensor | None = None,
                    capture_count: torch.Tensor | None = None,
                    state_update_active: torch.Tensor | None = None, *,
                    update_rule: str = "gated_delta", gate_activation: str = "none",
                    beta_activation: str = "none", qk_l2_norm: int = 0, scale: float = 0.0,
                    gate_lower_bound: float = -5.0, chunk_size: int = 64,
                    state_update_capacity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ORT's kernel: returns ``(output, final_state)``."""
    attrs = SPEC.resolve_attributes({
        "update_rule": update_rule, "gate_activation": gate_activation,
        "beta_activation": beta_activation, "qk_l2_norm": qk_l2_norm, "scale": scale,
        "gate_lower_bound": gate_lower_bound, "chunk_size": chunk_size,
        "state_update_capacity": state_update_capacity})
    inputs = [query, key, value, cu_seqlens, decay, beta, initial_state, a_log, dt_bias,
              capture_count, state_update_active]
    output, final_state = run_single_node(SPEC, inputs, attrs, n_outputs=2, ep=EP)
    return output, final_state
