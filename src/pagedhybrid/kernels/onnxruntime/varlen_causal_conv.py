"""ONNX Runtime's CPU ``com.microsoft.VarlenCausalConvWithState`` kernel (1.32), one node per call.

The external oracle for ``pagedhybrid.ops.varlen_causal_conv``: same signature, same outputs
(``output``, ``final_state``). Inputs go to ORT unvalidated; only the attributes are resolved by
the SPEC. ``initial_state=None`` is passed to ORT as explicit zeros (ORT requires the input), and
an absent ``bias`` occupies index 3 as an empty name.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.onnxruntime.session import run_single_node
from pagedhybrid.ops.varlen_causal_conv import SPEC

EP = "cpu"
DTYPES = (torch.float32, torch.float16)  # bfloat16 is registered too; not exercised here


def varlen_causal_conv(input: torch.Tensor, weight: torch.Tensor,
                       cumulative_sequence_length: torch.Tensor, bias: torch.Tensor | None = None,
                       initial_state: torch.Tensor | None = None,
                       capture_count: torch.Tensor | None = None,
                       kernel_delta: torch.Tensor | None = None,
                       previous_mask: torch.Tensor | None = None, *, activation: str = "none",
                       dilation: int = 1, state_update_capacity: int = 0, group_size: int = 1,
                       delta_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ORT's kernel: returns ``(output, final_state)``."""
    attrs = SPEC.resolve_attributes({
        "activation": activation, "dilation": dilation,
        "state_update_capacity": state_update_capacity, "group_size": group_size,
        "delta_offset": delta_offset})
    if initial_state is None:
        batch = cumulative_sequence_length.numel() - 1
        state_len = (weight.shape[-1] - 1) * attrs["dilation"]
        initial_state = torch.zeros(batch, input.shape[-1], state_len, dtype=input.dtype)
    inputs = [input, weight, cumulative_sequence_length, bias, initial_state, capture_count,
              kernel_delta, previous_mask]
    output, final_state = run_single_node(SPEC, inputs, attrs, n_outputs=2, ep=EP)
    return output, final_state
