"""``alibi``: 2D ALiBi, attention with linear biases (Press et al., ICLR 2022) on the image grid,
as CROMA (Fuller et al., NeurIPS 2023) uses it:

    b[h, i, j] = -m_h ||p_i - p_j||_2,     m_h = 2^(-8 (h + 1) / n),  h = 0 .. n - 1,

the Euclidean distance between the grid positions (row, column) of query i and key j, in grid
units, times a fixed slope per head: ALiBi's geometric sequence that starts at 2^(-8/n) with that
same ratio (Sec. 3 of the ALiBi paper). The slopes are not learned. Pairs that involve a prefix
(class) token get no bias. The formula, pair by pair: :func:`posattn.reference.alibi_bias`.
"""
from __future__ import annotations

import torch

from .._cache import grid_constant
from ..grid import TokenGrid, _is_integer
from .base import PositionalModule
from .registry import register_phi

__all__ = ['ALiBi2D', 'alibi_slopes', 'grid_distances']


def alibi_slopes(num_heads: int, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """ALiBi's slopes m_h = 2^(-8 (h + 1) / n) of n heads: (heads,), computed on ``device`` in ``dtype``."""
    return torch.exp2(torch.arange(1, num_heads + 1, dtype=dtype, device=device) * (-8.0 / num_heads))


@grid_constant(max_bytes=256 << 20)
def grid_distances(height: int, width: int, dtype: torch.dtype = torch.float32,
                   device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """||p_i - p_j||_2 between the positions of an H x W grid: (HW, HW) in ``dtype``, [query, key]; cached.

    A pure function of its arguments, which are the cache key.
    """
    rows, cols = TokenGrid(height, width).positions(device)
    squared = (rows[:, None] - rows[None]) ** 2 + (cols[:, None] - cols[None]) ** 2  # exact in int64
    return squared.to(dtype).sqrt()  # the correctly rounded root of an exact integer


@register_phi('alibi')
class ALiBi2D(PositionalModule):
    """2D ALiBi (module docstring): a fixed bias, linear in the distance, with no parameters.

    Args:
        num_heads: attention heads: head h has slope 2^(-8 (h + 1) / num_heads).
    """

    def __init__(self, num_heads: int):
        super().__init__()
        if not _is_integer(num_heads) or num_heads < 1:
            raise ValueError(f'alibi num_heads must be an int >= 1, got {num_heads!r}')
        self.num_heads = int(num_heads)

    @property
    def slopes(self) -> torch.Tensor:
        """m_h of every head, (heads,) float32 on the CPU: a new tensor at every read."""
        return alibi_slopes(self.num_heads)

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """b[h, i, j] of the module docstring: (1, heads, N, N) in q's dtype, on q's device."""
        if self.position_cache is not None:  # a function of the grid alone
            return self.position_cache.get(self, (grid, q.dtype, q.device), (),
                                           lambda: self.position_bias(grid, q.dtype, q.device))
        return self.position_bias(grid, q.dtype, q.device)

    def position_bias(self, grid: TokenGrid, dtype: torch.dtype = torch.float32,
                      device: torch.device = torch.device('cpu')) -> torch.Tensor:
        """The bias on ``grid`` (1, heads, N, N), zero wherever a prefix token is; computed in float32
        at least (float64 for float64)."""
        precision = torch.promote_types(dtype, torch.float32)
        distances = grid_distances(grid.height, grid.width, precision, device)  # (HW, HW)
        slopes = alibi_slopes(self.num_heads, precision, device)
        bias = -slopes[:, None, None] * distances  # (heads, HW, HW)
        return grid.pad_prefix(bias).unsqueeze(0).to(dtype)

    def extra_repr(self) -> str:
        return f'num_heads={self.num_heads}'
