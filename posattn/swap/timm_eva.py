"""timm's ``Eva`` (EVA-02, the ``vit_*_rope_*`` and Perception Encoder models): the attention of
every ``EvaBlock`` / ``EvaBlockPostNorm``, timm's ``EvaAttention`` or ``AttentionRope``, with its
separate q/v biases or unfused projections, optional q/k norms, sub-LN (``norm``) and gate.

EVA-02 rotates the grid tokens' queries and keys by a rotary position embedding (RoPE, Su et al.
2021) that the model computes for the input's grid and hands to every block. The swapped layer
applies it as EVA does (after the q/k norms, prefix tokens untouched) when the model's own positions
are kept, and the Φp then sees the rotated queries and keys that the softmax uses; without them the
rotation is skipped and the absolute embedding zeroed.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from .core import AttentionSite, SwapPlan, described, imported, register_family
from .qkv_biases import SeparateBiasQkv
from .timm_vit import NormGateOutput, refuse_attention_mask

_EVA = 'timm.models.eva'


class EvaAttention(NormGateOutput, SeparateBiasQkv):
    """Called as EVA's blocks call their attention: ``attn(x, rope=None, attn_mask=None, is_causal=False)``."""

    def take_over(self, old: nn.Module) -> None:
        super().take_over(old)
        self.take(old, 'q_norm', 'k_norm', 'norm', 'gate')
        self.rotate_half = getattr(old, 'rotate_half', False)

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        refuse_attention_mask(attn_mask, is_causal)
        kept = rope is not None and self.own_positions
        return self.attention_output(x, rotation=functools.partial(self.rotate, rope=rope) if kept else None)

    def rotate(self, t: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """RoPE on the grid tokens of t (B, heads, N, d); the prefix tokens stay as they are."""
        apply_rot_embed_cat = imported('timm.layers', 'apply_rot_embed_cat')
        prefix, tokens = t.split([self.num_prefix_tokens, t.shape[2] - self.num_prefix_tokens], dim=2)
        return torch.cat([prefix, apply_rot_embed_cat(tokens, rope, half=self.rotate_half)], dim=2)


def _check_attention(i: int, attn: nn.Module, width: int, num_prefix_tokens: int) -> None:
    known = tuple(filter(None, (imported(_EVA, 'EvaAttention'), imported('timm.layers', 'AttentionRope'))))
    if not isinstance(attn, known):
        raise TypeError(f'block {i} holds {described(attn)}, not timm\'s EvaAttention or AttentionRope: '
                        'swap_attention replaces the attention of EVA\'s blocks only')
    if getattr(attn, 'num_kv_groups', 1) > 1:
        raise TypeError(f'block {i} shares each key and value head among {attn.num_kv_groups} query heads '
                        '(grouped-query attention, num_kv_heads): posattn.Attention has as many key heads as query heads')
    if attn.head_dim * attn.num_heads != width or attn.proj.out_features != width:
        raise TypeError(f'block {i} attends in {attn.num_heads} heads x {attn.head_dim} channels, not the model '
                        f'width {width} (attn_head_dim): posattn.Attention splits the width into its heads')
    if attn.num_prefix_tokens != num_prefix_tokens:
        raise ValueError(f'block {i} keeps RoPE off {attn.num_prefix_tokens} prefix tokens, but the model has '
                         f'{num_prefix_tokens}')


@register_family
def timm_eva(model: nn.Module) -> Optional[SwapPlan]:
    Eva = imported(_EVA, 'Eva')
    if Eva is None or not isinstance(model, Eva):
        return None
    if model.patch_drop is not None:
        raise ValueError('this timm Eva drops tokens while training (patch_drop_rate > 0), which breaks the '
                         'token grid a Φp is evaluated on: build it with patch_drop_rate=0')
    sites = []
    for i, block in enumerate(model.blocks):
        _check_attention(i, block.attn, model.embed_dim, model.num_prefix_tokens)
        sites.append(AttentionSite(block, 'attn', model.embed_dim, block.attn.num_heads, model.num_prefix_tokens))
    return SwapPlan('timm Eva', sites, EvaAttention, model.patch_embed.proj, [model.pos_embed])
