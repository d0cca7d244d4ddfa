"""The measures of PerViT's analyses (Min et al., NeurIPS 2022, Sec. 4.1 and Appendix B).

For an attention map Φ (heads, P, P) over the P = H * W grid positions, distances in token units:

    nonlocality  Ω   = 1/|P|^2 sum_{q,k} Φ[q, k] ||q - k||                          (Eq. 13)
    impact       Ψ_p = 1 / ||Φa - Φp||_F,  Ψ_c = 1 / ||Φa - Φc||_F                  (Eq. 12)
    region       argmax_r 1/|P|^2 sum_{q,k} Φp[q, k] 1[||q - k|| in I_r]              (Eq. 11)

with the regions central, para-central, mid and far peripheral bounded by the radii
r = sqrt(H W θ / (220 π)), θ = 5, 40, 120, 220 degrees (Eq. 38): [0, 1.19), [1.19, 3.37),
[3.37, 5.83), [5.83, 7.9) on a 14 x 14 grid. Pairs farther than the last radius fall in no region.
On a small grid a region can hold no distance between two positions at all (on 4 x 4 the radii are
0.34, 0.96, 1.67, 2.26: no pair is para-central), so that no head can be in it and the others' names
say nothing: :func:`regions_apply` tells, and the regions are named only where each holds one.
All functions take any leading dimensions (batch, heads) before the two position axes.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from ..grid import TokenGrid

__all__ = ['REGIONS', 'REGION_ANGLES', 'token_distances', 'region_radii', 'regions_apply', 'nonlocality', 'impact',
           'region_scores']

REGIONS = ('central', 'para-central', 'mid-peripheral', 'far-peripheral')
REGION_ANGLES = (5.0, 40.0, 120.0, 220.0)  # degrees of the visual field (Appendix B)
FIELD_ANGLE = 220.0


def token_distances(grid: TokenGrid, device: torch.device = torch.device('cpu'),
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """||q - k|| between grid positions in token units: (P, P), row-major positions."""
    rows, cols = (axis.double() for axis in grid.positions(device))
    offsets = torch.stack([rows[:, None] - rows[None], cols[:, None] - cols[None]])
    return offsets.square().sum(0).sqrt().to(dtype)


def region_radii(grid: TokenGrid) -> Tuple[float, ...]:
    """Outer radius of each region in :data:`REGIONS`, sqrt(H W θ / (220 π)) (Eq. 38)."""
    area = grid.height * grid.width
    return tuple(math.sqrt(area * angle / (FIELD_ANGLE * math.pi)) for angle in REGION_ANGLES)


def regions_apply(grid: TokenGrid) -> bool:
    """Whether every region holds the distance of some pair of positions of ``grid`` (5 x 5 and
    larger do; 4 x 4 does not), so that a head's region (Eq. 11) tells it apart from the others."""
    distances = {math.hypot(dy, dx) for dy in range(grid.height) for dx in range(grid.width)}
    outer = region_radii(grid)
    return all(any(inner <= distance < radius for distance in distances)
               for inner, radius in zip((0.0,) + outer[:-1], outer))


def _check_maps(maps: torch.Tensor, grid: TokenGrid) -> None:
    positions = grid.num_grid_tokens
    if maps.dim() < 2 or maps.shape[-2:] != (positions, positions):
        raise ValueError(f'attention maps over a {grid.height}x{grid.width} grid should end in '
                         f'({positions}, {positions}), got shape {tuple(maps.shape)}')


def nonlocality(maps: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
    """Ω of each map (Eq. 13): the attention-weighted query-key distance, summed and divided by |P|^2."""
    _check_maps(maps, grid)
    distances = token_distances(grid, maps.device, maps.dtype)
    return (maps * distances).sum((-2, -1)) / grid.num_grid_tokens ** 2


def impact(mixed: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Ψ (Eq. 12): 1 / ||Φa - Φ||_F over the last two axes, Φ the position or content attention."""
    if mixed.shape[-2:] != part.shape[-2:]:
        raise ValueError(f'maps of shapes {tuple(mixed.shape)} and {tuple(part.shape)} do not pair up')
    return torch.linalg.matrix_norm(mixed - part).reciprocal()


def region_scores(position: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
    """The bracket of Eq. 11 for each region: (..., 4), the Φp mass in the region over |P|^2.

    ``region_scores(...).argmax(-1)`` indexes :data:`REGIONS`, the head's peripheral region.
    """
    _check_maps(position, grid)
    distances = token_distances(grid, position.device, torch.float64)
    outer = torch.tensor(region_radii(grid), dtype=torch.float64, device=position.device)
    inner = torch.cat([outer.new_zeros(1), outer[:-1]])
    masks = ((distances >= inner[:, None, None]) & (distances < outer[:, None, None])).to(position.dtype)
    return torch.einsum('...qk,rqk->...r', position, masks) / grid.num_grid_tokens ** 2
