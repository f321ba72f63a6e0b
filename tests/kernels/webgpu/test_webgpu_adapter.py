"""The CI adapter: Vulkan lavapipe (or any Vulkan adapter) with shader-f16.

``make test`` installs Mesa's Vulkan driver, so a missing Vulkan adapter or a missing
``shader-f16`` is a broken environment: these assertions FAIL (never skip), otherwise a CI run
that lost the apt step would silently fall back to OpenGL and lose the f16 coverage.
"""

from __future__ import annotations

from pagedhybrid.kernels.webgpu.runner import gpu


def test_vulkan_adapter_with_shader_f16() -> None:
    ctx = gpu()  # raises UnsupportedConfiguration without shader-f16
    assert ctx.info["backend_type"] == "Vulkan", (
        f"expected a Vulkan adapter (Mesa lavapipe on CPU-only CI: `make system-deps`), got "
        f"{ctx.info}")
    assert "shader-f16" in ctx.adapter.features
    assert "shader-f16" in ctx.features
    assert "shader-f16" in ctx.device.features


def test_device_limits_cover_the_package_defaults() -> None:
    limits = gpu().limits
    assert limits["max-storage-buffers-per-shader-stage"] >= 8
    assert limits["max-compute-invocations-per-workgroup"] >= 256
