"""Shared fixtures of the WebGPU package tests: the package, one kernel per session."""

from __future__ import annotations

import pytest

from pagedhybrid.kernels.webgpu.loader import WebGpuKernel
from pagedhybrid.kernels.webgpu.package import KernelPackage, package_dir


@pytest.fixture(scope="session")
def package() -> KernelPackage:
    return KernelPackage(package_dir())


@pytest.fixture(scope="session")
def kernel(package: KernelPackage) -> WebGpuKernel:
    return WebGpuKernel(package)
