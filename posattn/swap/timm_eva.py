"""timm's ``Eva`` (EVA-02, the ``vit_*_rope_*`` and Perception Encoder models): the attention of
every ``EvaBlock`` / ``EvaBlockPostNorm``, timm's ``EvaAttention`` or ``AttentionRope``, with its
separate q/v biases or unfused projections, optional q/k norms, sub-LN (``norm``) and gate.

EVA-02 rotates the grid tokens' queries and keys by a rotary position embedding (RoPE, Su et al.
2021) that the model computes for the input's grid and hands to every block. While the model's own
positions are kept, the first Φp of each swapped layer applies it as EVA does
(:class:`~posattn.swap.given.GivenRotation`: after the q/k norms, prefix tokens untouched), and the
named Φp then sees the rotated queries and keys that the softmax uses; without them the rotation
is skipped and the absolute embedding zeroed.

``swap_attention(model, phi='own')`` converts the model's RoPE into a Φp of every layer
(:func:`own_rope`): timm's ``RotaryEmbeddingCat`` (EVA-02, the axial ``vit_*_rope_*`` and
Perception Encoder models) into the ``rope`` Φp with the model's settings, which computes it;
``RotaryEmbeddingMixed`` (RoPE-Mixed), whose learned frequencies the model owns (``rope.freqs``,
one slice a layer) and turns into each layer's rotation at every call, into
:class:`GivenRotation`, which applies the rotation the model gives the layer (``rope=``).
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import nn

from ..phi import PositionalModule
from ..phi.rope import RotaryPositionEmbedding
from .core import AttentionSite, GridSource, OwnScheme, SwapPlan, described, imported, register_family
from .given import GivenRotation
from .qkv_biases import SeparateBiasQkv
from .timm_vit import NormGateOutput, class_token_readout, refuse_attention_mask

_EVA = 'timm.models.eva'


class EvaAttention(NormGateOutput, SeparateBiasQkv):
    """Called as EVA's blocks call their attention: ``attn(x, rope=None, attn_mask=None, is_causal=False)``."""

    def take_over(self, old: nn.Module) -> None:
        super().take_over(old)
        self.take(old, 'q_norm', 'k_norm', 'norm', 'gate')

    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        refuse_attention_mask(attn_mask, is_causal)
        return self.attention_output(x, rope=rope)


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


@register_family(covers=("timm's Eva",))
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
    own_phi = functools.partial(own_rope, model) if model.rope is not None else None
    kept_phi = functools.partial(_kept_rope, model.rope is not None)
    learned_rope = list(model.rope.parameters()) if model.rope is not None else []  # RoPE-Mixed's frequencies
    return SwapPlan(family='timm Eva', sites=sites, adapter=EvaAttention,
                    grid=GridSource(module=model.patch_embed.proj),
                    own=OwnScheme(absolute=[model.pos_embed], relative=learned_rope, converted=own_phi, kept=kept_phi),
                    prefix_readout=class_token_readout(model))


def _kept_rope(has_rope: bool, site: AttentionSite, index: int) -> List[PositionalModule]:
    """EVA's own RoPE kept beside a named Φp: the rotation the model gives each block, applied as EVA
    applies it (after the q/k norms, prefix tokens untouched), so the named Φp sees the rotated
    queries and keys that the softmax uses."""
    if not has_rope:
        return []
    return [GivenRotation(site.num_prefix_tokens, getattr(site.module, 'rotate_half', False))]


# RoPE modules of timm that the rope Φp does not compute: why each is not converted.
_UNCONVERTED_ROPE = {
    'RotaryEmbeddingDinoV3': "DINOv3's RoPE (rope_type='dinov3') centres the coordinates and normalises them to "
                             '[-1, 1] per grid, with periods in place of frequencies',
    'RotaryEmbeddingMRope': "MRoPE (rope_type='mrope') assigns the frequencies to height, width and time in a "
                            'strided interleave (Qwen2-VL), not to the two halves of the pairs',
}


def own_rope(model: nn.Module, site: AttentionSite, index: int) -> PositionalModule:
    """The Φp that computes what ``model.rope`` computes for the ``index``-th block: the ``rope`` Φp with
    the axial frequencies and settings of a ``RotaryEmbeddingCat``, or, for a ``RotaryEmbeddingMixed``,
    whose learned frequencies the model owns, :class:`GivenRotation` of what the model gives the block."""
    rope = model.rope
    kind = type(rope).__name__
    if kind in _UNCONVERTED_ROPE:
        raise TypeError(f"phi='own' cannot convert this Eva's {kind}: {_UNCONVERTED_ROPE[kind]}, which the rope Φp "
                        'does not compute; pick a Φp by name (posattn.list_phis())')
    cat, mixed = imported('timm.layers', 'RotaryEmbeddingCat'), imported('timm.layers', 'RotaryEmbeddingMixed')
    if not isinstance(rope, tuple(filter(None, (cat, mixed)))):
        raise TypeError(f"phi='own' converts timm's RotaryEmbeddingCat and RotaryEmbeddingMixed, not this Eva's "
                        f'{described(rope)}; pick a Φp by name (posattn.list_phis())')
    if getattr(rope, 'aug_active', False):
        raise TypeError("phi='own' cannot convert a RoPE that augments its coordinates while training "
                        '(rope_shift_coords, rope_jitter_coords, rope_rescale_coords), which the rope Φp does not: '
                        'build the model without them')
    head_dim, axis_order = site.dim // site.num_heads, 'xy' if rope.grid_indexing == 'xy' else 'yx'
    if mixed is not None and isinstance(rope, mixed):
        return GivenRotation(site.num_prefix_tokens, getattr(site.module, 'rotate_half', False))
    grid_type = getattr(rope, 'grid_type', 'index')
    if rope.in_pixels or grid_type != 'index':
        raise TypeError(f"phi='own' converts RoPE on grid indices; this Eva's RotaryEmbeddingCat has "
                        f'in_pixels={rope.in_pixels}, grid_type={grid_type!r}, which the rope Φp does not compute')
    return RotaryPositionEmbedding(head_dim, site.num_heads, frequencies='axial', temperature=float(rope.temperature),
                                   position_offset=float(rope.grid_offset), reference_grid=rope.ref_feat_shape,
                                   axis_order=axis_order, pairing='halves' if rope.rotate_half else 'interleaved')
