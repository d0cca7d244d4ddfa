"""Resampling of learned offset tables as matrices, so that the tables of many grid sizes are one product.

``F.interpolate`` along one axis is linear in its input: resampling n values to m is an (m, n)
matrix, obtained exactly by resampling the identity. Bicubic resampling of a 2D table (PyTorch's
kernel, ``align_corners=False``) is separable, R_y T R_x^T, so the offset tables of every distinct
grid of a layout come from the stacked matrices of their sizes in one product each way
(:mod:`posattn.phi.rpb`, :mod:`posattn.phi.decomposed_rpb` on a :class:`~posattn.positions.TokenPositions`).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from .._cache import grid_constant

__all__ = ['resampling_matrix', 'stacked_resampling']


def resampling_matrix(size_in: int, size_out: int, mode: str) -> torch.Tensor:
    """(size_out, size_in) float64: ``F.interpolate`` of ``size_in`` values to ``size_out`` by ``mode``
    ('linear' or 'bicubic', ``align_corners=False``), as a matrix."""
    identity = torch.eye(size_in, dtype=torch.float64)
    if mode == 'linear':
        return F.interpolate(identity[None], size=size_out, mode='linear', align_corners=False)[0].t()
    columns = F.interpolate(identity[None, :, :, None], size=(size_out, 1), mode='bicubic', align_corners=False)
    return columns[0, :, :, 0].t()


@grid_constant(max_bytes=16 << 20)
def stacked_resampling(size_in: int, sizes_out: Tuple[int, ...], mode: str, dtype: torch.dtype,
                       device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The matrices of ``size_in`` -> each of ``sizes_out`` stacked, (sum(sizes_out), size_in) in
    ``dtype``, and where each one's rows begin, (len(sizes_out),) int64; cached."""
    matrices = [resampling_matrix(size_in, size, mode) for size in sizes_out]
    starts = torch.tensor([0] + [size for size in sizes_out[:-1]]).cumsum(0)
    return torch.cat(matrices).to(device, dtype), starts.to(device)


def distinct(values: Sequence[int]) -> Tuple[int, ...]:
    """The distinct values, in the order they first appear."""
    return tuple(dict.fromkeys(int(value) for value in values))
