"""WebGPU (WGSL) kernel packages and their Python loader (wgpu-py; lavapipe on CPU-only CI).

``get_kernel("com.microsoft.PagedAttention", version=1)`` loads the package under
``kernels/webgpu/<op id>/build/webgpu`` and returns a callable kernel; ``paged_attention`` is the
same kernel behind the torch signature of ``pagedhybrid.ops.paged_attention`` (a dispatch
backend); ``backend_capability()`` says what it serves.
"""

from __future__ import annotations

from pagedhybrid.kernels.webgpu.backend import backend_capability, paged_attention
from pagedhybrid.kernels.webgpu.loader import WebGpuKernel, get_kernel
from pagedhybrid.kernels.webgpu.runner import GpuTensor

__all__ = ["GpuTensor", "WebGpuKernel", "backend_capability", "get_kernel", "paged_attention"]
