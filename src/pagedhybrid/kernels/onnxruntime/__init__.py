"""ONNX Runtime's own kernels, run one node at a time: the external oracle for the references."""

from pagedhybrid.kernels.onnxruntime.session import (
    run_single_node,
    single_node_model,
    webgpu_ep_device,
)

__all__ = ["run_single_node", "single_node_model", "webgpu_ep_device"]
