"""timm's ``Beit`` (BEiT, BEiT v2): the ``Attention`` of every block, with its separate q/v biases
and its relative position bias, a learned table over the offsets of the image's patch grid plus
three entries for the class token (Bao et al. 2022), per block or shared by all blocks
(``use_shared_rel_pos_bias``). Both stay under timm's names, and while the model's own positions
are kept the first members of each layer's Φp add them (:class:`~posattn.swap.given.GivenBias`: the
block's table bias as the layer computes it, the shared one as the model gives it); BEiT's grid is fixed at construction, and ``set_input_size`` still resizes the tables
after the swap. With ``phi='own'`` each block's table becomes an ``rpb`` Φp's (the same Parameter,
saved under the Φp's name, loaded from timm's), or, where the model keeps one shared table (saved
once, under timm's name), every block's Φp is a :class:`GivenBias` that adds the bias the model
computes from it and gives each block; ``set_input_size`` resizes them as timm does."""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import torch
from einops import rearrange
from torch import nn

from ..phi import PositionalModule
from ..phi.rpb import NUM_PREFIX_ENTRIES, num_offsets, relative_position_index
from .core import AttentionSite, GridSource, OwnScheme, SwapPlan, described, imported, register_family
from .given import GivenBias
from .qkv_biases import SeparateBiasQkv
from .timm_vit import class_token_readout
from .window_tables import RELATIVE_POSITION_BIAS, resize_table, table_phi

_BEIT = 'timm.models.beit'


class BeitAttention(SeparateBiasQkv):
    """Called as BEiT's blocks call their attention: ``attn(x, shared_rel_pos_bias=None)``."""

    def take_over(self, old: nn.Module) -> None:
        super().take_over(old)
        self.take(old, 'relative_position_bias_table', 'window_size')
        self.num_relative_distance = getattr(old, 'num_relative_distance', None)

    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        table = self.relative_position_bias_table
        bias = beit_relative_position_bias(table, self.window_size) if self.reads(RELATIVE_POSITION_BIAS) else None
        return self.attention_output(x, relative_position_bias=bias, shared_rel_pos_bias=shared_rel_pos_bias)

    def set_window_size(self, window_size: Tuple[int, int]) -> None:
        """What timm's ``Attention.set_window_size`` does (``Beit.set_input_size`` calls it): the table is
        interpolated to the new grid by timm's ``resize_rel_pos_bias_table`` (a new Parameter, the three
        class-token rows kept), the Φp's table too after ``phi='own'``
        (:func:`~posattn.swap.window_tables.resize_table`). The index follows ``window_size``."""
        window_size = (window_size, window_size) if isinstance(window_size, int) else tuple(window_size)
        if self.window_size is None or window_size == tuple(self.window_size):
            return
        resize_table(self, lambda layer: _resize_beit_table(layer, window_size))


def beit_relative_position_bias(table: torch.Tensor, window_size: Tuple[int, int]) -> torch.Tensor:
    """BEiT's relative position bias of one (class token + wh x ww grid) sequence: (1, heads, N, N),
    N = 1 + wh * ww, ``bias[0, h, i, j] = table[index[i, j], h]``.

    ``table`` is timm's ``relative_position_bias_table``, ((2 wh - 1)(2 ww - 1) + 3, heads), and
    ``index`` posattn's :func:`~posattn.phi.rpb.relative_position_index` with one prefix token,
    which is BEiT's (a grid pair reads its offset's row; then the rows for class query -> grid key,
    grid query -> class key, class -> class).
    """
    index = relative_position_index(*window_size, 1, table.device)  # (N, N)
    return rearrange(table[index.reshape(-1)], '(n m) h -> 1 h n m', n=index.shape[0])


def _resize_beit_table(layer: BeitAttention, window_size: Tuple[int, int]) -> None:
    """The layer's table, learned for ``layer.window_size``, resampled as timm resamples BEiT's for a
    ``window_size`` grid (bicubic over the offsets, the three class-token rows kept)."""
    from timm.layers import resize_rel_pos_bias_table  # a timm model is being resized: timm is there

    table = layer.relative_position_bias_table
    rows = num_offsets(*window_size) + NUM_PREFIX_ENTRIES
    with torch.no_grad():
        resized = resize_rel_pos_bias_table(table, new_window_size=window_size, new_bias_shape=(rows, table.shape[-1]),
                                            old_window_size=tuple(layer.window_size))
    layer.relative_position_bias_table = nn.Parameter(resized, requires_grad=table.requires_grad)
    layer.window_size = window_size
    layer.num_relative_distance = rows


@register_family(covers=("timm's Beit",))
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
    return SwapPlan(family='timm Beit', sites=sites, adapter=BeitAttention,
                    grid=GridSource(module=model.patch_embed.proj),
                    own=OwnScheme(absolute=[model.pos_embed], relative=tables + shared, converted=own_phi,
                                  kept=functools.partial(_kept_phi, model.rel_pos_bias is not None)),
                    prefix_readout=class_token_readout(model))


def _own_phi(shared: Optional[nn.Module]) -> Callable[[AttentionSite, int], PositionalModule]:
    """``phi='own'`` for a BEiT: each block's table as an ``rpb``, or, with the model's one shared table
    (``shared``, timm's ``RelativePositionBias``), the bias the model gives each block (:class:`GivenBias`)."""
    def own_phi(site: AttentionSite, index: int) -> PositionalModule:
        table = site.module.relative_position_bias_table
        if table is not None and shared is not None:
            raise TypeError(f"phi='own' converts BEiT's relative position tables into one rpb per block, but block "
                            f'{index} adds its own table to the shared one (use_rel_pos_bias and '
                            'use_shared_rel_pos_bias): pick a Φp by name (\'none\' keeps both tables)')
        if table is not None:
            return table_phi(site, index)
        return GivenBias(SHARED_BIAS)
    return own_phi


SHARED_BIAS = 'shared_rel_pos_bias'  # what BEiT's model gives each block, from its one shared table


def _kept_phi(shared: bool, site: AttentionSite, index: int) -> List[PositionalModule]:
    """BEiT's own scheme kept beside a named Φp: the block's table bias, which the layer computes, and
    the shared bias, which the model gives each block (``shared``: it has one), where the model has them."""
    kept: List[PositionalModule] = []
    if site.module.relative_position_bias_table is not None:
        kept.append(GivenBias(RELATIVE_POSITION_BIAS))
    if shared:
        kept.append(GivenBias(SHARED_BIAS))
    return kept
