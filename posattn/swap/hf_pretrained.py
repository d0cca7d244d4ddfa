"""A swapped Hugging Face model through ``save_pretrained`` and back.

``swap_attention`` records in the model's config (``config.posattn_swap``) the Φp it swapped in;
``save_pretrained`` writes that config with the weights, the Φp's included (under the checkpoint's
names, which transformers may write in an older layout than the model's). transformers'
``from_pretrained`` builds the model as it was before the swap and leaves the Φp's weights out;
:func:`from_pretrained` builds it the same way, swaps the recorded Φp in again and loads the saved
Φp weights into the swapped layers, in depth order, each layer's keys checked::

    model.save_pretrained('run/')                                   # a swapped model
    model = posattn.swap.from_pretrained(ViTForImageClassification, 'run/')
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import torch
from torch import nn

from .core import SWAP_RECORD, SwappedAttention, swap_attention

__all__ = ['from_pretrained']

_WEIGHTS, _INDEX = 'model.safetensors', 'model.safetensors.index.json'


def from_pretrained(model_class: Any, folder: Union[str, Path], **from_pretrained_options: Any) -> nn.Module:
    """``model_class.from_pretrained(folder, **from_pretrained_options)`` with the Φp that the saved
    model's config records swapped in again, every saved weight loaded strictly (the Φp's too).

    ``folder``: a local folder written by ``save_pretrained`` of a swapped model (safetensors, one
    file or sharded). A ValueError names a folder whose config records no swap.
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
    model = model_class.from_pretrained(folder, **from_pretrained_options)
    swap_attention(model, phi=record['phi'], own_positions=record['own_positions'], **record['phi_cfg'])
    _load_phi_weights(model, _saved_weights(folder), folder)
    return model


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
    from safetensors.torch import load_file
    index = folder / _INDEX
    files = sorted(set(json.loads(index.read_text())['weight_map'].values())) if index.is_file() else [_WEIGHTS]
    weights: Dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(folder / name)))
    return weights
