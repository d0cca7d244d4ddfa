"""Non-overlapping window attention on a token grid (Swin, Liu et al. 2021; ViTDet, Li et al. 2022).

The H x W grid is padded at the bottom and right to multiples of the window size wh x ww, cut into
rows x cols windows of wh x ww tokens, each attended over as its own sequence, and put back:

    (B, H*W, C) -> pad -> (B, rows*wh, cols*ww, C) -> (B*rows*cols, wh*ww, C) -> attention
                -> (B*rows*cols, wh*ww, C) -> (B, rows*wh, cols*ww, C) -> crop -> (B, H*W, C)

Padding is exact: the key mask gives padded keys zero weight, so a real token's output is
attention over the real tokens of its window only, and the padded queries' outputs are dropped.
Every window is the same wh x ww grid, so a grid-only positional term (PerViT's Φp) is evaluated
once for it and serves all windows of all images (and its eval cache, keyed by grid, applies).
A window at least as large as the grid is one window: global attention when it equals the grid.

Swin's shifted windows roll the padded map up and left by (sh, sw) tokens before it is cut and
back after it is put together, so that a window spans tokens of neighbouring unshifted windows;
the tokens that the roll wraps around from the far edges come from other regions of the map, and
Swin keeps them from attending to each other with a mask (:meth:`GridWindows.shift_mask`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from einops import rearrange

from .grid import TokenGrid

__all__ = ['GridWindows']


def _window_hw(window_size: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    """(wh, ww) of a square window side or of a (height, width) pair, each a positive int."""
    def positive(side) -> bool:
        return isinstance(side, int) and not isinstance(side, bool) and side >= 1

    if isinstance(window_size, tuple):
        if len(window_size) != 2 or not all(positive(side) for side in window_size):
            raise ValueError(f'window_size must be a (height, width) pair of positive ints, got {window_size!r}')
        return window_size
    if not positive(window_size):
        raise ValueError(f'window_size must be a positive int, got {window_size!r}')
    return window_size, window_size


@dataclass(frozen=True)
class GridWindows:
    """The windows of a token grid without prefix tokens, row-major by window and within each.

    Args:
        grid: the H x W token grid.
        window_size: side ws of square windows, or (wh, ww) for windows that are not square (>= 1).
        shift: (sh, sw), how many rows and columns the padded map is rolled up and left before it
            is cut (Swin's shifted windows), each 0 <= shift < the window's side; (0, 0) cuts the
            map as it is.
    """
    grid: TokenGrid
    window_size: Union[int, Tuple[int, int]]
    shift: Tuple[int, int] = (0, 0)

    def __post_init__(self):
        hw = _window_hw(self.window_size)
        shift = tuple(self.shift)
        if len(shift) != 2 or not all(isinstance(s, int) and 0 <= s < side for s, side in zip(shift, hw)):
            raise ValueError(f'shift must be a (rows, cols) pair with 0 <= shift < the window side, '
                             f'for {hw[0]}x{hw[1]} windows got {self.shift!r}')
        object.__setattr__(self, 'shift', shift)
        if self.grid.num_prefix_tokens:
            raise ValueError(f'windows cut the token grid only; the {self.grid} has prefix tokens, '
                             'which belong to no window')

    @property
    def window_hw(self) -> Tuple[int, int]:
        """(wh, ww): the height and width of every window."""
        return _window_hw(self.window_size)

    @property
    def rows(self) -> int:
        return -(-self.grid.height // self.window_hw[0])

    @property
    def cols(self) -> int:
        return -(-self.grid.width // self.window_hw[1])

    @property
    def padded_hw(self) -> Tuple[int, int]:
        """(rows * wh, cols * ww): the size of the map the windows tile."""
        return self.rows * self.window_hw[0], self.cols * self.window_hw[1]

    @property
    def window_grid(self) -> TokenGrid:
        """The grid every window is: wh x ww."""
        return TokenGrid(*self.window_hw)

    @property
    def padded(self) -> bool:
        return self.padded_hw != (self.grid.height, self.grid.width)

    @property
    def shifted(self) -> bool:
        return any(self.shift)

    def partition(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, H*W, C) -> windows (B*rows*cols, wh*ww, C), zero-padded, rolled by ``shift``."""
        self.grid.check_num_tokens(x.shape[1])
        x = rearrange(x, 'b (h w) c -> b h w c', h=self.grid.height)
        padded_h, padded_w = self.padded_hw
        x = F.pad(x, (0, 0, 0, padded_w - self.grid.width, 0, padded_h - self.grid.height))
        return self._cut(self._roll(x, -1))

    def merge(self, windows: torch.Tensor) -> torch.Tensor:
        """Windows (B*rows*cols, wh*ww, C) -> tokens (B, H*W, C), rolled back, padding dropped."""
        wh, ww = self.window_hw
        x = rearrange(windows, '(b nh nw) (wh ww) c -> b (nh wh) (nw ww) c', nh=self.rows, nw=self.cols, wh=wh)
        x = self._roll(x, 1)
        return rearrange(x[:, :self.grid.height, :self.grid.width], 'b h w c -> b (h w) c')

    def key_mask(self, batch: int, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """(B*rows*cols, wh*ww) bool, False at padding, in :meth:`partition`'s order; None without padding."""
        if not self.padded:
            return None
        real = torch.zeros(self.padded_hw, dtype=torch.bool, device=device)
        real[:self.grid.height, :self.grid.width] = True
        windows = self._cut(self._roll(real[None, :, :, None], -1))[..., 0]  # (rows*cols, wh*ww)
        return windows.repeat(batch, 1)

    def shift_mask(self, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """(rows*cols, wh*ww, wh*ww) bool, True for the pairs of tokens of a window that the roll
        brought from different regions of the map; None without a shift.

        Along each rolled side the rolled map has three regions, Swin's slices
        ``[0:-window], [-window:-shift], [-shift:]`` (one region along a side that is not rolled),
        and two tokens are of one region when they are along both sides. Swin adds -100 to the
        logits of the pairs marked here.
        """
        if not self.shifted:
            return None
        rows, cols = (self._side_regions(size, side, shift, device)
                      for size, side, shift in zip(self.padded_hw, self.window_hw, self.shift))
        regions = rows[:, None] * 3 + cols[None, :]  # (rows*wh, cols*ww), one label per region
        regions = self._cut(regions[None, :, :, None])[..., 0]  # (rows*cols, wh*ww)
        return regions[:, None, :] != regions[:, :, None]

    @staticmethod
    def _side_regions(size: int, side: int, shift: int, device: Optional[torch.device]) -> torch.Tensor:
        """The region (0, 1, 2) of each position along one side of the rolled map: (size,)."""
        positions = torch.arange(size, device=device)
        if not shift:
            return torch.zeros_like(positions)
        return (positions >= size - side).long() + (positions >= size - shift).long()

    def _roll(self, x: torch.Tensor, direction: int) -> torch.Tensor:
        """x (B, rows*wh, cols*ww, C) rolled by ``direction * shift`` along its two grid axes."""
        if not self.shifted:
            return x
        return torch.roll(x, shifts=(direction * self.shift[0], direction * self.shift[1]), dims=(1, 2))

    def _cut(self, x: torch.Tensor) -> torch.Tensor:
        """A map (B, rows*wh, cols*ww, C) -> its windows (B*rows*cols, wh*ww, C)."""
        wh, ww = self.window_hw
        return rearrange(x, 'b (nh wh) (nw ww) c -> (b nh nw) (wh ww) c', wh=wh, ww=ww)
