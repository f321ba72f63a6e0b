"""Interleaved partial MRoPE of Qwen3.5 (HF ``Qwen3_5TextRotaryEmbedding``), computed in fp32.

``inv_freq[i] = 1 / theta^(2i / rotary_dim)`` for ``i < rotary_dim/2``. ``position_ids`` has three
planes (T, H, W) ``[3, N]``; frequency ``i`` takes its angle from plane H if ``i % 3 == 1`` and
``i < 3 * mrope_section[1]``, from plane W if ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``,
else from plane T. cos/sin are ``[N, rotary_dim]`` (the half-table repeated twice, rotate-half
form). Rotation applies to the first ``rotary_dim`` channels of each head; the rest pass through:
``out[:rd] = x[:rd] * cos + rotate_half(x[:rd]) * sin`` with ``rotate_half(x) = [-x2, x1]``.
For text the three planes are equal and this is plain partial RoPE at the token position.
"""

from __future__ import annotations

import functools

import torch

from pagedhybrid.models.qwen35.config import Qwen35Config


def inv_freq(config: Qwen35Config, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[rd/2]`` (one tensor per geometry and device, computed once: do not modify)."""
    return _inv_freq(config.rotary_dim, config.rope_theta, str(device))


@functools.cache
def _inv_freq(dim: int, theta: float, device: str) -> torch.Tensor:
    # Same expression as HF so the fp32 table is bit-identical.
    return 1.0 / (theta ** (
        torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
    ))  # [rd/2]


def mrope_plane_index(config: Qwen35Config, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which position plane (0=T, 1=H, 2=W) drives each of the ``rotary_dim/2`` frequencies
    (one tensor per geometry and device, computed once: do not modify)."""
    return _plane_index(config.rotary_dim, tuple(config.mrope_section), str(device))


@functools.cache
def _plane_index(dim: int, section: tuple[int, ...], device: str) -> torch.Tensor:
    half = dim // 2
    idx = torch.zeros(half, dtype=torch.int64)
    for plane, offset in ((1, 1), (2, 2)):
        idx[offset:3 * section[plane]:3] = plane
    return idx.to(device)  # [rd/2]


def mrope_cos_sin(config: Qwen35Config, position_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 ``[N, rotary_dim]`` from int64 ``position_ids[3, N]``."""
    freq = inv_freq(config, position_ids.device)
    angles = position_ids[..., None].float() * freq  # [3, N, rd/2]
    plane = mrope_plane_index(config, position_ids.device)
    index = plane.view(1, 1, -1).expand(1, angles.shape[1], -1)  # [1, N, rd/2]
    chosen = angles.gather(0, index)[0]  # [N, rd/2]
    emb = torch.cat((chosen, chosen), dim=-1)  # [N, rd]
    return emb.cos(), emb.sin()


class RopeTable:
    """cos, sin fp32 ``[P, rotary_dim]`` of the text positions ``0 .. P-1`` (``mrope_cos_sin``
    with three equal planes), grown by doubling to the longest sequence seen; its rows are
    ``mrope_cos_sin``'s bit for bit (the same elementwise fp32 ops), so a step reads them with
    two ``index_select`` where computing them takes eight ops."""

    def __init__(self, config: Qwen35Config) -> None:
        self.config = config
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def upto(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table, ``P >= need`` rows."""
        table = self._table
        if table is None or table[0].shape[0] < need:
            n = max(need, 256, 2 * (0 if table is None else table[0].shape[0]))
            table = self._table = mrope_cos_sin(
                self.config, torch.arange(n).view(1, -1).expand(3, -1))
        return table

    def rows(self, positions: torch.Tensor, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[N, rotary_dim]`` of int64 ``positions [N]``, each below ``reach``."""
        cos, sin = self.upto(reach)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def step(self, position_ids: torch.Tensor, reach: int | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mrope_cos_sin(config, position_ids [3, N])``: from the table where the three planes
        are one row in memory (stride 0, as the runner builds text positions) -- every position
        below ``reach``, or measured when None -- else computed."""
        if position_ids.stride(0) != 0 or not position_ids.shape[1]:
            return mrope_cos_sin(self.config, position_ids)
        pos = position_ids[0]
        if reach is None:
            if int(pos.min()) < 0:
                return mrope_cos_sin(self.config, position_ids)
            reach = int(pos.max()) + 1
        return self.rows(pos, reach)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x[N, heads, D]`` (fp32 math, dtype kept)."""
    rd = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :rd], xf[..., rd:]  # [N, h, rd], [N, h, D-rd]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)  # [N, h, rd]
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, rest), dim=-1).to(x.dtype)  # [N, h, D]
