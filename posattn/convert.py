"""Checkpoint files, and the layouts of other code bases -> posattn's parameter layout, in one place.

:func:`read_checkpoint` is the one reader of checkpoint files (PyTorch's or safetensors, weights-only,
with errors that say what a file is when it is not a checkpoint). The models never see a foreign layout:
:func:`posattn.create_model` (``checkpoint=path``) calls :func:`to_posattn_layout`, which
recognises the layout and converts it here. What wraps a state_dict (:func:`unwrap_state_dict`) and
which layout a checkpoint is in, whole or under a prefix (:func:`to_posattn_layout`), are decided here
only; the OpenMMLab integration calls these functions too.

Classifiers trained through mmengine (``tools/train.py``): ``{'meta': ..., 'state_dict': ...}``
with the backbone under ``backbone.model.`` and mmpretrain's linear head under ``head.fc.``;
``to_posattn_layout`` keeps the backbone's keys and renames ``head.fc.*`` to ``head.*``. Reading
such a file needs the types mmengine pickles beside the weights, which
``posattn_openmmlab`` allows (:func:`allow_checkpoint_globals`) when it is imported.

timm's ViT / DeiT state_dicts are in posattn's layout already (:mod:`posattn.models.vit` uses
timm's names). mmpretrain's ``VisionTransformer`` classifiers (the ``deit-*`` archs with
``VisionTransformerClsHead``, as mmengine saves them: ``{'state_dict': ..., 'meta': ...}``) are
renamed one to one, nothing reshaped (mmpretrain splits qkv as (three, heads, head_dim) like timm):

    backbone.patch_embed.projection.*        -> patch_embed.proj.*
    backbone.{cls_token,pos_embed}           -> {cls_token,pos_embed}
    backbone.layers.{i}.ln1.* / .ln2.*       -> blocks.{i}.norm1.* / .norm2.*
    backbone.layers.{i}.attn.{qkv,proj}.*    -> blocks.{i}.attn.{qkv,proj}.*
    backbone.layers.{i}.attn.gamma1.weight   -> blocks.{i}.ls1.gamma   (layer scale, ``layer_scale_init_value``)
    backbone.layers.{i}.ffn.gamma2.weight    -> blocks.{i}.ls2.gamma
    backbone.layers.{i}.ffn.layers.0.0.*     -> blocks.{i}.mlp.fc1.*
    backbone.layers.{i}.ffn.layers.1.*       -> blocks.{i}.mlp.fc2.*
    backbone.ln1.*                           -> norm.*   (the final norm, ``final_norm=True``)
    head.layers.head.*                       -> head.*
    backbone.dist_token, head.layers.head_dist.* -> dist_token, head_dist.*   (timm's names)

These are mmpretrain's defaults for DeiT (``final_norm=True``, ``out_type='cls_token'``,
``pre_norm=False``), with or without layer scale. Keys of other options (``backbone.pre_norm.*``,
``backbone.ln2.*`` of ``out_type='avg_featmap'``, a head's ``pre_logits``) are kept as they are,
so that loading reports them; so does a distilled DeiT's token and head, renamed to timm's names,
which posattn's ViT does not have.

DeiT III release (github.com/facebookresearch/deit, ``models_v2.py``): timm's names but for its
layer scale, ``blocks.{i}.gamma_{1,2}`` -> ``blocks.{i}.ls{1,2}.gamma``, as timm's
``checkpoint_filter_fn`` renames it.

PerViT release (github.com/juhongm999/pervit), 294 entries per model, renamed one to one:

    conv_layers.conv_layers.{i}.0.*          -> stem.layers.{i}.conv.*
    conv_layers.conv_layers.{i}.1.*          -> stem.layers.{i}.norm.*   (BatchNorm, buffers included)
    conv_layers.conv1x1.*                    -> stem.proj.*
    rpe_proj.weight                          -> distance_embedding.weight   (rpe_proj.bias dropped, below)
    blocks.{i}.conv.proj.*                   -> blocks.{i}.cpe.proj.*
    blocks.{i}.res_path.*                    -> blocks.{i}.res.*
    blocks.{i}.attn.to_qkv.weight            -> blocks.{i}.attn.qkv.weight
    blocks.{i}.attn.activation.conv{1,2}.w   -> blocks.{i}.attn.phi.proj{1,2}_weight   (the biases dropped)
    blocks.{i}.attn.activation.gn{1,2}.w/b   -> blocks.{i}.attn.phi.norm{1,2}_{weight,bias}
    everything else (norm1/2, attn.proj, mlp, norm, head) keeps its name.

No tensor is reshaped: the release splits qkv as (three, heads, head_dim) like timm, and its
Φp convolutions have the shapes :class:`~posattn.phi.peripheral.PeripheralPhi` keeps. The
release's dead parameters are dropped: ``rpe_proj.bias`` and the ``conv1`` / ``conv2`` biases add
constants that the following instance norm removes, so they change no output and no gradient
could train them; posattn has no such parameters (:func:`without_cancelled_biases`, which also
reads checkpoints that posattn saved when it still had them).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .phi.record import PhiRecord, saved_records

__all__ = ['read_checkpoint', 'allow_checkpoint_globals', 'pervit_from_release', 'is_pervit_release',
           'is_mmengine_checkpoint', 'mmengine_to_posattn', 'is_mmpretrain_vit', 'mmpretrain_vit_to_posattn',
           'is_deit3_release', 'to_posattn_layout', 'unwrap_state_dict', 'without_cancelled_biases']

# DeiT-style training checkpoints (the PerViT release's among them) keep their argparse arguments
# beside the weights: a plain attribute bag, safe to allow.
_SAFE_GLOBALS: List[Any] = [argparse.Namespace]


def allow_checkpoint_globals(safe_globals: Sequence[Any]) -> None:
    """Let :func:`read_checkpoint` accept these classes and functions (``torch.serialization``'s
    safe-globals entries) in every file it reads from now on, e.g. the types mmengine keeps in
    its training checkpoints."""
    _SAFE_GLOBALS.extend(g for g in safe_globals if g not in _SAFE_GLOBALS)


def read_checkpoint(path: Union[str, os.PathLike], map_location: Any = 'cpu') -> Any:
    """The contents of a checkpoint file, read weights-only, with errors that say what the file is:
    missing, empty, truncated, neither format below, or holding refused objects.

    Two formats, told apart by their content (whatever the file's name):

    - PyTorch's (``torch.save``): ``torch.load(path, weights_only=True)`` with the allowed globals.
    - safetensors (timm's and the Hugging Face Hub's weights, ``.safetensors``): an 8-byte
      little-endian header length, a JSON header starting with ``{``, then the tensor data; read by
      the ``safetensors`` package (``pip install safetensors``; timm depends on it) into a flat
      ``{name: tensor}`` dict, its ``__metadata__`` left out.

    Args:
        path: the file.
        map_location: where the tensors go, as for ``torch.load``: a device (``'cpu'``,
            ``'cuda:0'``, a ``torch.device``) or None (where they were saved; the CPU for a
            safetensors file). A dict of {saved location: new location} and a function of
            (storage, location) apply to PyTorch files; for a safetensors file, whose tensors carry
            no device, a dict maps ``'cpu'`` and a function is refused.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no checkpoint file at {path}')
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f'{path} is empty (0 bytes): not a checkpoint, perhaps a failed copy or save')
    with open(path, 'rb') as f:
        head = f.read(_SAFETENSORS_SNIFF)
    if head[_SAFETENSORS_HEADER_START:_SAFETENSORS_SNIFF] == b'{':
        return _read_safetensors(path, size, map_location)
    zipped = head[:4] == b'PK\x03\x04'  # torch.save's format; older files are a bare pickle (0x80 first)
    if not (zipped or head[:1] == b'\x80'):
        if path.endswith('.safetensors'):
            raise ValueError(f'{path} is not a safetensors file ({size} bytes starting {head!r}): one starts with '
                             f'an 8-byte header length and a JSON header ("{{"); perhaps a truncated copy or download')
        raise ValueError(f'{path} is not a PyTorch checkpoint or a safetensors file ({size} bytes starting {head!r})')
    try:
        # the open file, not its name: torch.load reads a name ending in .safetensors as safetensors,
        # whatever the content, which here is PyTorch's
        with torch.serialization.safe_globals(_SAFE_GLOBALS), open(path, 'rb') as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if 'mmengine' in str(error):
            hint = ('it is a training checkpoint of mmengine (tools/train.py): import posattn_openmmlab '
                    'first, which allows the types mmengine keeps beside the weights')
        else:
            hint = ('if you trust the file, load it yourself and torch.save its state_dict alone')
        raise ValueError(f'{path} holds objects other than tensors and plain containers, which '
                         f'weights-only loading refuses; {hint}.\n{error}') from error
    except (EOFError, KeyError, IndexError, RuntimeError, AttributeError, ValueError) as error:
        raise ValueError(f'{path} is a damaged or truncated PyTorch checkpoint ({size} bytes): '
                         f'{type(error).__name__}: {error}') from error


# A safetensors file: an 8-byte little-endian header length n, n bytes of JSON starting with '{'
# ({name: {dtype, shape, data_offsets: [begin, end]}, optional "__metadata__"}), then the data.
_SAFETENSORS_HEADER_START = 8
_SAFETENSORS_SNIFF = _SAFETENSORS_HEADER_START + 1


def _safetensors_device(path: str, map_location: Any) -> str:
    """``map_location`` as the device string ``safetensors`` takes; its tensors are saved on the CPU."""
    if map_location is None:
        return 'cpu'
    if isinstance(map_location, Mapping):  # torch's {saved location: new location}
        map_location = map_location.get('cpu', 'cpu')
    if callable(map_location):
        raise TypeError(f'{path} is a safetensors file: map_location may be a device (a string or torch.device), '
                        f'a dict mapping "cpu" to one, or None (CPU); a function of (storage, location) only '
                        f'applies to PyTorch checkpoints')
    try:
        return str(torch.device(map_location))
    except (RuntimeError, TypeError) as error:
        raise ValueError(f'map_location={map_location!r} is not a device, reading {path}: {error}') from error


def _check_safetensors(path: str, size: int) -> None:
    """Errors that name what is missing when the safetensors file ``path`` does not hold the header
    it announces or the tensor data its header describes."""
    with open(path, 'rb') as f:
        header_size = int.from_bytes(f.read(_SAFETENSORS_HEADER_START), 'little')
        header_end = _SAFETENSORS_HEADER_START + header_size
        if header_end > size:
            raise ValueError(f'{path} is a truncated safetensors file ({size} bytes): its header alone takes '
                             f'{header_end} bytes')
        header = f.read(header_size)
    try:
        entries = json.loads(header)
        data_size = max([int(entry['data_offsets'][1]) for name, entry in entries.items()
                         if name != '__metadata__'], default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise ValueError(f'{path} is a damaged safetensors file ({size} bytes): its header is not a table '
                         f'of tensors: {type(error).__name__}: {error}') from error
    if header_end + data_size > size:
        raise ValueError(f'{path} is a truncated safetensors file ({size} bytes): its header describes '
                         f'{data_size} bytes of tensor data, the file holds {size - header_end}')


def _read_safetensors(path: str, size: int, map_location: Any) -> Dict[str, torch.Tensor]:
    device = _safetensors_device(path, map_location)
    _check_safetensors(path, size)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
    except ImportError as error:
        raise ImportError(f'{path} is a safetensors file; reading it needs the safetensors package: '
                          f'pip install safetensors') from error
    try:
        tensors = load_file(path, device=device)
    except SafetensorError as error:
        raise ValueError(f'{path} could not be read as a safetensors file ({size} bytes, onto {device}): '
                         f'{error}') from error
    # load_file maps the file into memory: its CPU tensors would change, or fault, when the file is
    # rewritten in place (torch.save to the same path). Copies own their memory, as torch.load's do.
    return {name: tensor.clone() if tensor.device.type == 'cpu' else tensor for name, tensor in tensors.items()}


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


def _wrapped_state_dict(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one place that knows what wraps a state_dict (:func:`unwrap_state_dict`)."""
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f'a checkpoint is a state_dict or a dict with a "model" state_dict (or a "state_dict" '
                        f'one, as mmengine saves), got {type(checkpoint).__name__}')
    for entry in ('model', 'state_dict'):
        if isinstance(checkpoint.get(entry), Mapping):
            return checkpoint[entry]
    return checkpoint


def unwrap_state_dict(checkpoint: Mapping[str, Any]) -> StateDict:
    """The state_dict of a checkpoint: the mapping itself, its ``'model'`` entry (the release's,
    DeiT's and timm's training checkpoints, which also hold the optimiser and arguments) or its
    ``'state_dict'`` entry (mmengine's), as a new dict."""
    return dict(_wrapped_state_dict(checkpoint))


def saved_phi_records(checkpoint: Mapping[str, Any]) -> Dict[str, PhiRecord]:
    """What the Φp of the model a checkpoint (or state_dict) was saved from are, ``{module path:
    record}`` under that model's paths (:mod:`posattn.phi.record`); empty for weights that record
    none (other code bases', and posattn's saved before Φp recorded themselves). Conversions of the
    keys leave the records as they are: loading matches them to the receiving model's Φp by path."""
    return saved_records(_wrapped_state_dict(checkpoint))


def _renamed(state_dict: Mapping[str, Any], renames: Sequence[Tuple[str, str]]) -> StateDict:
    """``state_dict`` with each key renamed by the first (pattern, replacement) that matches it;
    keys no pattern matches are kept as they are."""
    converted = {}
    for key, value in state_dict.items():
        for pattern, replacement in renames:
            key, found = re.subn(pattern, replacement, key)
            if found:
                break
        converted[key] = value
    return converted


# The biases of the peripheral Φp's distance embedding, PP1 and PP2, in posattn's names: each adds
# a constant that the instance norm after it removes.
_CANCELLED_BIAS = re.compile(r'(^|\.)distance_embedding\.bias$|(^|\.)phi\.proj[12]_bias$')


def without_cancelled_biases(state_dict: Mapping[str, Any]) -> StateDict:
    """``state_dict`` (posattn's names, under any prefix) without the peripheral Φp's biases that an
    instance norm removes (the release's, and those of checkpoints posattn saved before it dropped
    them): leaving them out changes no output."""
    return {k: v for k, v in state_dict.items() if not _CANCELLED_BIAS.search(k)}


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
    return without_cancelled_biases(_renamed(state_dict, _PERVIT_RELEASE_RENAMES))


_MMENGINE_BACKBONE = 'backbone.model.'
_MMENGINE_HEAD = 'head.fc.'


def is_mmengine_checkpoint(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` (a state_dict, or ``{'state_dict': ...}`` as mmengine saves it) is one
    that mmengine wrote for posattn's backbones: ``backbone.model.*`` keys."""
    if not isinstance(checkpoint, Mapping):
        return False
    return any(key.startswith(_MMENGINE_BACKBONE) for key in unwrap_state_dict(checkpoint))


def mmengine_to_posattn(checkpoint: Mapping[str, Any], model_only: bool = False) -> StateDict:
    """The posattn model inside an mmengine checkpoint of ``PosattnPerViT`` / ``PosattnViT`` (the
    state_dict, or ``{'state_dict': ...}``): ``backbone.model.*`` without the prefix, mmpretrain's
    ``head.fc.*`` as ``head.*``. Other keys (necks, detection or segmentation heads) are kept as they
    are, so that loading reports them, unless ``model_only``."""
    converted = {}
    for key, value in unwrap_state_dict(checkpoint).items():
        if key.startswith(_MMENGINE_BACKBONE):
            key = key[len(_MMENGINE_BACKBONE):]
        elif key.startswith(_MMENGINE_HEAD):
            key = 'head.' + key[len(_MMENGINE_HEAD):]
        elif model_only:
            continue
        converted[key] = value
    return converted


_MMPRETRAIN_VIT_RENAMES = [
    (r'^backbone\.patch_embed\.projection\.', 'patch_embed.proj.'),
    (r'^backbone\.(cls_token|pos_embed|dist_token)$', r'\1'),
    (r'^backbone\.layers\.(\d+)\.ln([12])\.', r'blocks.\1.norm\2.'),
    (r'^backbone\.layers\.(\d+)\.attn\.(qkv|proj)\.', r'blocks.\1.attn.\2.'),
    (r'^backbone\.layers\.(\d+)\.attn\.gamma1\.weight$', r'blocks.\1.ls1.gamma'),
    (r'^backbone\.layers\.(\d+)\.ffn\.gamma2\.weight$', r'blocks.\1.ls2.gamma'),
    (r'^backbone\.layers\.(\d+)\.ffn\.layers\.0\.0\.', r'blocks.\1.mlp.fc1.'),
    (r'^backbone\.layers\.(\d+)\.ffn\.layers\.1\.', r'blocks.\1.mlp.fc2.'),
    (r'^backbone\.ln1\.', 'norm.'),
    (r'^head\.layers\.head\.', 'head.'),
    (r'^head\.layers\.head_dist\.', 'head_dist.'),
]


def is_mmpretrain_vit(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is laid out as an mmpretrain ``VisionTransformer`` classifier's (its
    patch embedding's ``projection`` and its blocks' ``ln1`` under ``backbone.``)."""
    return 'backbone.patch_embed.projection.weight' in state_dict and 'backbone.layers.0.ln1.weight' in state_dict


def mmpretrain_vit_to_posattn(checkpoint: Mapping[str, Any]) -> StateDict:
    """An mmpretrain ViT / DeiT classifier checkpoint (the state_dict, or ``{'state_dict': ...}`` as
    mmengine saves it) in posattn's (and timm's) layout, by the module docstring's table. Keys the
    table does not name are kept as they are, so that loading reports them."""
    state_dict = unwrap_state_dict(checkpoint)
    if not is_mmpretrain_vit(state_dict):
        raise ValueError("not an mmpretrain VisionTransformer checkpoint: it has no "
                         "'backbone.patch_embed.projection.weight' and 'backbone.layers.0.ln1.weight'")
    return _renamed(state_dict, _MMPRETRAIN_VIT_RENAMES)


_DEIT3_LAYER_SCALE = re.compile(r'^blocks\.(\d+)\.gamma_([12])$')


def is_deit3_release(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` holds the DeiT III release's layer scale (``blocks.{i}.gamma_1``)."""
    return any(_DEIT3_LAYER_SCALE.match(key) for key in state_dict)


def to_posattn_layout(checkpoint: Mapping[str, Any], *, prefix: Optional[str] = None, model_only: bool = False,
                      source: str = 'the checkpoint') -> Tuple[StateDict, str]:
    """(state_dict in posattn's layout, the layout it was found in: 'mmengine', 'PerViT release',
    'mmpretrain ViT', 'DeiT III release' or 'posattn', which is timm's for ViT / DeiT; under a
    ``prefix`` also 'posattn backbone').

    The one place that recognises a layout: ``checkpoint`` is a state_dict or a training checkpoint
    holding one (:func:`unwrap_state_dict`), told apart by its keys.

    Args:
        prefix: read only the keys that start with it, without it (mmengine's ``Pretrained``
            ``prefix``, e.g. ``'backbone.'`` of a classifier). Under it lie a posattn backbone's own
            weights (``model.*``, as the OpenMMLab backbones save them: the 'posattn backbone'
            layout), an mmpretrain ``VisionTransformer``'s (its classifier's ``backbone.``), or any
            layout above. A prefix no key starts with is a ValueError naming the keys' first parts.
        model_only: leave out what is not the posattn model: the necks and the detection or
            segmentation heads of an mmengine checkpoint (the other layouts hold one model).
        source: what ``checkpoint`` is, for the error about ``prefix`` (e.g. its path).
    """
    state_dict = unwrap_state_dict(checkpoint)
    if prefix is not None:
        return _under_prefix(state_dict, prefix, source)
    if is_mmengine_checkpoint(state_dict):
        return without_cancelled_biases(mmengine_to_posattn(state_dict, model_only)), 'mmengine'
    if is_pervit_release(state_dict):
        return pervit_from_release(state_dict), 'PerViT release'
    if is_mmpretrain_vit(state_dict):
        return mmpretrain_vit_to_posattn(state_dict), 'mmpretrain ViT'
    if is_deit3_release(state_dict):
        return _renamed(state_dict, [(_DEIT3_LAYER_SCALE.pattern, r'blocks.\1.ls\2.gamma')]), 'DeiT III release'
    return without_cancelled_biases(state_dict), 'posattn'


_POSATTN_BACKBONE = 'model.'  # where the OpenMMLab backbones keep their posattn model


def _under_prefix(state_dict: Mapping[str, Any], prefix: str, source: str) -> Tuple[StateDict, str]:
    """:func:`to_posattn_layout` of the keys of ``state_dict`` under ``prefix``, without it."""
    selected = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not selected:
        starts = sorted({key.split('.')[0] + '.' for key in state_dict})
        raise ValueError(f'no key of {source} starts with prefix {prefix!r}; its keys start with {starts[:8]}'
                         + (' ...' if len(starts) > 8 else ''))
    if all(key.startswith(_POSATTN_BACKBONE) for key in selected):
        backbone = {key[len(_POSATTN_BACKBONE):]: value for key, value in selected.items()}
        return without_cancelled_biases(backbone), 'posattn backbone'
    rebased = {'backbone.' + key: value for key, value in selected.items()}  # an mmpretrain classifier's names
    if is_mmpretrain_vit(rebased):
        return mmpretrain_vit_to_posattn(rebased), 'mmpretrain ViT'
    return to_posattn_layout(selected)
