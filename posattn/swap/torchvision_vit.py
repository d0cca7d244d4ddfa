"""torchvision's ``VisionTransformer`` (vit_b_16 ... vit_h_14): ``nn.MultiheadAttention`` in every
``EncoderBlock``. Its ``in_proj_weight`` / ``out_proj`` become ``qkv`` / ``proj`` (the same
tensors: rows [q; k; v] with the heads inside, as posattn splits them), so torchvision checkpoints
load before the swap and the swapped model's own checkpoints after it."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from .core import (AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention, described, imported,
                   packs_self_attention, register_family)


class TorchvisionAttention(SwappedAttention):
    """Called as ``nn.MultiheadAttention`` in torchvision's ``EncoderBlock``: batch-first
    self-attention, ``(out, None)`` returned."""

    def take_over(self, old: nn.MultiheadAttention) -> None:
        self.take_multihead(old)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                need_weights: bool = False, **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if not (query is key is value):
            raise ValueError('a swapped attention is self-attention: query, key and value must be the same tensor')
        if need_weights or any(v is not None and v is not False for v in kwargs.values()):
            raise ValueError(f'a swapped attention returns no weights and takes no masks; got '
                             f'need_weights={need_weights}, {sorted(kwargs)}')
        return self.attention_output(query), None


@register_family(covers=("torchvision's VisionTransformer",))
def torchvision_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformer = imported('torchvision.models.vision_transformer', 'VisionTransformer')
    if VisionTransformer is None or not isinstance(model, VisionTransformer):
        return None
    sites = []
    for i, block in enumerate(model.encoder.layers):
        attn = getattr(block, 'self_attention', None)
        if not isinstance(attn, nn.MultiheadAttention):
            raise TypeError(f'encoder layer {i} of the torchvision model holds {described(attn)}; '
                            'swap_attention replaces nn.MultiheadAttention only')
        if not (attn.batch_first and packs_self_attention(attn) and attn.in_proj_bias is not None):
            raise TypeError(f'encoder layer {i} of the torchvision model has a MultiheadAttention that is not '
                            'batch-first self-attention with packed, biased q/k/v projections')
        sites.append(AttentionSite(block, 'self_attention', attn.embed_dim, attn.num_heads, 1))
    return SwapPlan(family='torchvision VisionTransformer', sites=sites, adapter=TorchvisionAttention,
                    grid=GridSource(module=model.conv_proj), own=OwnScheme(absolute=[model.encoder.pos_embedding]),
                    prefix_readout=("its head classifies the class token alone (torchvision's VisionTransformer "
                                    'always does)', ''))
