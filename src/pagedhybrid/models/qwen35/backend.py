"""The model's op seam; defined in ``pagedhybrid.kernels.backend`` (models sit above kernels)."""

from __future__ import annotations

from pagedhybrid.kernels.backend import OpBackend, cpu_backend, reference_backend, select

__all__ = ["OpBackend", "cpu_backend", "reference_backend", "select"]
