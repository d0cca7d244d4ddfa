"""The OpenMMLab ViTs as :func:`posattn.swap_attention` families.

* mmpretrain's ``VisionTransformer`` and its subclasses with the same layers: DeiT
  (``arch='deit-small'`` and the other ``deit-*`` sizes), the distilled DeiT
  (``DistilledVisionTransformer``: class and distillation tokens), ``DeiT3`` (layer scale) and
  MoCo v3's ViT. Every ``layers[i].attn`` is mmpretrain's ``MultiheadAttention``; state-dict
  names stay mmpretrain's, so its checkpoints load into the swapped model (Φp keys aside).
* mmseg's ``VisionTransformer`` (UPerNet, SETR, DPT): every ``layers[i].attn`` is mmcv's
  ``MultiheadAttention``, a wrapper around ``nn.MultiheadAttention`` that adds the residual.
  Its ``attn.in_proj_weight`` / ``attn.out_proj`` become ``qkv`` / ``proj`` (the same tensors,
  rows [q; k; v] with the heads inside, as posattn splits them): mmseg checkpoints load before
  the swap (``PosattnSwappedBackbone`` loads them so), the swapped model's own after it.

Neither module is imported here: a family recognises a model only once its library is loaded.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from posattn.swap import AttentionSite, GridSource, OwnScheme, SwapPlan, register_family
from posattn.swap.core import SwappedAttention, packs_self_attention
from posattn.swap.core import described, imported

__all__ = ['MMPretrainAttention', 'MMCVAttention', 'mmpretrain_vision_transformer', 'mmseg_vision_transformer']


class MMPretrainAttention(SwappedAttention):
    """Called as mmpretrain's ``TransformerEncoderLayer`` calls its ``MultiheadAttention``:
    ``attn(x)`` -> ``out_drop(gamma1(proj_drop(proj(attention))))``, the residual added by the layer
    (``out_drop`` is the layer's stochastic depth, ``gamma1`` its layer scale or an identity)."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'proj_drop', 'out_drop', 'gamma1')
        self.attn_drop.p = old.attn_drop  # a probability there, a Dropout here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_drop(self.gamma1(self.attention_output(x)))


class MMCVAttention(SwappedAttention):
    """Called as mmseg's ``TransformerEncoderLayer`` calls mmcv's ``MultiheadAttention``:
    ``attn(x, identity=x)`` -> ``identity + dropout_layer(proj_drop(proj(attention)))``, batch first
    (``dropout_layer`` is the layer's stochastic depth or an identity)."""

    def take_over(self, old: nn.Module) -> None:
        self.take_multihead(old.attn)
        self.take(old, 'proj_drop', 'dropout_layer')

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                identity: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if any(t is not None and t is not query for t in (key, value)):
            raise ValueError('a swapped attention is self-attention: key and value must be None or the query')
        given = sorted(name for name, v in kwargs.items() if v is not None)
        if given:
            raise ValueError(f'a swapped attention takes no positional inputs or masks (the Φp is its '
                             f'positional term); got {given}')
        out = self.attention_output(query, identity)
        return (query if identity is None else identity) + self.dropout_layer(out)


def _mmpretrain_attention_refusal(attn: nn.Module) -> Optional[str]:
    """Why posattn cannot reproduce this mmpretrain ``MultiheadAttention``, or None."""
    if attn.v_shortcut:
        return 'adds its values to the output (v_shortcut=True), a term posattn\'s attention does not have'
    if attn.input_dims != attn.embed_dims:
        return (f'projects {attn.input_dims} input channels to {attn.embed_dims} (input_dims): posattn attends '
                'in the width of its input')
    if isinstance(attn.scaled_dot_product_attention, functools.partial):
        return ('was built with qk_scale, which mmpretrain turns into logits multiplied by sqrt(head_dim) '
                'instead of divided: build it with qk_scale=None')
    return None


@register_family(covers=("mmpretrain's VisionTransformer",))
def mmpretrain_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformer = imported('mmpretrain.models.backbones.vision_transformer', 'VisionTransformer')
    if VisionTransformer is None or not isinstance(model, VisionTransformer):
        return None
    MAEViT = imported('mmpretrain.models.selfsup.mae', 'MAEViT')
    if MAEViT is not None and isinstance(model, MAEViT):
        raise TypeError(f'cannot swap {described(model)}: it drops the masked patches in its forward (MAE '
                        'pre-training), so its layers see no whole token grid; swap a VisionTransformer '
                        'built from its weights instead')
    Attention = imported('mmpretrain.models.utils.attention', 'MultiheadAttention')
    sites = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, 'attn', None)
        if not isinstance(attn, Attention):
            raise TypeError(f'layer {i} ({described(layer)}) holds {described(attn)}, not mmpretrain\'s '
                            'MultiheadAttention: swap_attention replaces the attention of mmpretrain\'s '
                            'ViT layers only')
        refusal = _mmpretrain_attention_refusal(attn)
        if refusal is not None:
            raise ValueError(f'cannot swap the attention of layer {i} of {described(model)}: it {refusal}')
        sites.append(AttentionSite(layer, 'attn', attn.embed_dims, attn.num_heads, model.num_extra_tokens))
    return SwapPlan(family='mmpretrain VisionTransformer', sites=sites, adapter=MMPretrainAttention,
                    grid=GridSource(module=model.patch_embed.projection), own=OwnScheme(absolute=[model.pos_embed]))


@register_family(covers=("mmseg's VisionTransformer",))
def mmseg_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformer = imported('mmseg.models.backbones.vit', 'VisionTransformer')
    if VisionTransformer is None or not isinstance(model, VisionTransformer):
        return None
    Attention = imported('mmcv.cnn.bricks.transformer', 'MultiheadAttention')
    sites = []
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, 'attn', None)
        if not isinstance(attn, Attention):
            raise TypeError(f'layer {i} ({described(layer)}) holds {described(attn)}, not mmcv\'s '
                            'MultiheadAttention: swap_attention replaces the attention of mmseg\'s ViT layers only')
        if not (attn.batch_first and packs_self_attention(attn.attn)):
            raise TypeError(f'layer {i} of {described(model)} has an mmcv MultiheadAttention that is not batch-first '
                            'self-attention with packed q/k/v projections and no added keys')
        sites.append(AttentionSite(layer, 'attn', attn.embed_dims, attn.num_heads, int(model.with_cls_token)))
    return SwapPlan(family='mmseg VisionTransformer', sites=sites, adapter=MMCVAttention,
                    grid=GridSource(module=model.patch_embed.projection), own=OwnScheme(absolute=[model.pos_embed]))
