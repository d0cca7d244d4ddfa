"""Swap posattn's attention, with any Φp, into existing Vision Transformers, keeping their weights.

    model = timm.create_model('deit_small_patch16_224', pretrained=True)
    swap_attention(model, phi='peripheral')          # then fine-tune

Supported: timm's ``VisionTransformer`` (ViT, DeiT, distilled DeiT: every ``Block.attn`` a
``timm.layers.Attention``) and torchvision's ``VisionTransformer`` (``nn.MultiheadAttention``
inside each ``EncoderBlock``). Each attention module becomes a :class:`posattn.Attention` that
holds the very same q/k/v and output-projection parameters (no copy: an optimiser built before
the swap still updates them) plus a fresh Φp per layer. The token grid comes from the model's
patch embedding at run time: a forward hook on its projection records (H, W) of every input, so
any input size the model accepts works, and nothing guesses H = W from the token count.

With ``phi='none'`` the swapped model computes what the original does. State-dict names stay
timm's for timm models; torchvision's ``in_proj_weight`` / ``out_proj`` become ``qkv`` / ``proj``,
so load torchvision checkpoints before swapping.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..attention import Attention
from ..grid import TokenGrid
from ..phi import build_layer_phi

__all__ = ['swap_attention', 'TimmAttention', 'TorchvisionAttention']


class _GridProbe:
    """The grid of the latest patch embedding, recorded by a forward hook on its (B, C, H, W) output."""

    def __init__(self, num_prefix_tokens: int):
        self.num_prefix_tokens = num_prefix_tokens
        self.grid: Optional[TokenGrid] = None

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if not (isinstance(output, torch.Tensor) and output.dim() == 4):
            raise RuntimeError(f'the patch projection {type(module).__name__} should give (B, C, H, W), '
                               f'got {getattr(output, "shape", type(output))}')
        self.grid = TokenGrid(int(output.shape[-2]), int(output.shape[-1]), self.num_prefix_tokens)

    def current(self) -> TokenGrid:
        if self.grid is None:
            raise RuntimeError('a swapped attention takes its grid from the patch embedding of its '
                               'model: run the whole model, not the blocks alone')
        return self.grid


class TimmAttention(Attention):
    """:class:`posattn.Attention` called as timm's ``Block`` calls its attention, ``attn(x, attn_mask=...)``."""
    grid_probe: _GridProbe

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError('a swapped attention takes no attention mask: the Φp is the only bias')
        return super().forward(x, self.grid_probe.current())


class TorchvisionAttention(Attention):
    """:class:`posattn.Attention` called as ``nn.MultiheadAttention`` in torchvision's ``EncoderBlock``.

    Batch-first self-attention only: returns ``(out, None)``.
    """
    grid_probe: _GridProbe

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                need_weights: bool = False, **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if not (query is key is value):
            raise ValueError('a swapped attention is self-attention: query, key and value must be the same tensor')
        if need_weights or any(v is not None and v is not False for v in kwargs.values()):
            raise ValueError(f'a swapped attention returns no weights and takes no masks; got '
                             f'need_weights={need_weights}, {sorted(kwargs)}')
        return super().forward(query, self.grid_probe.current()), None


def _described(obj: Any) -> str:
    return f'{type(obj).__module__}.{type(obj).__qualname__}'


def _timm_layers(model: nn.Module) -> Optional[Tuple[nn.Module, List[Tuple[nn.Module, str]], int]]:
    """(patch projection, [(block, attribute)], prefix tokens) of a timm ViT, or None."""
    try:
        from timm.layers import Attention as TimmAttentionClass
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:
        return None
    if not isinstance(model, VisionTransformer):
        return None
    for i, block in enumerate(model.blocks):
        attn = getattr(block, 'attn', None)
        if not isinstance(attn, TimmAttentionClass):
            raise TypeError(f'block {i} of the timm model holds {_described(attn)}; swap_attention '
                            f'replaces timm.layers.Attention only')
        extras = {name: type(getattr(attn, name)).__name__ for name in ('q_norm', 'k_norm', 'norm')
                  if not isinstance(getattr(attn, name, nn.Identity()), nn.Identity)}
        if getattr(attn, 'gate', None) is not None:
            extras['gate'] = type(attn.gate).__name__
        if attn.head_dim * attn.num_heads != attn.qkv.in_features or attn.proj.out_features != attn.qkv.in_features:
            extras['head_dim'] = f'{attn.num_heads} heads x {attn.head_dim} != dim {attn.qkv.in_features}'
        if attn.proj.bias is None:
            extras['proj_bias'] = 'None'
        if extras:
            raise TypeError(f'block {i} of the timm model has attention features posattn.Attention lacks: {extras}')
    return model.patch_embed.proj, [(block, 'attn') for block in model.blocks], model.num_prefix_tokens


def _torchvision_layers(model: nn.Module) -> Optional[Tuple[nn.Module, List[Tuple[nn.Module, str]], int]]:
    """(patch projection, [(block, attribute)], prefix tokens) of a torchvision ViT, or None."""
    try:
        from torchvision.models.vision_transformer import VisionTransformer
    except ImportError:
        return None
    if not isinstance(model, VisionTransformer):
        return None
    for i, block in enumerate(model.encoder.layers):
        attn = getattr(block, 'self_attention', None)
        if not isinstance(attn, nn.MultiheadAttention):
            raise TypeError(f'encoder layer {i} of the torchvision model holds {_described(attn)}; '
                            f'swap_attention replaces nn.MultiheadAttention only')
        if not (attn.batch_first and attn._qkv_same_embed_dim and attn.bias_k is None
                and not attn.add_zero_attn and attn.in_proj_bias is not None):
            raise TypeError(f'encoder layer {i} of the torchvision model has a MultiheadAttention that is not '
                            f'batch-first self-attention with packed, biased q/k/v projections')
    return model.conv_proj, [(block, 'self_attention') for block in model.encoder.layers], 1


def _from_timm(old: nn.Module, layer: TimmAttention) -> None:
    layer.qkv, layer.proj = old.qkv, old.proj
    layer.attn_drop.p, layer.proj_drop.p = old.attn_drop.p, old.proj_drop.p


def _from_torchvision(old: nn.MultiheadAttention, layer: TorchvisionAttention) -> None:
    layer.qkv.weight, layer.qkv.bias = old.in_proj_weight, old.in_proj_bias  # rows [q; k; v], heads inside
    layer.proj.weight, layer.proj.bias = old.out_proj.weight, old.out_proj.bias
    layer.attn_drop.p = old.dropout


# (find the layers, adapter class, the original's packed qkv weight, move its weights over)
_FAMILIES: List[Tuple[Callable, type, Callable, Callable]] = [
    (_timm_layers, TimmAttention, lambda old: old.qkv.weight, _from_timm),
    (_torchvision_layers, TorchvisionAttention, lambda old: old.in_proj_weight, _from_torchvision),
]


def swap_attention(model: nn.Module, phi: str = 'peripheral', **phi_cfg: Any) -> nn.Module:
    """Replace every attention module of ``model`` by :class:`posattn.Attention` with Φp ``phi``.

    Args:
        model: a timm or torchvision ``VisionTransformer``, changed in place.
        phi: the Φp of every layer, by registered name; 'none' reproduces the original model.
        **phi_cfg: its options; what each layer knows (``dim``, ``num_heads``, ``head_dim``,
            ``num_prefix_tokens``, ``layer_index``, ``num_layers``) is filled in where the Φp
            takes it (:func:`posattn.phi.build_layer_phi`).

    Returns:
        ``model``, whose attention layers now hold the same q/k/v and projection parameters.
    """
    for find_layers, adapter, qkv_weight, take_weights in _FAMILIES:
        found = find_layers(model)
        if found is not None:
            break
    else:
        raise TypeError(f"swap_attention supports timm's and torchvision's VisionTransformer; got "
                        f'{_described(model)}')
    projection, sites, num_prefix_tokens = found
    probe = _GridProbe(num_prefix_tokens)
    layers = []  # all built before the model changes, so a bad option leaves it as it was
    for index, (parent, name) in enumerate(sites):
        old = getattr(parent, name)
        weight = qkv_weight(old)  # (3 * dim, dim)
        dim, num_heads = weight.shape[1], old.num_heads
        built_phi = build_layer_phi(phi, phi_cfg, dim=dim, num_heads=num_heads, num_prefix_tokens=num_prefix_tokens,
                                    layer_index=index, num_layers=len(sites))
        layer = adapter(dim, num_heads, phi=built_phi.to(weight.device, weight.dtype),
                        num_prefix_tokens=num_prefix_tokens, qkv_bias=False)
        take_weights(old, layer)
        layer.grid_probe = probe
        layers.append(layer.train(old.training))
    for (parent, name), layer in zip(sites, layers):
        setattr(parent, name, layer)
    projection.register_forward_hook(probe)
    return model
