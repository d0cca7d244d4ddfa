"""torchvision's ``SwinTransformer`` v1 (swin_t, swin_s, swin_b, any input size): the
``ShiftedWindowAttention`` of every block, which cuts its own windows. The replacement does what
torchvision's ``shifted_window_attention`` does around the attention (pad to whole windows, roll,
partition, shift mask, merge, roll back, crop: :class:`posattn.window.GridWindows`) and keeps the
relative position table and index under torchvision's names, so its checkpoints load before and
after the swap. Swin V2 (``ShiftedWindowAttentionV2``, swin_v2_*) is refused: its attention is
cosine attention."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from einops import rearrange
from torch import nn

from ..grid import TokenGrid
from ..window import GridWindows
from .core import AttentionSite, OwnScheme, SwapPlan, described, imported, register_family
from .window_tables import COSINE_ATTENTION, WindowTableAttention, kept_table, table_phi, tables_of

_SWIN = 'torchvision.models.swin_transformer'


class TorchvisionWindowAttention(WindowTableAttention):
    """Called as torchvision's ``ShiftedWindowAttention``: (B, H, W, C) -> (B, H, W, C)."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'relative_position_bias_table')
        self.take_index(old)
        self.shift_size = list(old.shift_size)
        self.attn_drop.p, self.proj_drop.p = old.attention_dropout, old.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, W, C) -> (B, H, W, C): the attention within each (shifted) window."""
        height, width = x.shape[1:3]
        windows = self.windows_of(TokenGrid(height, width))
        shifted_pairs = windows.shift_mask(x.device)  # (num_windows, N, N) bool or None
        shift_mask = (None if shifted_pairs is None
                      else x.new_zeros(shifted_pairs.shape).masked_fill(shifted_pairs, -100.0))
        out = super().forward(windows.partition(rearrange(x, 'b h w c -> b (h w) c')), shift_mask)
        return rearrange(windows.merge(out), 'b (h w) c -> b h w c', h=height)

    def windows_of(self, grid: TokenGrid) -> GridWindows:
        """torchvision's windows of an H x W map: padded zeros that take part as keys, and no shift
        along a side that one window covers."""
        unshifted = GridWindows(grid, self.window_size)
        shift = tuple(0 if window >= padded else shift
                      for window, padded, shift in zip(self.window_size, unshifted.padded_hw, self.shift_size))
        return dataclasses.replace(unshifted, shift=shift)


@register_family(covers=("torchvision's SwinTransformer",))
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
    return SwapPlan(family='torchvision SwinTransformer', sites=sites, adapter=TorchvisionWindowAttention,
                    own=OwnScheme(relative=tables_of(sites), converted=table_phi, kept=kept_table))
