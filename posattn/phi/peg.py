"""``peg``: CPVT's position encoding generator (PEG), which is also PerViT's CPE.

Chu et al., "Conditional Positional Encodings for Vision Transformers" (CPVT), Sec. 3.2:
the grid tokens, reshaped to a (C, H, W) map, go through a 3x3 depthwise convolution with zero
padding and bias, y = DWConv(x) + x; the zero padding is what lets it encode absolute position.
Prefix (class) tokens pass through unchanged. PerViT's CPE is the same convolution without its
own residual, placed on the attention branch's input (``residual=False``).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from einops import rearrange
from torch import nn

from ..grid import GridLike, TokenGrid
from .base import PositionalModule
from .registry import register_phi

__all__ = ['PositionEncodingGenerator']


@register_phi('peg')
class PositionEncodingGenerator(PositionalModule):
    """Depthwise 3x3 convolution on the grid tokens, any H x W.

    Args:
        dim: token channels.
        residual: add the input back (CPVT's PEG); False gives PerViT's CPE.
    """

    def __init__(self, dim: int, residual: bool = True):
        super().__init__(hooks=('tokens',))
        self.dim, self.residual = dim, residual
        self.proj = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)

    def tokens(self, x: torch.Tensor, hw: GridLike) -> torch.Tensor:
        """x (B, N, C) on ``hw`` (a TokenGrid, or (H, W) without prefix tokens) -> (B, N, C)."""
        grid = hw if isinstance(hw, TokenGrid) else TokenGrid.of(hw)
        grid.check_num_tokens(x.shape[1])
        prefix, tokens = x.split([grid.num_prefix_tokens, grid.num_grid_tokens], dim=1)
        feature_map = rearrange(tokens, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)
        out = self.proj(feature_map)
        if self.residual:
            out = out + feature_map
        return torch.cat([prefix, rearrange(out, 'b c h w -> b (h w) c')], dim=1)

    def settings(self) -> Dict[str, Any]:
        return {'dim': self.dim, 'residual': self.residual}
