"""ONNX Runtime's CPU ``com.microsoft.VarlenCausalConvWithState`` kernel (1.32), one node per call.

The external oracle for ``pagedhybrid.ops.varlen_causal_conv``: same signature, same outputs
(``output``, ``final_state``, and ``state_update`` when capturing): the ``onnxruntime``
implementation registered with ``SPEC.implement``. Inputs go to ORT unvalidated; only the
arguments are bound and the attributes resolved by ``SPEC.bind``. ``initial_state=None`` is
passed to ORT as explicit zeros (ORT requires the input), and an absent ``bias`` occupies index 3
as an empty name.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.onnxruntime.session import run_single_node
from pagedhybrid.ops.spec import BoundCall
from pagedhybrid.ops.varlen_causal_conv import SPEC

EP = "cpu"
DTYPES = (torch.float32, torch.float16)  # bfloat16 is registered too; not exercised here


@SPEC.implement("onnxruntime")
def varlen_causal_conv(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Run ORT's kernel: returns ``(output, final_state)``, and ``state_update`` when
    ``state_update_capacity > 0``."""
    input, weight, cu, _bias, initial_state = call.inputs[:5]
    if initial_state is None:
        batch = cu.numel() - 1
        state_len = (weight.shape[-1] - 1) * call.attrs["dilation"]
        call = call.with_inputs(initial_state=torch.zeros(batch, input.shape[-1], state_len,
                                                          dtype=input.dtype))
    n = 3 if call.attrs["state_update_capacity"] > 0 else 2
    return tuple(run_single_node(SPEC, call.inputs, call.attrs, n_outputs=n, ep=EP))
