"""timm's ``NaFlexVit``: every ``Block.attn`` a ``timm.layers.Attention``. Given a NaFlex batch
(patches, ``patch_coord``, ``patch_valid``), each image attends within its own grid: the layer
reads the batch's :class:`~posattn.layout.ImageLayout` from the call of the model's ``embeds``
and checks that the model's padding mask is the one that layout implies
(:func:`~posattn.swap.core.check_padding_mask`). Given images (B, C, H, W), every image has the
one grid. State-dict names stay timm's."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch import nn

from ..layout import ImageLayout
from .core import GridSource, OwnScheme, SwapPlan, check_padding_mask, imported, register_family
from .timm_vit import TimmAttention, class_token_readout, refuse_attention_mask, timm_attention_sites

__all__ = ['NaFlexAttention', 'naflex_grid']


def naflex_grid(embeds: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                output: Tuple[torch.Tensor, Optional[Tuple[int, int]]]) -> Union[Tuple[int, int], ImageLayout]:
    """The grid of a call of ``NaFlexEmbeds``: its (H, W) for images, else the layout of the NaFlex batch."""
    tokens, grid_size = output
    if grid_size is not None:
        return grid_size[0], grid_size[1]
    named = dict(zip(('x', 'patch_coord', 'patch_valid'), args), **kwargs)
    return ImageLayout.from_patch_coords(named['patch_coord'], named.get('patch_valid'), embeds.num_prefix_tokens)


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


@register_family(covers=("timm's NaFlexVit",))
def timm_naflexvit(model: nn.Module) -> Optional[SwapPlan]:
    NaFlexVit = imported('timm.models.naflexvit', 'NaFlexVit')
    if NaFlexVit is None or not isinstance(model, NaFlexVit):
        return None
    sites = timm_attention_sites(model, 'NaFlexVit', model.patch_drop is not None,
                                 "NaFlexViT's standard Block only (not its EVA and RoPE blocks)")
    embeds = model.embeds
    positions = [getattr(embeds, name, None) for name in ('pos_embed', 'pos_embed_y', 'pos_embed_x')]
    return SwapPlan(family='timm NaFlexVit', sites=sites, adapter=NaFlexAttention,
                    grid=GridSource(module=embeds, read=naflex_grid), own=OwnScheme(absolute=positions),
                    prefix_readout=class_token_readout(model))
