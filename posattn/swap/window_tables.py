"""What the Swin families share: attention inside windows with a relative position table.

Swin (Liu et al. 2021) attends within wh x ww windows, each its own sequence of N = wh * ww tokens:

    A = softmax(q k^T / sqrt(d) + B[index] + M) v

with ``B`` the learned relative position table ((2 wh - 1) * (2 ww - 1), heads), ``index`` the
(N, N) offsets into it, and ``M`` the shift mask of a shifted block (0 within a region of the
rolled map, -100 between regions that the roll brought into one window), which is not
positional and is always kept. In a swapped model the Φp is evaluated once on the wh x ww window
grid and shared by every window of every image; ``B[index]`` stays beside it unless the model's
own positions are dropped. Zero-padded tokens at the bottom and right of the map take part as
keys, as in every Swin implementation (posattn's own windowed attention, :mod:`posattn.window`,
masks them instead).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from einops import rearrange, repeat
from torch import nn

from ..grid import TokenGrid
from .core import AttentionSite, SwappedAttention

__all__ = ['WindowTableAttention', 'COSINE_ATTENTION', 'tables_of']

COSINE_ATTENTION = ("Swin V2's cosine attention (normalised queries and keys times a learned logit scale, "
                    'with a position bias from a continuous MLP) is not the scaled dot product posattn computes')


def tables_of(sites: Sequence[AttentionSite]) -> List[nn.Parameter]:
    """The relative position tables of the window attentions at ``sites``."""
    return [site.module.relative_position_bias_table for site in sites]


class WindowTableAttention(SwappedAttention):
    """Called as timm's ``WindowAttention`` and the OpenMMLab ``WindowMSA`` are:
    ``attn(windows, mask=None)``, windows (B * num_windows, wh * ww, C), window-major within each
    image, ``mask`` the shift mask (num_windows, N, N) or None.

    State-dict names stay the model's: ``qkv``, ``proj``, ``relative_position_bias_table`` and
    ``relative_position_index`` (persistent where the model's was).
    """
    window_size: Tuple[int, int]

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'attn_drop', 'proj_drop', 'relative_position_bias_table')
        self.take_index(old)

    def take_index(self, old: nn.Module) -> None:
        """The model's relative position index, its window size and the buffer's persistence."""
        persistent = 'relative_position_index' not in old._non_persistent_buffers_set
        self.register_buffer('relative_position_index', old.relative_position_index, persistent=persistent)
        self.window_size = tuple(old.window_size)

    def current_grid(self, *tensors: Optional[torch.Tensor]) -> TokenGrid:
        """Every window is one wh x ww grid, whatever the call."""
        return TokenGrid(*self.window_size)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """windows (B * num_windows, N, C) -> the layer's output (B * num_windows, N, C)."""
        return self.attention_output(x, own_bias=self.own_bias(x.shape[0], mask))

    def relative_position_bias(self) -> torch.Tensor:
        """B[index]: (1, heads, N, N)."""
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]  # (N * N, heads)
        return rearrange(bias, '(n m) h -> 1 h n m', n=self.current_grid().num_tokens)

    def own_bias(self, all_windows: int, shift_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The table's bias (when the model's own positions are kept) plus the shift mask, broadcastable
        to (B * nW, heads, N, N); ``all_windows`` = B * nW counts the windows of all images."""
        bias = self.relative_position_bias() if self.own_positions else None
        if shift_mask is None:
            return bias
        images, left = divmod(all_windows, shift_mask.shape[0])
        if left:
            raise ValueError(f'got {all_windows} windows for a shift mask of {shift_mask.shape[0]} windows per image: '
                             'the mask has one (N, N) entry per window of an image, the windows come image by image')
        shift_mask = repeat(shift_mask, 'w n m -> (b w) 1 n m', b=images)
        return shift_mask if bias is None else bias + shift_mask

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, window_size={self.window_size}'
