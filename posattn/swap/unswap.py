"""The reverse of :func:`~posattn.swap.swap_attention`: the model's own attention modules back in
place, carrying the weights the swapped layers hold now."""
from __future__ import annotations

import functools
from typing import Callable, List

from torch import nn

from .core import SwappedAttention, described
from .originals import Detached, restoration
from .spec import AFTER_SWAP

__all__ = ['unswap']

_LISTED = 4  # Φp parameters named in an error


def unswap(model: nn.Module, *, drop_phi: bool = False) -> nn.Module:
    """Put back, in place of every swapped attention layer of ``model``, a module of the class it
    replaced, holding the layer's current (possibly fine-tuned) weights: q/k/v, projections, norms,
    and with ``phi='own'`` the model's own tables and frequencies that the Φp trained. The model's
    state dict keys are again those it had before the swap, its outputs those of its own attention
    (with ``phi='none'``, the swapped model's), and it is in the same train / eval mode.

    Also undone: the grid trackers' hooks, the modules a conversion detached, the swap's record
    in a transformers config, and the freezing of the model's own position parameters by
    ``own_positions=False`` (which keep their values: absolute embeddings stay zero).

    Args:
        model: changed in place; it or its submodules were swapped by :func:`swap_attention`.
        drop_phi: a named Φp's trained parameters have no place in the original model, so a model
            whose swapped layers hold any is refused; with True they are dropped.

    Returns:
        ``model``. Nothing changes when a ValueError is raised.
    """
    layers = [(path, layer) for path, layer in model.named_modules() if isinstance(layer, SwappedAttention)]
    if not layers:
        raise ValueError(f'{described(model)} has no swapped attention layer to unswap')
    for path, layer in layers:
        if layer.original is None:
            raise ValueError(f'{path or "the model"} is a {type(layer).__name__} that keeps no original module '
                             '(saved by a posattn without unswap): build the original model and load its weights')
    unkept = [f'{path}.{key}' if path else key for path, layer in layers for key in _unkept_parameters(layer)]
    if unkept and not drop_phi:
        more = f', ... ({len(unkept) - _LISTED} more)' if len(unkept) > _LISTED else ''
        raise ValueError(f'{described(model)}: the original attention has no place for {len(unkept)} trained Φp '
                         f'parameters ({", ".join(unkept[:_LISTED])}{more}); unswap(model, drop_phi=True) drops them')
    steps = [step for path, layer in layers for step in _putting_back(model, path, layer)]
    for step in steps:  # every check passed: the model changes from here
        step()
    for tracker in {id(layer.grid_tracker): layer.grid_tracker for _, layer in layers if layer.grid_tracker}.values():
        tracker.detach()
    for param in {id(p): p for _, layer in layers for p in layer.frozen_by_swap}.values():
        param.requires_grad_(True)
    for _, undo in AFTER_SWAP:
        if undo is not None:
            undo(model)
    return model


def _unkept_parameters(layer: SwappedAttention) -> List[str]:
    """The keys of ``layer``'s parameters that no module put back holds."""
    carried = {key for _, key in layer.original.keys} | {key for d in layer.detached for _, key in d.original.keys}
    return [key for key, _ in layer.named_parameters() if key not in carried]


def _putting_back(model: nn.Module, path: str, layer: SwappedAttention) -> List[Callable[[], None]]:
    """The steps that put ``layer``'s original module (and the modules a conversion detached beside
    it) back with its current weights; checked now, run later."""
    parent_path, _, name = path.rpartition('.')
    parent = model.get_submodule(parent_path)
    original = restoration(layer.original, layer)
    steps = [lambda: setattr(parent, name, original().train(layer.training))]
    for detached in layer.detached:
        steps.append(functools.partial(_reattach, detached, restoration(detached.original, layer)))
    return steps


def _reattach(detached: Detached, module: Callable[[], nn.Module]) -> None:
    setattr(detached.parent, detached.name, module())
    if detached.renaming is not None:
        detached.renaming.remove()
