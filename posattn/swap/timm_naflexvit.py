"""timm's ``NaFlexVit``: every ``Block.attn`` a ``timm.layers.Attention``. Given a NaFlex batch
(patches, ``patch_coord``, ``patch_valid``), each image attends within its own grid: the layer
reads the batch's :class:`~posattn.layout.ImageLayout` from the call of the model's ``embeds`` and
checks that the model's padding mask is the one that layout implies. Given images (B, C, H, W),
every image has the one grid. State-dict names stay timm's."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from ..layout import ImageLayout
from .core import AttentionSite, SwapPlan, described, imported, register_family
from .timm_vit import TimmAttention, refuse_attention_mask

__all__ = ['NaFlexAttention', 'naflex_grid', 'check_padding_mask']

_checked_mask = weakref.ref(torch.empty(0))  # the latest mask found to be a layout's: checked once per call


def naflex_grid(embeds: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                output: Tuple[torch.Tensor, Optional[Tuple[int, int]]]) -> Union[Tuple[int, int], ImageLayout]:
    """The grid of a call of ``NaFlexEmbeds``: its (H, W) for images, else the layout of the NaFlex batch."""
    tokens, grid_size = output
    if grid_size is not None:
        return grid_size[0], grid_size[1]
    named = dict(zip(('x', 'patch_coord', 'patch_valid'), args), **kwargs)
    return ImageLayout.from_patch_coords(named['patch_coord'], named.get('patch_valid'), embeds.num_prefix_tokens)


def check_padding_mask(attn_mask: torch.Tensor, layout: ImageLayout) -> None:
    """Raise a ValueError unless ``attn_mask`` (B, 1, L or 1, L; additive, or bool True = attend) lets
    every token of an image attend to exactly the tokens of its image, as NaFlexViT's padding
    mask does (rows of padding may hold anything)."""
    global _checked_mask
    if _checked_mask() is attn_mask or torch.compiler.is_compiling():
        return
    batch, length = attn_mask.shape[0], attn_mask.shape[-1]
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or length != layout.length or batch < layout.num_rows:
        raise ValueError(f'a padding mask of shape {tuple(attn_mask.shape)} does not fit the {layout}')
    if attn_mask.dtype == torch.bool:
        attend, blocked = attn_mask, ~attn_mask
    else:
        attend, blocked = attn_mask == 0, attn_mask <= torch.finfo(attn_mask.dtype).min / 2
    valid = layout.valid(batch, attn_mask.device)
    keys = valid[:, None, None, :]
    queries = valid[:, None, :, None] if attn_mask.shape[2] == length else True
    if not torch.where(queries, torch.where(keys, attend, blocked), True).all():
        raise ValueError('the attention mask is not the padding mask of the NaFlex batch: a swapped NaFlexVit '
                         'attends within each image of patch_coord and patch_valid, and takes no other mask')
    _checked_mask = weakref.ref(attn_mask)


class NaFlexAttention(TimmAttention):
    """Called as ``timm.layers.Attention`` in a NaFlexViT block: ``attn(x, attn_mask=None, is_causal=False)``,
    the mask that of the NaFlex batch's padding."""

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        where = self.current_grid(x)
        if isinstance(where, ImageLayout) and not is_causal:
            if attn_mask is not None:
                check_padding_mask(attn_mask, where)
        else:
            refuse_attention_mask(attn_mask, is_causal)
        return self.attention_output(x)


@register_family
def timm_naflexvit(model: nn.Module) -> Optional[SwapPlan]:
    NaFlexVit = imported('timm.models.naflexvit', 'NaFlexVit')
    if NaFlexVit is None or not isinstance(model, NaFlexVit):
        return None
    Attention = imported('timm.layers', 'Attention')
    if model.patch_drop is not None:
        raise ValueError('this timm NaFlexVit drops tokens while training (patch_drop_rate > 0), which breaks '
                         'the token grid a Φp is evaluated on: build it with patch_drop_rate=0')
    sites = []
    for i, block in enumerate(model.blocks):
        attn = getattr(block, 'attn', None)
        if not isinstance(attn, Attention):
            raise TypeError(f'block {i} ({described(block)}) holds {described(attn)}, not timm.layers.Attention: '
                            'swap_attention replaces the attention of NaFlexViT\'s standard Block only (not its '
                            'EVA and RoPE blocks)')
        if attn.attn_dim != attn.qkv.in_features:
            raise TypeError(f'block {i} attends in {attn.num_heads} heads x {attn.head_dim} channels, not the '
                            f'model width {attn.qkv.in_features}: posattn.Attention splits the width into its heads')
        sites.append(AttentionSite(block, 'attn', attn.qkv.in_features, attn.num_heads, model.num_prefix_tokens))
    embeds = model.embeds
    positions = [getattr(embeds, name, None) for name in ('pos_embed', 'pos_embed_y', 'pos_embed_x')]
    return SwapPlan('timm NaFlexVit', sites, NaFlexAttention, embeds, [p for p in positions if p is not None],
                    patch_grid=naflex_grid)
