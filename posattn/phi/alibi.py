"""``alibi``: 2D ALiBi, attention with linear biases (Press et al., ICLR 2022) on the image grid,
as CROMA (Fuller et al., NeurIPS 2023) uses it:

    b[h, i, j] = -m_h ||p_i - p_j||_2,

the Euclidean distance between the grid positions (row, column) of query i and key j, in grid
units, times a fixed slope m_h per head. The slopes are those of ALiBi's released ``get_slopes``
(which CROMA copies), every one 2 to a power:

- n a power of two: the geometric sequence m_h = 2^(-8 (h + 1) / n), h = 0 .. n - 1, which starts
  at 2^(-8/n) with that same ratio (Sec. 3 of the ALiBi paper; 8 heads: 1/2, 1/4, ..., 1/256);
- otherwise, with p the largest power of two below n: the p slopes of p heads, then the first
  n - p of every other slope of 2p heads, 2^(-8 (2k + 1) / (2p)), k = 0 .. n - p - 1
  (3 heads: 1/16, 1/256, 1/4; 6 heads: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8).

The slopes are not learned. Pairs that involve a prefix (class) token get no bias. The formula,
pair by pair: :func:`posattn.reference.alibi_bias`.

On a layout's images one a row, each pair reads its bias from a per-head table indexed by its squared
offset dy^2 + dx^2, an exact integer, so every pair gets what its image's grid gives it, bit for bit.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from .._cache import grid_constant
from ..grid import TokenGrid, is_integer
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from .base import PositionalModule
from .registry import register_phi

__all__ = ['ALiBi2D', 'alibi_slopes', 'grid_distances', 'layout_alibi_bias', 'layout_squared_offsets']


def alibi_slopes(num_heads: int, dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """ALiBi's slopes m_h of n heads, in the order of its released ``get_slopes`` (module docstring):
    (heads,) in ``dtype`` on ``device``.

    The exponents are exact binary fractions; each slope is 2^exponent in float64 (a Python float),
    rounded once more to ``dtype``, so a slope 2^-k is exact in every floating dtype.
    """
    if not is_integer(num_heads) or num_heads < 1:
        raise ValueError(f'alibi_slopes needs an int num_heads >= 1, got {num_heads!r}')
    num_heads = int(num_heads)
    power = 1 << (num_heads.bit_length() - 1)  # p, the largest power of two <= num_heads
    exponents = [-8 * (h + 1) / power for h in range(power)]
    exponents += [-8 * (2 * k + 1) / (2 * power) for k in range(num_heads - power)]  # every other one of 2p
    # Python's pow, not torch.exp2: the vectorised float64 exp2 of PyTorch's CPU kernels can be an ulp off.
    return torch.tensor([2.0 ** exponent for exponent in exponents], dtype=dtype, device=device)


@grid_constant(max_bytes=256 << 20)
def grid_distances(height: int, width: int, dtype: torch.dtype = torch.float32,
                   device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """||p_i - p_j||_2 between the positions of an H x W grid: (HW, HW) in ``dtype``, [query, key]; cached.

    A pure function of its arguments, which are the cache key.
    """
    rows, cols = TokenGrid(height, width).positions(device)
    squared = (rows[:, None] - rows[None]) ** 2 + (cols[:, None] - cols[None]) ** 2  # exact in int64
    return squared.to(dtype).sqrt()  # the root of an exact integer (vectorised sqrt: within an ulp)


@register_phi('alibi')
class ALiBi2D(PositionalModule):
    """2D ALiBi (module docstring): a fixed bias, linear in the distance, with no parameters.

    Args:
        num_heads: attention heads; head h has ALiBi's slope m_h (:func:`alibi_slopes`).
    """

    def __init__(self, num_heads: int):
        super().__init__(hooks=('logits_bias',))
        if not is_integer(num_heads) or num_heads < 1:
            raise ValueError(f'alibi num_heads must be an int >= 1, got {num_heads!r}')
        self.num_heads = int(num_heads)

    @property
    def slopes(self) -> torch.Tensor:
        """m_h of every head, (heads,) float32 on the CPU: a new tensor at every read."""
        return alibi_slopes(self.num_heads)

    def position_bias(self, grid: TokenGrid, dtype: torch.dtype = torch.float32,
                      device: torch.device = torch.device('cpu')) -> torch.Tensor:
        """b[h, i, j] of the module docstring on ``grid``: (1, heads, N, N), zero wherever a prefix token
        is; the logits bias (:meth:`logits_bias`, served by :func:`posattn.cache_positions`). Computed in float32
        at least (float64 for float64)."""
        precision = torch.promote_types(dtype, torch.float32)
        distances = grid_distances(grid.height, grid.width, precision, device)  # (HW, HW)
        slopes = alibi_slopes(self.num_heads, precision, device)
        bias = -slopes[:, None, None] * distances  # (heads, HW, HW)
        return grid.pad_prefix(bias).unsqueeze(0).to(dtype)

    def logits_bias_at(self, q: torch.Tensor, k: torch.Tensor, positions: TokenPositions,
                       **given: Any) -> torch.Tensor:
        """b[h, i, j] on rows of images, each pair of an image's grid tokens by its distance, zero
        wherever a prefix token is, -inf at padding keys: (I, heads, M, M) in q's dtype, made once per
        layout (:func:`layout_alibi_bias`) and shared by every layer and call."""
        return layout_alibi_bias(positions.layout, positions.batch, self.num_heads, q.dtype, q.device)

    def settings(self) -> Dict[str, Any]:
        return {'num_heads': self.num_heads}  # the slopes depend on the number of heads


@grid_constant(max_bytes=256 << 20)
def layout_alibi_bias(layout: ImageLayout, batch: int, num_heads: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """2D ALiBi on a layout's images one a row: (I, heads, M, M) in ``dtype``, -inf at padding keys;
    cached.

    A pair's squared offset s = dy^2 + dx^2 is an exact integer: every pair reads -m_h sqrt(s) from a
    (heads, S) table over s = 0 .. S - 1, made in the precision of :meth:`ALiBi2D.position_bias` and
    cast to ``dtype`` before one gather (s = 0 at a pair with a prefix token or padding)."""
    positions = token_positions(layout, batch, device)
    precision = torch.promote_types(dtype, torch.float32)
    squared, levels = layout_squared_offsets(layout, batch, device)  # (I, M, M), (S,)
    slopes = alibi_slopes(num_heads, precision, device)
    table = (-slopes[:, None] * levels.to(precision).sqrt()).to(dtype)  # (heads, S)
    bias = table.index_select(1, squared.flatten())  # (heads, I M M): one contiguous gather a head
    return positions.mask_padding_keys_(bias.view(-1, *squared.shape).transpose(0, 1))  # (I, heads, M, M)


@grid_constant(max_bytes=128 << 20)
def layout_squared_offsets(layout: ImageLayout, batch: int,
                           device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The squared offset dy^2 + dx^2 between the grid tokens of each image of a layout, its images one a
    row, (I, M, M) int32, 0 wherever a prefix token or padding is; and the squared offsets 0 .. S - 1,
    (S,) int64, S - 1 the largest (H - 1)^2 + (W - 1)^2 of the layout's grids; cached."""
    positions = token_positions(layout, batch, device)
    dy, dx = positions.offsets()
    squared = torch.where(positions.grid_pairs(), dy * dy + dx * dx, 0).to(torch.int32)
    largest = max((grid.height - 1) ** 2 + (grid.width - 1) ** 2 for grid in layout.images_by_grid())
    return squared, torch.arange(largest + 1, device=device)
