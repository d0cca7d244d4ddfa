"""Checkpoints of other code bases -> posattn's parameter layout, in one place.

The models never see a foreign layout: :func:`posattn.create_model` (``checkpoint=path``) calls
:func:`to_posattn_layout`, which recognises the layout and converts it here.

PerViT release (github.com/juhongm999/pervit), 294 entries per model, renamed one to one:

    conv_layers.conv_layers.{i}.0.*          -> stem.layers.{i}.conv.*
    conv_layers.conv_layers.{i}.1.*          -> stem.layers.{i}.norm.*   (BatchNorm, buffers included)
    conv_layers.conv1x1.*                    -> stem.proj.*
    rpe_proj.{weight,bias}                   -> distance_embedding.{weight,bias}
    blocks.{i}.conv.proj.*                   -> blocks.{i}.cpe.proj.*
    blocks.{i}.res_path.*                    -> blocks.{i}.res.*
    blocks.{i}.attn.to_qkv.weight            -> blocks.{i}.attn.qkv.weight
    blocks.{i}.attn.activation.conv{1,2}.w/b -> blocks.{i}.attn.phi.proj{1,2}_{weight,bias}
    blocks.{i}.attn.activation.gn{1,2}.w/b   -> blocks.{i}.attn.phi.norm{1,2}_{weight,bias}
    everything else (norm1/2, attn.proj, mlp, norm, head) keeps its name.

No tensor is reshaped: the release splits qkv as (three, heads, head_dim) like timm, and its
Φp convolutions have the shapes :class:`~posattn.phi.peripheral.PeripheralPhi` keeps. The
release's dead parameters are carried, not dropped: ``rpe_proj.bias`` and the ``conv1`` /
``conv2`` biases add constants that the following instance norm removes, so they change no
output, but posattn keeps them as parameters so that release checkpoints load with
``strict=True`` and parameter counts equal the paper's.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Tuple

import torch

__all__ = ['pervit_from_release', 'is_pervit_release', 'to_posattn_layout', 'unwrap_state_dict']

StateDict = Dict[str, torch.Tensor]

_PERVIT_RELEASE_RENAMES = [
    (r'^conv_layers\.conv_layers\.(\d+)\.0\.', r'stem.layers.\1.conv.'),
    (r'^conv_layers\.conv_layers\.(\d+)\.1\.', r'stem.layers.\1.norm.'),
    (r'^conv_layers\.conv1x1\.', 'stem.proj.'),
    (r'^rpe_proj\.', 'distance_embedding.'),
    (r'^blocks\.(\d+)\.conv\.proj\.', r'blocks.\1.cpe.proj.'),
    (r'^blocks\.(\d+)\.res_path\.', r'blocks.\1.res.'),
    (r'^blocks\.(\d+)\.attn\.to_qkv\.', r'blocks.\1.attn.qkv.'),
    (r'^blocks\.(\d+)\.attn\.activation\.conv([12])\.(weight|bias)$', r'blocks.\1.attn.phi.proj\2_\3'),
    (r'^blocks\.(\d+)\.attn\.activation\.gn([12])\.(weight|bias)$', r'blocks.\1.attn.phi.norm\2_\3'),
]


def unwrap_state_dict(checkpoint: Mapping[str, Any]) -> StateDict:
    """The state_dict of a checkpoint: the mapping itself, or its ``'model'`` entry (the release's
    and DeiT's training checkpoints, which also hold the optimiser and arguments)."""
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f'a checkpoint is a state_dict or a dict with a "model" state_dict, '
                        f'got {type(checkpoint).__name__}')
    model = checkpoint.get('model')
    return dict(model if isinstance(model, Mapping) else checkpoint)


def is_pervit_release(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is laid out as the PerViT release's (its shared ``rpe_proj``)."""
    return 'rpe_proj.weight' in state_dict


def pervit_from_release(checkpoint: Mapping[str, Any]) -> StateDict:
    """A PerViT release checkpoint (the state_dict, or ``{'model': state_dict, ...}``) in posattn's
    layout, for ``PerViT.load_state_dict(..., strict=True)``. Keys the release does not have are
    kept as they are, so that loading reports them."""
    state_dict = unwrap_state_dict(checkpoint)
    if not is_pervit_release(state_dict):
        raise ValueError("not a PerViT release checkpoint: it has no 'rpe_proj.weight' "
                         '(the distance embedding every release model has)')
    converted = {}
    for key, value in state_dict.items():
        for pattern, replacement in _PERVIT_RELEASE_RENAMES:
            key, found = re.subn(pattern, replacement, key)
            if found:
                break
        converted[key] = value
    return converted


def to_posattn_layout(checkpoint: Mapping[str, Any]) -> Tuple[StateDict, str]:
    """(state_dict in posattn's layout, the layout it was found in: 'PerViT release' or 'posattn')."""
    state_dict = unwrap_state_dict(checkpoint)
    if is_pervit_release(state_dict):
        return pervit_from_release(state_dict), 'PerViT release'
    return state_dict, 'posattn'
