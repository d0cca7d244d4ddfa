"""timm's ``VisionTransformerRelPos`` (the ``vit_relpos_*`` and ``vit_srelpos_*`` models): the
``RelPosAttention`` of every block, with optional q/k norms, and the model's relative position bias,
from a table (``RelPosBias``) or a small network of log-spaced offsets (``RelPosMlp``), per block
(``attn.rel_pos``) or shared by all blocks (``shared_rel_pos``). The bias, computed by timm's module
(kept under timm's names), is the first Φp of each layer's stack while the model's own positions
are kept (:class:`~posattn.swap.given.GivenBias`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .core import AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention, described, imported, register_family
from .given import GivenBias
from .timm_vit import class_token_readout

_RELPOS = 'timm.models.vision_transformer_relpos'


class RelPosAttention(SwappedAttention):
    """Called as the blocks of ``VisionTransformerRelPos`` call their attention: ``attn(x, shared_rel_pos=None)``."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'q_norm', 'k_norm', 'rel_pos', 'attn_drop', 'proj', 'proj_drop')

    def forward(self, x: torch.Tensor, shared_rel_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.attention_output(x, rel_pos_bias=self.rel_pos_bias(shared_rel_pos))

    def rel_pos_bias(self, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The block's relative position bias (heads, N, N), or the model's shared one, where the Φp
        reads it (the model's own positions kept)."""
        if not self.reads('rel_pos_bias'):
            return None
        return self.rel_pos.get_bias() if self.rel_pos is not None else shared


@register_family(covers=("timm's VisionTransformerRelPos",))
def timm_vision_transformer_relpos(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformerRelPos = imported(_RELPOS, 'VisionTransformerRelPos')
    if VisionTransformerRelPos is None or not isinstance(model, VisionTransformerRelPos):
        return None
    Attention = imported(_RELPOS, 'RelPosAttention')
    sites = []
    for i, block in enumerate(model.blocks):
        if type(block.attn) is not Attention:
            raise TypeError(f'block {i} holds {described(block.attn)}, not timm\'s RelPosAttention: '
                            'swap_attention replaces the attention of VisionTransformerRelPos\'s blocks only')
        sites.append(AttentionSite(block, 'attn', model.embed_dim, block.attn.num_heads, model.num_prefix_tokens))
    biases = [site.module.rel_pos for site in sites] + [model.shared_rel_pos]
    position_parameters = [p for bias in biases if bias is not None for p in bias.parameters()]
    relative = model.shared_rel_pos is not None or any(site.module.rel_pos is not None for site in sites)
    return SwapPlan(family='timm VisionTransformerRelPos', sites=sites, adapter=RelPosAttention,
                    grid=GridSource(module=model.patch_embed.proj),
                    own=OwnScheme(relative=position_parameters,
                                  kept=lambda site, index: [GivenBias('rel_pos_bias')] if relative else []),
                    prefix_readout=class_token_readout(model))
