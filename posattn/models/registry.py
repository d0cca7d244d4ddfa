"""Model names -> builders, behind ``posattn.create_model`` (timm's entry-point pattern)."""
from __future__ import annotations

import argparse
import functools
import os
import pickle
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar, Union

import torch
from torch import nn

from ..convert import to_posattn_layout

__all__ = ['register_model', 'create_model', 'list_models']

_MODELS: Dict[str, Callable[..., nn.Module]] = {}
_LISTED = 8  # keys shown per kind of mismatch

Builder = TypeVar('Builder', bound=Callable[..., nn.Module])
Shapes = Dict[str, Tuple[int, ...]]


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator that makes a builder function available to :func:`create_model` as ``name``."""
    def add(builder: Builder) -> Builder:
        if name in _MODELS and _MODELS[name] is not builder:
            raise ValueError(f'model name {name!r} is already registered by {_MODELS[name].__qualname__}')
        _MODELS[name] = builder
        _default_shapes.cache_clear()
        return builder
    return add


def list_models() -> List[str]:
    """Names of the registered models, sorted."""
    return sorted(_MODELS)


def create_model(name: str, checkpoint: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` with the builder's keyword arguments.

    Args:
        name: a registered model (``posattn.list_models()``).
        checkpoint: path of weights to load, in posattn's layout or a foreign one that
            :func:`posattn.convert.to_posattn_layout` recognises (the PerViT release's), as a
            state_dict or a training checkpoint holding it under ``'model'``. Read with
            ``torch.load(weights_only=True)`` and loaded strictly; a checkpoint that does not fit
            raises a ValueError listing the missing, unexpected and mis-shaped keys and naming
            the registered model it fits.
        **kwargs: the builder's options (``num_classes``, ``drop_path_rate``, ...).
    """
    try:
        builder = _MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f'unknown model {name!r}; known: {", ".join(list_models()) or "none"}') from None
    state_dict = _read_checkpoint(checkpoint) if checkpoint is not None else None
    model = builder(**kwargs)
    if state_dict is not None:
        state_dict, layout = to_posattn_layout(state_dict)
        _check_fits(model, name, state_dict, f'checkpoint {os.fspath(checkpoint)} ({layout} layout)')
        model.load_state_dict(state_dict, strict=True)
    return model


def _read_checkpoint(path: Union[str, os.PathLike]) -> Mapping[str, Any]:
    # DeiT-style training checkpoints (the PerViT release's among them) keep their argparse
    # arguments beside the weights: a plain attribute bag, safe to allow.
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(f'{os.fspath(path)} holds objects other than tensors and plain containers, which '
                         'weights-only loading refuses; if you trust the file, load it yourself and '
                         'torch.save its state_dict alone') from error


@functools.lru_cache(maxsize=None)
def _default_shapes(name: str) -> Optional[Shapes]:
    try:
        model = _MODELS[name]()
    except Exception:  # a builder that needs arguments cannot be recognised from a checkpoint
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _fitting_model(shapes: Shapes) -> Optional[str]:
    """The registered model (default options) whose keys are exactly ``shapes``' and whose shapes
    agree outside the classifier, or None."""
    for name in list_models():
        expected = _default_shapes(name)
        if expected is not None and expected.keys() == shapes.keys() and all(
                expected[k] == shapes[k] for k in shapes if not k.startswith('head.')):
            return name
    return None


def _check_fits(model: nn.Module, name: str, state_dict: Mapping[str, Any], source: str) -> None:
    """Raise a ValueError describing every difference between ``state_dict`` and ``model``'s."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(getattr(v, 'shape', ())) for k, v in state_dict.items()}
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [k for k in expected if k in found and found[k] != expected[k]]
    if not (missing or unexpected or wrong):
        return
    lines = [f'{source} does not fit {name}:']
    fitting = _fitting_model(found)
    if fitting is not None and fitting != name:
        lines.append(f'  this is a {fitting} checkpoint: create_model({fitting!r}, checkpoint=...)')
    elif not (missing or unexpected) and all(k.startswith('head.') for k in wrong) and 'head.weight' in found:
        lines.append(f'  only the classifier differs: pass num_classes={found["head.weight"][0]}')
    wrong = [f'{k}: checkpoint {found[k]}, model {expected[k]}' for k in wrong]
    for label, items in (('missing keys', missing), ('unexpected keys', unexpected), ('wrong shapes', wrong)):
        if items:
            more = f'; ... ({len(items) - _LISTED} more)' if len(items) > _LISTED else ''
            lines.append(f'  {label} ({len(items)}): {"; ".join(items[:_LISTED])}{more}')
    raise ValueError('\n'.join(lines))
