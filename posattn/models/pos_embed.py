"""Learned absolute position embeddings on another grid: one resampling, used at every input size
(:class:`posattn.models.vit.VisionTransformer`) and when weights of another resolution load
(:func:`posattn.models.registry.load_pretrained`)."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ['resample_abs_pos_embed', 'square_grid']


def square_grid(num_grid_tokens: int) -> Optional[Tuple[int, int]]:
    """(side, side) of a square grid of ``num_grid_tokens`` tokens, or None if there is none."""
    side = math.isqrt(num_grid_tokens) if num_grid_tokens >= 0 else -1
    return (side, side) if side >= 0 and side * side == num_grid_tokens else None


def resample_abs_pos_embed(pos_embed: torch.Tensor, new_size: Sequence[int], old_size: Optional[Sequence[int]] = None,
                           num_prefix_tokens: int = 1) -> torch.Tensor:
    """A (1, prefix + H*W, C) learned embedding resampled to a ``new_size`` = (h, w) grid.

    DeiT's fine-tuning recipe as timm's ``resample_abs_pos_embed`` states it: the grid part is
    resampled bicubically (``align_corners=False``) with antialiasing, so that shrinking the grid
    averages rather than skips rows, computed in float32 and returned in the embedding's dtype; the
    ``num_prefix_tokens`` embeddings before the grid (the class token's) are kept as they are.

    Args:
        pos_embed: (1, num_prefix_tokens + H*W, C).
        new_size: the grid to resample to, (h, w).
        old_size: the embedding's grid (H, W); None takes it square, as checkpoints hold no grid.
        num_prefix_tokens: embeddings before the grid (0 when the class token has none, DeiT III).
    """
    num_grid_tokens = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        old_size = square_grid(num_grid_tokens)
        if old_size is None:
            raise ValueError(f'a position embedding of {pos_embed.shape[1]} tokens with {num_prefix_tokens} prefix '
                             f'tokens has {num_grid_tokens} grid tokens, not a square grid: pass its grid size')
    old_size, new_size = tuple(old_size), tuple(new_size)
    if old_size[0] * old_size[1] != num_grid_tokens:
        raise ValueError(f'a position embedding of {num_grid_tokens} grid tokens is not a '
                         f'{old_size[0]}x{old_size[1]} grid')
    if not torch.compiler.is_compiling() and old_size == new_size:
        return pos_embed  # traced, the resampling stays: an identity here, and no guard on the grid's size
    prefix, grid = pos_embed.split([num_prefix_tokens, num_grid_tokens], dim=1)
    grid = rearrange(grid.float(), 'b (h w) c -> b c h w', h=old_size[0], w=old_size[1])
    grid = F.interpolate(grid, size=new_size, mode='bicubic', align_corners=False, antialias=True)
    grid = rearrange(grid, 'b c h w -> b (h w) c').to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
