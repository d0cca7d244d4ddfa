"""What a swap replaced, kept so that :func:`~posattn.swap.unswap` can put it back.

A swapped layer takes over the very parameters of the module it replaces, and that module keeps
referring to them. The layer keeps the module (unregistered: it adds nothing to the layer's state
dict, and goes with the layer through ``copy.deepcopy`` and pickling) and, for each tensor of the
module's state, the key under which the layer now holds it. Putting the module back hands it the
tensors the layer holds under those keys at that time (the fine-tuned weights, on the layer's
device and in its dtype), whatever replaced the tensor objects since (a load with ``assign=True``,
a conversion that made new parameters).

A module of the model beside the attention that a conversion detached (the table module of a
transformers BEiT layer, whose parameter the converted Φp holds) is kept the same way, by its owner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ['Original', 'Detached', 'carried_keys', 'restoration']


@dataclass(frozen=True)
class Original:
    """A module the swap replaced, and for each of its state's keys, the key in the swapped layer
    that holds the same tensor."""
    module: nn.Module
    keys: Tuple[Tuple[str, str], ...]  # (the module's key, the layer's key)


@dataclass(frozen=True)
class Detached:
    """A module that a conversion set to None as the child ``name`` of ``parent`` (in the layer
    around the attention, or in a submodule that the swapped layer took over), the keys of its state
    in the swapped layer, and the handle of the load pre-hook that renames its keys for the Φp."""
    parent: nn.Module
    name: str
    original: Original
    renaming: Optional[RemovableHandle]


def carried_keys(module: nn.Module, holder: nn.Module) -> Tuple[Tuple[str, str], ...]:
    """For each tensor of ``module``'s state that ``holder`` holds too (the same object), the
    module's key and the holder's."""
    held = {id(tensor): key for key, tensor in _state(holder).items()}
    return tuple((key, held[id(tensor)]) for key, tensor in _state(module).items() if id(tensor) in held)


def restoration(original: Original, holder: nn.Module) -> Callable[[], nn.Module]:
    """What puts ``original.module`` back in shape, checked now: a call that hands the module what
    ``holder`` holds under the recorded keys, moves every other tensor of the module to the device
    (and, floating, the dtype) of the holder's tensors, and returns the module."""
    now = _state(holder)
    module = original.module
    carried = dict(original.keys)
    reference = next((now[key] for key in carried.values() if key in now and now[key].is_floating_point()), None)
    puts = []
    for key, tensor in _state(module).items():
        if key in carried:
            current = now.get(carried[key])
            if current is None:
                raise ValueError(f'the swapped layer no longer holds {carried[key]!r}, which was the original '
                                 f"{type(module).__name__}'s {key!r}")
            if current.shape != tensor.shape:
                raise ValueError(f"the swapped layer's {carried[key]!r} is {tuple(current.shape)}, the original "
                                 f"{type(module).__name__}'s {key!r} {tuple(tensor.shape)}: it was resized after the "
                                 'swap (a new input size), and the original module keeps the old size')
        elif reference is not None:
            current = tensor.to(reference.device, reference.dtype if tensor.is_floating_point() else tensor.dtype)
        else:
            continue
        if current is not tensor:
            puts.append((key, current))

    def restore() -> nn.Module:
        for key, current in puts:
            _put(module, key, current)
        return module
    return restore


def _state(module: nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by key, non-persistent buffers too."""
    return {**dict(module.named_buffers(remove_duplicate=False)),
            **dict(module.named_parameters(remove_duplicate=False))}


def _put(module: nn.Module, key: str, tensor: torch.Tensor) -> None:
    parent_path, _, name = key.rpartition('.')
    parent = module.get_submodule(parent_path)
    if name in dict(parent.named_parameters(recurse=False)) and not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=parent.get_parameter(name).requires_grad)
    setattr(parent, name, tensor)
