"""A swapped Hugging Face model through ``save_pretrained`` and back.

``swap_attention`` records in the model's config (``config.posattn_swap``) the Φp it swapped in;
``save_pretrained`` writes that config with the weights, the Φp's included (under the checkpoint's
names, which transformers may write in an older layout than the model's). :func:`from_pretrained`
reads the saved weights, hands transformers' ``from_pretrained`` those of the model as it was before
the swap (so that its load report lists no Φp key), swaps the recorded Φp in again and loads the
saved Φp weights into the swapped layers, in depth order, each layer's keys checked::

    model.save_pretrained('run/')                                   # a swapped model
    model = posattn.swap.from_pretrained(ViTForImageClassification, 'run/')
"""
from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple, Union

import torch
from torch import nn

from ..phi import PositionalModule
from ..phi.record import difference
from ..phi.registry import PhiSpec
from .core import SwappedAttention, register_after_swap, swap_attention

__all__ = ['from_pretrained']

SWAP_RECORD = 'posattn_swap'  # the attribute of a transformers config that records the swap


def _record_swap(model: nn.Module, phi: PhiSpec, phi_cfg: Mapping[str, Any], own_positions: bool) -> None:
    """A Hugging Face model's config (the one ``save_pretrained`` writes) records the swap, so that
    :func:`posattn.swap.hf_pretrained.from_pretrained` swaps the same Φp in again."""
    config = getattr(model, 'config', None)
    if hasattr(config, 'to_json_string'):  # a transformers PretrainedConfig
        options = dict(phi_cfg)
        try:
            json.dumps(options)
        except TypeError:  # the config must stay writable: options JSON cannot hold are not recorded
            options = None
        phi = phi if isinstance(phi, str) else list(phi)
        setattr(config, SWAP_RECORD, dict(phi=phi, phi_cfg=options, own_positions=own_positions,
                                          phi_records=swapped_phi_records(model)))


def swapped_phi_records(model: nn.Module) -> List[Dict[str, Any]]:
    """What the Φp of ``model``'s swapped layers are, in depth order (:mod:`posattn.phi.record`):
    each layer's Φp, its own record and those of a stack's members."""
    return [{path: module.state_dict_record() for path, module in layer.phi.named_modules()
             if isinstance(module, PositionalModule)}
            for layer in model.modules() if isinstance(layer, SwappedAttention)]


def _forget_swap(model: nn.Module) -> None:
    """After :func:`~posattn.swap.unswap`, the configs of the model and its parts record no swap."""
    for module in model.modules():
        config = getattr(module, 'config', None)
        if hasattr(config, SWAP_RECORD):
            delattr(config, SWAP_RECORD)


register_after_swap(_record_swap, undo=_forget_swap)

# What save_pretrained writes, in the order transformers prefers them: one file, or an index of shards.
_WEIGHT_FILES = (('model.safetensors', 'model.safetensors.index.json'),
                 ('pytorch_model.bin', 'pytorch_model.bin.index.json'))


def from_pretrained(model_class: Any, folder: Union[str, Path], **from_pretrained_options: Any) -> nn.Module:
    """``model_class.from_pretrained(folder, **from_pretrained_options)`` with the Φp that the saved
    model's config records swapped in again, every saved weight loaded strictly (the Φp's too).

    ``folder``: a local folder written by ``save_pretrained`` of a swapped model: safetensors or
    PyTorch weights (read with ``weights_only=True``), one file or sharded. transformers loads the
    weights of the model before the swap from them (with the options, ``config=`` among them), so
    that its load report (and the loading info ``output_loading_info=True`` returns with the model)
    is about those; the Φp's are loaded after the swap. A ValueError names a folder whose config
    records no swap, and a swapped layer whose Φp is not the one the config records (a posattn whose Φp
    computes otherwise than the one that saved it); a FileNotFoundError a folder without weights.
    """
    folder = Path(folder)
    record = json.loads((folder / 'config.json').read_text()).get(SWAP_RECORD)
    if record is None:
        raise ValueError(f'{folder}/config.json records no posattn swap ({SWAP_RECORD}): it was not saved from a '
                         'model that swap_attention changed; load it with from_pretrained alone')
    if record['phi_cfg'] is None:
        raise ValueError(f'{folder} was saved from a model swapped with Φp options that JSON cannot hold, so they '
                         'were not recorded: from_pretrained the model, swap_attention it with those options and '
                         "load the '.phi.' weights of the folder's weights into its swapped layers")
    swap = dict(phi=record['phi'], own_positions=record['own_positions'], **record['phi_cfg'])
    config = from_pretrained_options.pop('config', None)
    if config is None:  # as transformers does: the options that are the config's set it, the others load
        config, from_pretrained_options = model_class.config_class.from_pretrained(
            folder, return_unused_kwargs=True, **from_pretrained_options)
    saved = _saved_weights(folder)
    phi_weights = _phi_weights_by_layer(saved)
    weights = {key: tensor for key, tensor in saved.items() if '.phi.' not in key}
    # what a Φp holds of the model's own (a converted table) goes under the model's own key
    for layer_weights, own in zip(phi_weights, _own_keys_by_layer(model_class, config, swap)):
        weights.update({own[key]: tensor for key, tensor in layer_weights.items() if key in own})
    with_info = from_pretrained_options.get('output_loading_info', False)
    loaded = model_class.from_pretrained(None, config=config, state_dict=weights, **from_pretrained_options)
    model = loaded[0] if with_info else loaded
    model.config.name_or_path = str(folder)
    swap_attention(model, **swap)
    _check_phi_records(record.get('phi_records'), swapped_phi_records(model), folder)
    _load_phi_weights(model, phi_weights, folder)
    return (model, *loaded[1:]) if with_info else model



def _check_phi_records(saved: Any, built: List[Dict[str, Any]], folder: Path) -> None:
    """A ValueError where a swapped layer's Φp is not the one ``saved`` records (:mod:`posattn.phi.record`;
    a config saved before Φp were recorded records none, and is not checked)."""
    for index, (saved_layer, layer) in enumerate(zip(saved or (), built)):
        for path, record in layer.items():
            problem = difference(saved_layer[path], record) if path in saved_layer else None
            if problem is not None:
                where = f'swapped layer {index}' + (f', Φp member {path}' if path else '')
                raise ValueError(f'{folder}: {where}: {problem}; it was saved by a posattn whose Φp computes '
                                 'otherwise: load it with that version')


def _own_keys_by_layer(model_class: Any, config: Any, swap: Mapping[str, Any]) -> List[Dict[str, str]]:
    """For each swapped layer that holds Φp weights, in depth order: its Φp keys that hold a parameter of
    the model as it was before the swap (a table ``phi='own'`` converted, a scheme kept beside the Φp),
    each with that parameter's key in the model. Found by swapping a model built on the meta device,
    which allocates nothing."""
    with torch.device('meta'):
        probe = model_class(copy.deepcopy(config))
    own_names = {id(param): name for name, param in probe.named_parameters()}
    with warnings.catch_warnings():  # the real swap says what this one would
        warnings.simplefilter('ignore')
        swap_attention(probe, **swap)
    return [{key: own_names[id(tensor)] for key, tensor in layer.phi.state_dict(keep_vars=True).items()
             if id(tensor) in own_names} for layer in _layers_with_phi_weights(probe)]


def _layers_with_phi_weights(model: nn.Module) -> List[SwappedAttention]:
    return [m for m in model.modules() if isinstance(m, SwappedAttention) and m.phi.state_dict()]


def _phi_weights_by_layer(saved: Mapping[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """The saved Φp weights (keys ``<layer>.phi.<key>``) by layer, ``{<key>: tensor}``, in the order of the
    layer numbers."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in saved.items():
        if '.phi.' in key:
            layer, phi_key = key.split('.phi.', 1)
            groups.setdefault(layer, {})[phi_key] = tensor
    return [groups[name] for name in sorted(groups, key=_natural_order)]


def _load_phi_weights(model: nn.Module, phi_weights: List[Dict[str, torch.Tensor]], folder: Path) -> None:
    """The saved Φp weights of each layer (:func:`_phi_weights_by_layer`) into the model's swapped layers
    that hold Φp weights, in depth order."""
    layers = _layers_with_phi_weights(model)
    if len(phi_weights) != len(layers):
        raise ValueError(f'{folder} holds the Φp weights of {len(phi_weights)} layers, the swapped model has '
                         f'{len(layers)} layers with Φp weights: it was saved from another model')
    for layer, saved in zip(layers, phi_weights):
        layer.phi.load_state_dict(saved, strict=True)


def _natural_order(name: str) -> List[Tuple[int, Any]]:
    """``encoder.layer.10`` after ``encoder.layer.2``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r'(\d+)', name)]


def _saved_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the weights ``save_pretrained`` wrote in ``folder`` (safetensors first, as
    transformers reads them), or a FileNotFoundError naming what the folder holds and what it needs."""
    for single, index in _WEIGHT_FILES:
        if (folder / index).is_file():
            files = sorted(set(json.loads((folder / index).read_text())['weight_map'].values()))
        elif (folder / single).is_file():
            files = [single]
        else:
            continue
        weights: Dict[str, torch.Tensor] = {}
        for name in files:
            weights.update(_read_weights(folder / name))
        return weights
    found = ', '.join(sorted(path.name for path in folder.iterdir())) or 'nothing'
    wanted = ', '.join(name for names in _WEIGHT_FILES for name in names)
    raise FileNotFoundError(f'{folder} holds no weights save_pretrained writes (one of {wanted}); it holds: {found}')


def _read_weights(path: Path) -> Dict[str, torch.Tensor]:
    if path.suffix == '.safetensors':
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, map_location='cpu', weights_only=True)
