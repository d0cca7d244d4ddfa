"""Model names -> builders, behind ``posattn.create_model`` (timm's entry-point pattern)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, TypeVar

from torch import nn

__all__ = ['register_model', 'create_model', 'list_models']

_MODELS: Dict[str, Callable[..., nn.Module]] = {}

Builder = TypeVar('Builder', bound=Callable[..., nn.Module])


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator that makes a builder function available to :func:`create_model` as ``name``."""
    def add(builder: Builder) -> Builder:
        if name in _MODELS and _MODELS[name] is not builder:
            raise ValueError(f'model name {name!r} is already registered by {_MODELS[name].__qualname__}')
        _MODELS[name] = builder
        return builder
    return add


def list_models() -> List[str]:
    """Names of the registered models, sorted."""
    return sorted(_MODELS)


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` with the builder's keyword arguments."""
    try:
        builder = _MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f'unknown model {name!r}; known: {", ".join(list_models()) or "none"}') from None
    return builder(**kwargs)
