"""timm's ``Beit`` (BEiT, BEiT v2): the ``Attention`` of every block, with its separate q/v biases
and its relative position bias, a learned table over the offsets of the image's patch grid plus
three entries for the class token (Bao et al. 2022), per block or shared by all blocks
(``use_shared_rel_pos_bias``). Both are kept under timm's names unless the model's own positions
are dropped; BEiT's grid is fixed at construction, and ``set_input_size`` still resizes the tables
after the swap. With ``phi='own'`` each block's table becomes an ``rpb`` Φp's (the same Parameter,
saved under the Φp's name, loaded from timm's), or every block's Φp reads the shared one where the
model keeps it (saved once, under timm's name); ``set_input_size`` resizes them as timm does."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ..phi.rpb import RelativePositionBias
from .core import AttentionSite, SwapPlan, described, imported, register_family
from .qkv_biases import SeparateBiasQkv
from .window_tables import resize_table, table_phi

_BEIT = 'timm.models.beit'


class BeitAttention(SeparateBiasQkv):
    """Called as BEiT's blocks call their attention: ``attn(x, shared_rel_pos_bias=None)``."""

    def take_over(self, old: nn.Module) -> None:
        super().take_over(old)
        self.take(old, 'relative_position_bias_table', 'window_size')
        self.num_relative_distance = getattr(old, 'num_relative_distance', None)
        self.register_buffer('relative_position_index', old.relative_position_index, persistent=False)

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.attention_output(x, own_bias=self.own_bias(shared_rel_pos_bias))

    def own_bias(self, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The block's table bias (1, heads, N, N) plus the shared one, when the model's positions are kept."""
        if not self.own_positions:
            return None
        if self.relative_position_bias_table is None:
            return shared
        bias = imported(_BEIT, 'Attention')._get_rel_pos_bias(self)
        return bias if shared is None else bias + shared

    def set_window_size(self, window_size: Tuple[int, int]) -> None:
        """timm's own resize (``Beit.set_input_size`` calls it): the table is interpolated to the new grid,
        the Φp's table too after ``phi='own'`` (:func:`~posattn.swap.window_tables.resize_table`)."""
        Attention = imported(_BEIT, 'Attention')
        resize_table(self, lambda layer: Attention.set_window_size(layer, window_size))

    def _init_buffers(self) -> None:  # what timm's resize calls to rebuild the index
        imported(_BEIT, 'Attention')._init_buffers(self)


@register_family
def timm_beit(model: nn.Module) -> Optional[SwapPlan]:
    Beit = imported(_BEIT, 'Beit')
    if Beit is None or not isinstance(model, Beit):
        return None
    Attention = imported(_BEIT, 'Attention')
    sites = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if type(attn) is not Attention:
            raise TypeError(f'block {i} holds {described(attn)}, not timm\'s BEiT Attention: swap_attention '
                            'replaces the attention of BEiT\'s blocks only')
        if attn.proj.in_features != model.embed_dim:
            raise TypeError(f'block {i} attends in {attn.proj.in_features} channels, not the model width '
                            f'{model.embed_dim} (attn_head_dim): posattn.Attention splits the width into its heads')
        sites.append(AttentionSite(block, 'attn', model.embed_dim, attn.num_heads, model.num_prefix_tokens))
    tables = [site.module.relative_position_bias_table for site in sites]
    shared = list(model.rel_pos_bias.parameters()) if model.rel_pos_bias is not None else []
    own_phi = _own_phi(model.rel_pos_bias) if any(t is not None for t in tables) or shared else None
    return SwapPlan('timm Beit', sites, BeitAttention, model.patch_embed.proj, [model.pos_embed], tables + shared,
                    own_phi)


def _own_phi(shared: Optional[nn.Module]) -> Callable[[AttentionSite, int], RelativePositionBias]:
    """``phi='own'`` for a BEiT: each block's table as an ``rpb``, or the model's shared one (``shared``,
    timm's ``RelativePositionBias``) read by every block's ``rpb``."""
    def own_phi(site: AttentionSite, index: int) -> RelativePositionBias:
        table = site.module.relative_position_bias_table
        if table is not None and shared is not None:
            raise TypeError(f"phi='own' converts BEiT's relative position tables into one rpb per block, but block "
                            f'{index} adds its own table to the shared one (use_rel_pos_bias and '
                            'use_shared_rel_pos_bias): pick a Φp by name (\'none\' keeps both tables)')
        if table is not None:
            return table_phi(site, index)
        phi = RelativePositionBias(shared.relative_position_bias_table.shape[-1], shared.window_size,
                                   num_prefix_tokens=site.num_prefix_tokens)
        phi.share_table(shared)
        return phi
    return own_phi
