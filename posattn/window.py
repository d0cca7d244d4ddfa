"""Non-overlapping window attention on a token grid (Swin, Liu et al. 2021; ViTDet, Li et al. 2022).

The H x W grid is padded at the bottom and right to multiples of the window size ws, cut into
rows x cols windows of ws x ws tokens, each attended over as its own sequence, and put back:

    (B, H*W, C) -> pad -> (B, rows*ws, cols*ws, C) -> (B*rows*cols, ws*ws, C) -> attention
                -> (B*rows*cols, ws*ws, C) -> (B, rows*ws, cols*ws, C) -> crop -> (B, H*W, C)

Padding is exact: the key mask gives padded keys zero weight, so a real token's output is
attention over the real tokens of its window only, and the padded queries' outputs are dropped.
Every window is the same ws x ws grid, so a grid-only positional term (PerViT's Φp) is evaluated
once for it and serves all windows of all images (and its eval cache, keyed by grid, applies).
A window at least as large as the grid is one window: global attention when it equals the grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from .grid import TokenGrid

__all__ = ['GridWindows']


@dataclass(frozen=True)
class GridWindows:
    """The ws x ws windows of a token grid without prefix tokens.

    Args:
        grid: the H x W token grid.
        window_size: side ws of the square windows (>= 1).
    """
    grid: TokenGrid
    window_size: int

    def __post_init__(self):
        if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f'window_size must be a positive int, got {self.window_size!r}')
        if self.grid.num_prefix_tokens:
            raise ValueError(f'windows cut the token grid only; the {self.grid} has prefix tokens, '
                             'which belong to no window')

    @property
    def rows(self) -> int:
        return -(-self.grid.height // self.window_size)

    @property
    def cols(self) -> int:
        return -(-self.grid.width // self.window_size)

    @property
    def window_grid(self) -> TokenGrid:
        """The grid every window is: ws x ws."""
        return TokenGrid(self.window_size, self.window_size)

    @property
    def padded(self) -> bool:
        return (self.rows * self.window_size, self.cols * self.window_size) != (self.grid.height, self.grid.width)

    def partition(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, H*W, C) -> windows (B*rows*cols, ws*ws, C), zero-padded, row-major by window."""
        self.grid.check_num_tokens(x.shape[1])
        ws = self.window_size
        x = rearrange(x, 'b (h w) c -> b h w c', h=self.grid.height)
        x = F.pad(x, (0, 0, 0, self.cols * ws - self.grid.width, 0, self.rows * ws - self.grid.height))
        return rearrange(x, 'b (nh wh) (nw ww) c -> (b nh nw) (wh ww) c', wh=ws, ww=ws)

    def merge(self, windows: torch.Tensor) -> torch.Tensor:
        """Windows (B*rows*cols, ws*ws, C) -> tokens (B, H*W, C), padding dropped."""
        ws = self.window_size
        x = rearrange(windows, '(b nh nw) (wh ww) c -> b (nh wh) (nw ww) c', nh=self.rows, nw=self.cols, wh=ws)
        return rearrange(x[:, :self.grid.height, :self.grid.width], 'b h w c -> b (h w) c')

    def key_mask(self, batch: int, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """(B*rows*cols, ws*ws) bool, False at padding, in :meth:`partition`'s order; None without padding."""
        if not self.padded:
            return None
        ws = self.window_size
        real = torch.zeros(self.rows * ws, self.cols * ws, dtype=torch.bool, device=device)
        real[:self.grid.height, :self.grid.width] = True
        windows = rearrange(real, '(nh wh) (nw ww) -> (nh nw) (wh ww)', wh=ws, ww=ws)
        return windows.repeat(batch, 1)
