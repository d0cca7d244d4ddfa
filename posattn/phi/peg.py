"""``peg``: CPVT's position encoding generator (PEG), which is also PerViT's CPE.

Chu et al., "Conditional Positional Encodings for Vision Transformers" (CPVT), Sec. 3.2:
the grid tokens, reshaped to a (C, H, W) map, go through a 3x3 depthwise convolution with zero
padding and bias, y = DWConv(x) + x; the zero padding is what lets it encode absolute position.
Prefix (class) tokens pass through unchanged. PerViT's CPE is the same convolution without its
own residual, placed on the attention branch's input (``residual=False``). With ``stride=2`` the
grid halves (ceil) and there is no residual, as in CPVT's pyramid variants.
"""
from __future__ import annotations

from typing import Tuple

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
        stride: 1, or 2 to halve the grid (no residual then).
    """

    def __init__(self, dim: int, residual: bool = True, stride: int = 1):
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f'PEG stride must be 1 or 2, got {stride}')
        if stride == 2 and residual:
            raise ValueError('a stride-2 PEG changes the grid and has no residual: pass residual=False')
        self.residual = residual
        self.stride = stride
        self.proj = nn.Conv2d(dim, dim, 3, stride, 1, groups=dim)

    def forward(self, x: torch.Tensor, hw: GridLike) -> Tuple[torch.Tensor, TokenGrid]:
        """x (B, N, C) on ``hw`` (a TokenGrid, or (H, W) without prefix tokens) -> (tokens, their grid)."""
        grid = hw if isinstance(hw, TokenGrid) else TokenGrid.of(hw)
        grid.check_num_tokens(x.shape[1])
        prefix, tokens = x.split([grid.num_prefix_tokens, grid.num_grid_tokens], dim=1)
        feature_map = rearrange(tokens, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)
        out = self.proj(feature_map)
        if self.residual:
            out = out + feature_map
        out_grid = TokenGrid(out.shape[-2], out.shape[-1], grid.num_prefix_tokens)
        return torch.cat([prefix, rearrange(out, 'b c h w -> b (h w) c')], dim=1), out_grid

    def tokens(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        if self.stride != 1:
            raise ValueError('a stride-2 PEG changes the grid; place it between stages, '
                             'not inside an attention layer')
        return self(x, grid)[0]

    def extra_repr(self) -> str:
        return f'residual={self.residual}, stride={self.stride}'
