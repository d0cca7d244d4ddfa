"""timm's ``VisionTransformerSAM`` (the ``samvit_*`` models: Segment Anything's image encoder, a ViTDet
backbone): the ``Attention`` of every block, over the tokens of a window (windowed blocks, whose
windows the block cuts and pads with zeros, which take part as keys) or of the whole map (the global
blocks, ``global_attn_indexes``). The attention takes and returns (B, H, W, C) tokens, so each call's
grid is its input's own (H, W): the Φp sees the window grid or the map's grid, at any input size.

The model's own relative positions stay under timm's names, and while they are kept the first
member of each layer's Φp applies them: the decomposed relative position embeddings (``use_rel_pos``:
``rel_pos_h``, ``rel_pos_w``, a bias read by each query, q_i · R_h[dy] + q_i · R_w[dx], through
timm's ``get_decomposed_rel_pos_bias``; :class:`GivenDecomposedBias`) or the rotary embedding
(``use_rope``, computed by the block's rotary module; :class:`~posattn.swap.given.GivenRotation`). With ``phi='own'`` the embeddings become a ``decomposed_rpb`` Φp's (the same
Parameters, saved under the Φp's names, loaded from timm's), which computes SAM's term, its linear
resampling at other input sizes included.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..grid import TokenGrid
from ..phi import PositionalModule
from ..phi.decomposed_rpb import DecomposedRelativePositionBias
from .core import AttentionSite, OwnScheme, SwapPlan, SwappedAttention, described, imported, register_family
from .given import GivenRotation

_SAM = 'timm.models.vision_transformer_sam'


class SamAttention(SwappedAttention):
    """Called as SAM's blocks call their attention: (B, H, W, C) -> (B, H, W, C)."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'q_norm', 'k_norm', 'attn_drop', 'proj', 'proj_drop', 'rope')
        self.rel_pos_h = old.rel_pos_h if old.use_rel_pos else None
        self.rel_pos_w = old.rel_pos_w if old.use_rel_pos else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, H, W, C), a window or the whole map -> the layer's output (B, H, W, C)."""
        batch, height, width, channels = x.shape
        tokens = x.reshape(batch, height * width, channels)
        rope = self.rope.get_embed() if self.reads('rope') else None
        tables = dict(rel_pos_h=self.rel_pos_h, rel_pos_w=self.rel_pos_w) if self.reads('rel_pos_h') else {}
        out = self.attention_output(tokens, TokenGrid(height, width), rope=rope, **tables)
        return out.view(batch, height, width, -1)

    def current_grid(self, grid: TokenGrid) -> TokenGrid:
        """The grid of this call, the (H, W) of its (B, H, W, C) input."""
        return grid


class GivenDecomposedBias(PositionalModule):
    """SAM's decomposed relative position bias, from the block's own embeddings given with the call
    (``rel_pos_h``, ``rel_pos_w``, which stay the layer's, under timm's names): the bias of query i
    and key j is q_i · R_h[dy] + q_i · R_w[dx], by timm's ``get_decomposed_rel_pos_bias``, (B, heads,
    N, N). It owns nothing."""

    def __init__(self):
        super().__init__(hooks=('logits_bias',), call_inputs=('rel_pos_h', 'rel_pos_w'))

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid, rel_pos_h: Optional[torch.Tensor] = None,
                    rel_pos_w: Optional[torch.Tensor] = None) -> torch.Tensor:
        if rel_pos_h is None or rel_pos_w is None:
            raise ValueError('this layer adds its SAM block\'s decomposed relative positions, which the block gives '
                             'with each call (rel_pos_h=, rel_pos_w=); it was called without them')
        size = (grid.height, grid.width)
        bias = imported(_SAM, 'get_decomposed_rel_pos_bias')(q.flatten(0, 1), rel_pos_h, rel_pos_w, size, size)
        return bias.unflatten(0, q.shape[:2])


def _kept_phi(site: AttentionSite, index: int) -> List[PositionalModule]:
    """SAM's own scheme kept beside a named Φp: its RoPE, or its decomposed embeddings."""
    attn = site.module
    if getattr(attn, 'rope', None) is not None:
        return [GivenRotation()]
    return [GivenDecomposedBias()] if attn.use_rel_pos else []


def _own_phi(site: AttentionSite, index: int) -> DecomposedRelativePositionBias:
    """``phi='own'``: the ``decomposed_rpb`` holding the block's own embeddings."""
    return DecomposedRelativePositionBias.of_tables(site.module.rel_pos_h, site.module.rel_pos_w)


@register_family(covers=("timm's VisionTransformerSAM",))
def timm_sam(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformerSAM = imported(_SAM, 'VisionTransformerSAM')
    if VisionTransformerSAM is None or not isinstance(model, VisionTransformerSAM):
        return None
    Attention = imported(_SAM, 'Attention')
    sites = []
    for i, block in enumerate(model.blocks):
        attn = getattr(block, 'attn', None)
        if type(attn) is not Attention:
            raise TypeError(f'block {i} holds {described(attn)}, not timm\'s SAM Attention: swap_attention replaces '
                            'the attention of VisionTransformerSAM\'s blocks only')
        sites.append(AttentionSite(block, 'attn', model.embed_dim, attn.num_heads))
    relative = [site.module.use_rel_pos for site in sites]
    tables = [p for site in sites if site.module.use_rel_pos for p in (site.module.rel_pos_h, site.module.rel_pos_w)]
    return SwapPlan(family='timm VisionTransformerSAM', sites=sites, adapter=SamAttention,
                    own=OwnScheme(absolute=[model.pos_embed], relative=tables,
                                  converted=_own_phi if relative and all(relative) else None, kept=_kept_phi))
