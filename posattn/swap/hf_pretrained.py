"""A swapped Hugging Face model through ``save_pretrained`` and back.

``swap_attention`` records in the model's config (``config.posattn_swap``) the Φp it swapped in and
what each layer's Φp is (:mod:`posattn.phi.record`); ``save_pretrained`` writes that config with the
weights, the Φp's included (under the checkpoint's names, which transformers may write in an older
layout than the model's). :func:`from_pretrained` builds the model as it was before the swap from
the saved weights without the Φp's (so transformers' load report lists none of them), swaps the
recorded Φp in again, checks that each layer's Φp is the one recorded, and loads the saved Φp
weights into the swapped layers, in depth order, each layer's keys checked::

    model.save_pretrained('run/')                                   # a swapped model
    model = posattn.swap.from_pretrained(ViTForImageClassification, 'run/')
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, Union

import torch
from torch import nn

from ..phi.record import difference
from .core import SWAP_RECORD, SwappedAttention, swap_attention, swapped_phi_records

__all__ = ['from_pretrained']


def _read_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def _read_pickled(path: Path) -> Dict[str, torch.Tensor]:
    return torch.load(path, map_location='cpu', weights_only=True)


# The weight files save_pretrained writes, preferred first: (one file, the index of its shards, reader)
WEIGHT_FILES: Tuple[Tuple[str, str, Callable[[Path], Dict[str, torch.Tensor]]], ...] = (
    ('model.safetensors', 'model.safetensors.index.json', _read_safetensors),
    ('pytorch_model.bin', 'pytorch_model.bin.index.json', _read_pickled),
)


def from_pretrained(model_class: Any, folder: Union[str, Path], **from_pretrained_options: Any) -> nn.Module:
    """``model_class.from_pretrained(folder, **from_pretrained_options)`` with the Φp that the saved
    model's config records swapped in again, every saved weight loaded strictly (the Φp's too).

    ``folder``: a local folder written by ``save_pretrained`` of a swapped model (safetensors or
    ``pytorch_model.bin``, read weights-only; one file or sharded). A ValueError names a folder whose
    config records no swap, and a layer whose Φp is not the one recorded (a posattn whose Φp compute
    otherwise than the one that saved it).
    """
    folder = Path(folder)
    config = json.loads((folder / 'config.json').read_text())
    record = config.get(SWAP_RECORD)
    if record is None:
        raise ValueError(f'{folder}/config.json records no posattn swap ({SWAP_RECORD}): it was not saved from a '
                         'model that swap_attention changed; load it with from_pretrained alone')
    if record['phi_cfg'] is None:
        raise ValueError(f'{folder} was saved from a model swapped with Φp options that JSON cannot hold, so they '
                         'were not recorded: from_pretrained the model, swap_attention it with those options and '
                         "load the '.phi.' weights of the folder's safetensors into its swapped layers")
    saved = _saved_weights(folder)
    model = model_class.from_pretrained(None, config=model_class.config_class.from_pretrained(folder),
                                        state_dict={k: v for k, v in saved.items() if '.phi.' not in k},
                                        **from_pretrained_options)
    swap_attention(model, phi=record['phi'], own_positions=record['own_positions'], **record['phi_cfg'])
    _check_phi_records(record.get('phi_records'), swapped_phi_records(model), folder)
    _load_phi_weights(model, saved, folder)
    return model


def _check_phi_records(saved: Any, built: List[Dict[str, Any]], folder: Path) -> None:
    """A ValueError where a swapped layer's Φp is not the one ``saved`` records (a config saved
    before Φp were recorded has none, and is not checked)."""
    if saved is None:
        return
    for index, (saved_layer, layer) in enumerate(zip(saved, built)):
        for path, record in layer.items():
            problem = difference(saved_layer[path], record) if path in saved_layer else None
            if problem is not None:
                where = f'swapped layer {index}' + (f', Φp member {path}' if path else '')
                raise ValueError(f'{folder}: {where}: {problem}; it was saved by a posattn whose Φp computes '
                                 'otherwise: load it with that version')


def _load_phi_weights(model: nn.Module, saved: Dict[str, torch.Tensor], folder: Path) -> None:
    """The saved Φp weights (keys ``<layer>.phi.<key>``), grouped by layer in the order of their
    layer numbers, into the model's swapped layers that hold Φp weights, in depth order."""
    groups: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in saved.items():
        if '.phi.' in key:
            layer, phi_key = key.split('.phi.', 1)
            groups.setdefault(layer, {})[phi_key] = tensor
    layers = [m for m in model.modules() if isinstance(m, SwappedAttention) and m.phi.state_dict()]
    if len(groups) != len(layers):
        raise ValueError(f'{folder} holds the Φp weights of {len(groups)} layers, the swapped model has {len(layers)} '
                         'layers with Φp weights: it was saved from another model')
    for layer, name in zip(layers, sorted(groups, key=_natural_order)):
        layer.phi.load_state_dict(groups[name], strict=True)


def _natural_order(name: str) -> List[Tuple[int, Any]]:
    """``encoder.layer.10`` after ``encoder.layer.2``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r'(\d+)', name)]


def _saved_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """Every weight saved in ``folder``, from the first kind of :data:`WEIGHT_FILES` it holds."""
    for single, index, read in WEIGHT_FILES:
        if (folder / index).is_file():
            files = sorted(set(json.loads((folder / index).read_text())['weight_map'].values()))
        elif (folder / single).is_file():
            files = [single]
        else:
            continue
        weights: Dict[str, torch.Tensor] = {}
        for name in files:
            weights.update(read(folder / name))
        return weights
    found = sorted(path.name for path in folder.iterdir())
    raise FileNotFoundError(f'{folder} holds no weights that save_pretrained writes: it has {", ".join(found)}, and '
                            'from_pretrained reads ' + ', '.join(f'{single} (or {index} and its shards)'
                                                                 for single, index, _ in WEIGHT_FILES))
