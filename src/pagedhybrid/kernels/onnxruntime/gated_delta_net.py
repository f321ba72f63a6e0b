"""ONNX Runtime's CPU ``com.microsoft.GatedDeltaNet`` kernel (1.32), one node per call.

The external oracle for ``pagedhybrid.ops.gated_delta_net``: same signature, same outputs
(``output``, ``final_state``, and ``state_update`` when capturing): the ``onnxruntime``
implementation registered with ``SPEC.implement``. Inputs go to ORT unvalidated, so ORT's own
checks answer for malformed calls; only the arguments are bound and the attributes resolved
(defaults filled, kinds coerced) by ``SPEC.bind``.
The state is not aliased here; a test binds ``initial_state`` as ``final_state`` through
``run_single_node(..., inplace={6: 1})``.
"""

from __future__ import annotations

import torch

from pagedhybrid.kernels.onnxruntime.session import run_single_node
from pagedhybrid.ops.gated_delta_net import SPEC
from pagedhybrid.ops.spec import BoundCall

EP = "cpu"
DTYPES = (torch.float32, torch.float16)  # bfloat16 is registered too; not exercised here


@SPEC.implement("onnxruntime")
def gated_delta_net(call: BoundCall) -> tuple[torch.Tensor, ...]:
    """Run ORT's kernel: returns ``(output, final_state)``, and ``state_update`` when
    ``state_update_capacity > 0``."""
    n = 3 if call.attrs["state_update_capacity"] > 0 else 2
    return tuple(run_single_node(SPEC, call.inputs, call.attrs, n_outputs=n, ep=EP))
