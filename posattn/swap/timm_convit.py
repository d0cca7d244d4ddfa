"""timm's ``ConVit`` (ConViT, d'Ascoli et al. 2021; ``convit_tiny``, ``convit_small``, ``convit_base``):
its first ``local_up_to_layer`` blocks hold a gated positional self-attention (``GPSA``) over the
patch grid alone, the others a plain ``MHSA`` over the class token, which the model inserts after
the last GPSA block, and the grid. Each site says its own prefix count (0 for GPSA, 1 for MHSA),
and the grid tracker gives each its grid.

With ``phi='own'`` every GPSA block gets the ``gpsa`` Φp holding the block's own ``pos_proj`` and
``gating_param`` (the same objects) and every MHSA block ``none``: the model's outputs are
timm's, and the state dict holds them under ``...attn.phi.``. With any other Φp the GPSA's gated
positional attention is the model's own positional term: kept as the first Φp of the layer's stack
(a ``gpsa`` holding them, under ``...attn.phi.0.``; its mixture runs before the named Φp's, so
``phi='none'`` gives timm's outputs) unless the model's own positions are dropped, which also
zeroes the absolute embedding and freezes the GPSA's parameters, then under ``...attn.own_gpsa.``.
Weights saved before the swap, under timm's names, load in every case.
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import nn

from ..phi import PositionalModule, build_layer_phi
from ..phi.gpsa import GatedPositionalAttention
from .core import (AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention, _rename_keys, described,
                   imported, register_family)
from .timm_vit import class_token_readout

__all__ = ['ConvitAttention']

_CONVIT = 'timm.models.convit'
# A GPSA's positional parameters, by timm's state-dict names
_GPSA_KEYS = ('pos_proj.weight', 'pos_proj.bias', 'gating_param')


def gpsa_of(old: nn.Module) -> GatedPositionalAttention:
    """The ``gpsa`` that computes timm's ``GPSA`` ``old``'s gated positional term, holding its ``pos_proj``
    and ``gating_param`` (the same objects)."""
    with torch.device('meta'):  # its own parameters are replaced by the GPSA's
        phi = GatedPositionalAttention(old.num_heads, locality_strength=old.locality_strength, local_init=False)
    phi.pos_proj, phi.gating_param = old.pos_proj, old.gating_param
    return phi


class ConvitAttention(SwappedAttention):
    """Called as ConViT's blocks call their attention: ``attn(x)``. Takes over an ``MHSA``'s ``qkv``,
    or a ``GPSA``'s ``qk`` (Linear dim -> 2 dim, laid out (two, heads, d)) and ``v``, which
    :meth:`project_qkv` concatenates."""

    own_gpsa: Optional[GatedPositionalAttention]

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'proj', 'attn_drop', 'proj_drop')
        self.own_gpsa = None
        if not hasattr(old, 'qk'):
            self.take(old, 'qkv')
            self.qk = None
            return
        self.qkv = None
        self.take(old, 'qk', 'v')
        # phi='own' or kept own positions: a Φp of the layer holds the GPSA's own parameters
        holder = next((f'phi.{name}'.rstrip('.') for name, module in self.phi.named_modules()
                       if getattr(module, 'pos_proj', None) is old.pos_proj), None)
        renames = {}
        if holder is None:  # own positions dropped: the parameters stay, frozen, unused
            self.own_gpsa = gpsa_of(old)
            holder = 'own_gpsa'
        else:  # where weights saved with the GPSA beside the Φp held them
            renames = {f'own_gpsa.{name}': f'{holder}.{name}' for name in _GPSA_KEYS}
        renames.update({name: f'{holder}.{name}' for name in _GPSA_KEYS})  # timm's names
        self.register_load_state_dict_pre_hook(functools.partial(_rename_keys, renames=renames))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention_output(x)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B, N, 3 * heads * d), laid out (three, heads, d): a GPSA's q and k, then its v."""
        if self.qk is None:
            return self.qkv(x)
        return torch.cat([self.qk(x), self.v(x)], dim=-1)


def _own_phi(site: AttentionSite, index: int) -> PositionalModule:
    """A GPSA's ``gpsa`` (holding its ``pos_proj`` and ``gating_param``), an MHSA's ``none``."""
    old = site.module
    if not hasattr(old, 'pos_proj'):
        return build_layer_phi('none', None, dim=site.dim, num_heads=site.num_heads,
                               num_prefix_tokens=site.num_prefix_tokens)
    return gpsa_of(old)


@register_family(covers=("timm's ConVit",))
def timm_convit(model: nn.Module) -> Optional[SwapPlan]:
    ConVit = imported(_CONVIT, 'ConVit')
    if ConVit is None or not isinstance(model, ConVit):
        return None
    gpsa, mhsa = imported(_CONVIT, 'GPSA'), imported(_CONVIT, 'MHSA')
    sites, positions = [], []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if type(attn) not in (gpsa, mhsa):
            raise TypeError(f'block {i} holds {described(attn)}, not timm\'s ConViT GPSA or MHSA: swap_attention '
                            'replaces the attention of ConViT\'s blocks only')
        prefix = 0 if i < model.local_up_to_layer else model.num_prefix_tokens  # the class token comes after GPSA
        sites.append(AttentionSite(block, 'attn', attn.proj.in_features, attn.num_heads, prefix))
        if type(attn) is gpsa:
            positions += [*attn.pos_proj.parameters(), attn.gating_param]
    embeddings = [model.pos_embed] if model.use_pos_embed else []
    return SwapPlan(family='timm ConVit', sites=sites, adapter=ConvitAttention,
                    grid=GridSource(module=model.patch_embed.proj),
                    own=OwnScheme(absolute=embeddings, relative=positions, converted=_own_phi, kept=_kept_phi),
                    prefix_readout=class_token_readout(model))


def _kept_phi(site: AttentionSite, index: int) -> List[PositionalModule]:
    """A GPSA block's gated positional attention kept beside a named Φp, as a ``gpsa`` holding its
    parameters (its mixture runs before the named Φp's); nothing for an MHSA block."""
    return [gpsa_of(site.module)] if hasattr(site.module, 'pos_proj') else []
