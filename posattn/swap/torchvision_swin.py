"""torchvision's ``SwinTransformer`` v1 (swin_t, swin_s, swin_b, any input size): the
``ShiftedWindowAttention`` of every block, which cuts its own windows. The replacement does what
torchvision's ``shifted_window_attention`` does around the attention (pad to whole windows, roll,
partition, shift mask, merge, roll back, crop) and keeps the relative position table and index
under torchvision's names, so its checkpoints load before and after the swap. Swin V2
(``ShiftedWindowAttentionV2``, swin_v2_*) is refused: its attention is cosine attention."""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .core import AttentionSite, SwapPlan, described, imported, register_family
from .windows import COSINE_ATTENTION, WindowTableAttention, tables_of

_SWIN = 'torchvision.models.swin_transformer'


def shift_mask(padded_hw: Tuple[int, int], window_size: Sequence[int], shift_size: Sequence[int],
               like: torch.Tensor) -> torch.Tensor:
    """torchvision's mask of a shifted block: (num_windows, N, N), -100 between tokens from different
    regions of the rolled map, 0 within one. The regions are torchvision's slices
    ``[0:-window], [-window:-shift], [-shift:]`` along each dimension, a zero shift included."""
    regions = like.new_zeros(padded_hw)
    slices = [((0, -window), (-window, -shift), (-shift, None)) for window, shift in zip(window_size, shift_size)]
    for count, ((h0, h1), (w0, w1)) in enumerate(itertools.product(*slices)):
        regions[h0:h1, w0:w1] = count
    regions = rearrange(regions, '(nh wh) (nw ww) -> (nh nw) (wh ww)', wh=window_size[0], ww=window_size[1])
    different = regions[:, None, :] != regions[:, :, None]  # (num_windows, N, N)
    return like.new_zeros(different.shape).masked_fill(different, -100.0)


class TorchvisionWindowAttention(WindowTableAttention):
    """Called as torchvision's ``ShiftedWindowAttention``: (B, H, W, C) -> (B, H, W, C)."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'relative_position_bias_table')
        self.take_index(old)
        self.shift_size = list(old.shift_size)
        self.attn_drop.p, self.proj_drop.p = old.attention_dropout, old.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        wh, ww = self.window_size
        x = F.pad(x, (0, 0, 0, -W % ww, 0, -H % wh))  # zeros that take part as keys
        padded_hw = x.shape[1:3]
        # torchvision does not shift along a dimension that one window covers
        shift = [0 if window >= size else s for window, size, s in zip(self.window_size, padded_hw, self.shift_size)]
        shifted = any(shift)
        if shifted:
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        windows = rearrange(x, 'b (nh wh) (nw ww) c -> (b nh nw) (wh ww) c', wh=wh, ww=ww)
        mask = shift_mask(padded_hw, self.window_size, shift, x) if shifted else None
        windows = self.proj_drop(self.proj(self.attend_windows(windows, mask)))
        x = rearrange(windows, '(b nh nw) (wh ww) c -> b (nh wh) (nw ww) c', b=B, nh=padded_hw[0] // wh, wh=wh)
        if shifted:
            x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
        return x[:, :H, :W].contiguous()


@register_family
def torchvision_swin_transformer(model: nn.Module) -> Optional[SwapPlan]:
    SwinTransformer = imported(_SWIN, 'SwinTransformer')
    if SwinTransformer is None or not isinstance(model, SwinTransformer):
        return None
    Attention, AttentionV2 = imported(_SWIN, 'ShiftedWindowAttention'), imported(_SWIN, 'ShiftedWindowAttentionV2')
    Block = imported(_SWIN, 'SwinTransformerBlock')
    sites = []
    for i, block in enumerate(m for m in model.modules() if isinstance(m, Block)):
        attn = block.attn
        if isinstance(attn, AttentionV2):
            raise TypeError(f'cannot swap the attention of Swin block {i} ({described(attn)}): {COSINE_ATTENTION}')
        if type(attn) is not Attention:
            raise TypeError(f'Swin block {i} holds {described(attn)}, not torchvision\'s ShiftedWindowAttention: '
                            'swap_attention replaces the attention of torchvision\'s SwinTransformerBlock only')
        sites.append(AttentionSite(block, 'attn', attn.qkv.in_features, attn.num_heads))
    return SwapPlan('torchvision SwinTransformer', sites, TorchvisionWindowAttention,
                    position_parameters=tables_of(sites))
