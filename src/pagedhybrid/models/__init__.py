"""Model implementations served by pagedhybrid (``qwen35``: the Qwen3.5 hybrid decoder)."""

from __future__ import annotations
