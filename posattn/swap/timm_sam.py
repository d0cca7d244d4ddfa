"""timm's ``VisionTransformerSAM`` (the ``samvit_*`` models: Segment Anything's image encoder, a ViTDet
backbone): the ``Attention`` of every block, over the tokens of a window (windowed blocks, whose
windows the block cuts and pads with zeros, which take part as keys) or of the whole map (the global
blocks, ``global_attn_indexes``). The attention takes and returns (B, H, W, C) tokens, so each call's
grid is its input's own (H, W): the Φp sees the window grid or the map's grid, at any input size.

The model's own relative positions are kept beside the Φp, under timm's names: the decomposed
relative position embeddings (``use_rel_pos``: ``rel_pos_h``, ``rel_pos_w``, a bias read by each
query, q_i · R_h[dy] + q_i · R_w[dx], through timm's ``get_decomposed_rel_pos_bias``) or the rotary
embedding (``use_rope``). With ``phi='own'`` the embeddings become a ``decomposed_rpb`` Φp's (the same
Parameters, saved under the Φp's names, loaded from timm's), which computes SAM's term, its linear
resampling at other input sizes included.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..attention import ProbabilityMixture
from ..grid import TokenGrid
from ..phi.decomposed_rpb import DecomposedRelativePositionBias
from .core import AttentionSite, SwapPlan, SwappedAttention, described, imported, register_family

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
        rotation = self.rotate if self.rope is not None and self.own_positions else None
        out = self.attention_output(x.reshape(batch, height * width, channels), TokenGrid(height, width),
                                    rotation=rotation)
        return out.view(batch, height, width, -1)

    def current_grid(self, grid: TokenGrid) -> TokenGrid:
        """The grid of this call, the (H, W) of its (B, H, W, C) input."""
        return grid

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """SAM's RoPE on the tokens of t (B, heads, N, d), for the grid its rotary module was built for."""
        return imported('timm.layers', 'apply_rot_embed_cat')(t, self.rope.get_embed())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: TokenGrid,
               key_mask: Optional[torch.Tensor] = None, own_bias: Optional[torch.Tensor] = None,
               own_mixture: Optional[ProbabilityMixture] = None, *,
               given: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        """:meth:`posattn.Attention.attend`, with SAM's decomposed relative position bias of the queries
        (B, heads, N, N) as the model's own bias where it is kept."""
        if self.rel_pos_h is not None and self.own_positions:
            get_decomposed_rel_pos_bias = imported(_SAM, 'get_decomposed_rel_pos_bias')
            size = (grid.height, grid.width)
            own_bias = get_decomposed_rel_pos_bias(q.flatten(0, 1), self.rel_pos_h, self.rel_pos_w, size, size)
            own_bias = own_bias.unflatten(0, q.shape[:2])
        return super().attend(q, k, v, grid, key_mask, own_bias, own_mixture, given=given)


def _own_phi(site: AttentionSite, index: int) -> DecomposedRelativePositionBias:
    """``phi='own'``: the ``decomposed_rpb`` holding the block's own embeddings."""
    return DecomposedRelativePositionBias.of_tables(site.module.rel_pos_h, site.module.rel_pos_w)


@register_family
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
    return SwapPlan('timm VisionTransformerSAM', sites, SamAttention, position_embeddings=[model.pos_embed],
                    position_parameters=tables, own_phi=_own_phi if relative and all(relative) else None)
