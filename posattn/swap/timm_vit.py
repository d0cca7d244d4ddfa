"""timm's ``VisionTransformer`` (ViT, DeiT, DeiT III, CLIP, DINOv2, FlexiViT, SigLIP, ...): every
``Block.attn`` a ``timm.layers.Attention``, with or without q/k norms, scale norm or gate, behind
any number of prefix tokens (class, distillation, registers). State-dict names stay timm's."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from .core import (AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention, described, imported,
                   register_family, register_refusal)

__all__ = ['TimmAttention', 'NormGateOutput', 'refuse_attention_mask', 'timm_attention_sites', 'class_token_readout']


def refuse_attention_mask(attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """A swapped timm attention attends over the whole grid: a mask given to it is an error."""
    if attn_mask is not None or is_causal:
        raise ValueError('a swapped attention takes no attention mask: the Φp is its positional bias')


class NormGateOutput(SwappedAttention):
    """timm's attention output: its ``norm`` (scale norm / sub-LN, an identity without one), then
    times ``sigmoid(gate(x))`` of the layer's input where the model has a ``gate``."""

    def before_projection(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(out)
        return out if self.gate is None else out * self.gate(x).sigmoid()


class TimmAttention(NormGateOutput):
    """Called as timm's ``Block`` calls ``timm.layers.Attention``: ``attn(x, attn_mask=None, is_causal=False)``."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'q_norm', 'k_norm', 'norm', 'gate', 'proj', 'attn_drop', 'proj_drop')

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        refuse_attention_mask(attn_mask, is_causal)
        return self.attention_output(x)


@register_family(covers=("timm's VisionTransformer",))
def timm_vision_transformer(model: nn.Module) -> Optional[SwapPlan]:
    VisionTransformer = imported('timm.models.vision_transformer', 'VisionTransformer')
    if VisionTransformer is None or not isinstance(model, VisionTransformer):
        return None
    sites = timm_attention_sites(model, 'VisionTransformer', not isinstance(model.patch_drop, nn.Identity),
                                 "timm's standard Block only")
    return SwapPlan(family='timm VisionTransformer', sites=sites, adapter=TimmAttention,
                    grid=GridSource(module=model.patch_embed.proj), own=OwnScheme(absolute=[model.pos_embed]),
                    prefix_readout=class_token_readout(model))


def class_token_readout(model: nn.Module) -> Optional[Tuple[str, str]]:
    """A timm ViT's :attr:`SwapPlan.prefix_readout`: with ``global_pool='token'`` its head reads the class
    token alone (timm's ``x[:, 0]``); None for the other poolings, which read the grid tokens."""
    if model.global_pool != 'token':
        return None
    return ("its head classifies the class token alone (global_pool='token')",
            "timm.create_model(..., global_pool='avg'), or model.reset_classifier(num_classes, 'avg')")


def timm_attention_sites(model: nn.Module, name: str, drops_tokens: bool, replaced: str) -> List[AttentionSite]:
    """The ``attn`` of every block of a timm ViT (``model.blocks``), each a ``timm.layers.Attention``
    that splits the model's width into its heads; a model that drops tokens (``drops_tokens``) or a
    block that holds another attention (the blocks swapped: ``replaced``) is refused."""
    Attention = imported('timm.layers', 'Attention')
    if drops_tokens:
        raise ValueError(f'this timm {name} drops tokens while training (patch_drop_rate > 0), which breaks '
                         'the token grid a Φp is evaluated on: build it with patch_drop_rate=0')
    sites = []
    for i, block in enumerate(model.blocks):
        attn = getattr(block, 'attn', None)
        if not isinstance(attn, Attention):
            raise TypeError(f'block {i} ({described(block)}) holds {described(attn)}, not timm.layers.Attention: '
                            f'swap_attention replaces the attention of {replaced}')
        if attn.attn_dim != attn.qkv.in_features:
            raise TypeError(f'block {i} attends in {attn.num_heads} heads x {attn.head_dim} channels, not the '
                            f'model width {attn.qkv.in_features} (attn_head_dim): posattn.Attention splits '
                            'the width into its heads')
        sites.append(AttentionSite(block, 'attn', attn.qkv.in_features, attn.num_heads, model.num_prefix_tokens))
    return sites


# timm's models whose attention is not self-attention over one token grid
for _model, _reason in {
    'timm.models.cait.Cait': "CaiT's class-attention layers attend from the class token alone, and its "
                             'talking-heads attention mixes heads around the softmax',
    'timm.models.xcit.Xcit': "XCiT's cross-covariance attention attends between channels, not between tokens",
    'timm.models.levit.Levit': "LeViT's attention subsamples its queries between stages and carries its own "
                               'learned biases on a shrinking grid; its blocks see no patch-grid sequence',
    'timm.models.pit.PoolingVisionTransformer': "PiT's blocks take tokens whose grid is pooled by strided "
                                                'convolutions between stages, with the class tokens carried aside',
    'timm.models.twins.Twins': "Twins alternates locally grouped attention with global attention whose keys "
                               'come from a strided convolution: the keys are not the query grid',
}.items():
    register_refusal(_model, _reason)
