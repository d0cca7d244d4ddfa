"""The one registry that maps Φp names to their classes."""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

from .base import PositionalModule
from .stack import PhiStack

__all__ = ['register_phi', 'build_phi', 'list_phis', 'phi_class', 'build_layer_phi', 'checked_phi_list']

_PHIS: Dict[str, Type[PositionalModule]] = {}

PhiClass = TypeVar('PhiClass', bound=Type[PositionalModule])
# one Φp's options, or one dict (or None) per Φp of a list
PhiOptions = Optional[Union[Mapping[str, Any], Sequence[Optional[Mapping[str, Any]]]]]


def register_phi(name: str) -> Callable[[PhiClass], PhiClass]:
    """Class decorator that makes a :class:`PositionalModule` buildable by ``name``."""
    def add(cls: PhiClass) -> PhiClass:
        if not (isinstance(cls, type) and issubclass(cls, PositionalModule)):
            raise TypeError(f'register_phi({name!r}) expects a PositionalModule subclass, got {cls!r}')
        if name in _PHIS and _PHIS[name] is not cls:
            raise ValueError(f'Φp name {name!r} is already registered by {_PHIS[name].__qualname__}')
        _PHIS[name] = cls
        cls.registered_name = name
        return cls
    return add


def list_phis() -> List[str]:
    """Names of the registered Φp, sorted."""
    return sorted(_PHIS)


def phi_class(name: str) -> Type[PositionalModule]:
    try:
        return _PHIS[name]
    except (KeyError, TypeError):
        raise ValueError(f'unknown Φp {name!r}; known: {", ".join(list_phis())}') from None


def _options(cls: Type[PositionalModule]) -> Mapping[str, inspect.Parameter]:
    params = dict(inspect.signature(cls.__init__).parameters)
    params.pop('self', None)
    return params


def build_phi(name: str, **cfg: Any) -> PositionalModule:
    """Build the Φp registered as ``name`` with its options ``cfg``."""
    cls = phi_class(name)
    options = _options(cls)
    unknown = sorted(set(cfg) - set(options), key=str)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in options.values()):
        nearest = [f'{option!r} (did you mean {close[0]!r}?)' if (close := difflib.get_close_matches(
            str(option), options, n=1)) else repr(option) for option in unknown]
        raise TypeError(f'Φp {name!r} got unknown option(s) {", ".join(nearest)}; '
                        f'it takes: {", ".join(options) or "no options"}')
    return cls(**cfg)


PhiSpec = Union[str, Sequence[str]]


def build_layer_phi(name: PhiSpec, phi_cfg: PhiOptions, *, dim: int, num_heads: int,
                    num_prefix_tokens: int = 0, layer_index: int = 0, num_layers: int = 1,
                    table_size: Optional[Tuple[int, int]] = None) -> PositionalModule:
    """Build the Φp of one attention layer, telling it what the layer knows.

    The layer's ``dim``, ``num_heads``, ``head_dim`` (= dim / num_heads), ``num_prefix_tokens``, its
    place among the model's layers (``layer_index`` of ``num_layers``) and, where the model knows it,
    ``table_size``, the token grid it is built for (a ViT's ``img_size`` in patches: the grid a Φp
    learns a table of offsets for, ``rpb``'s and ``decomposed_rpb``'s), are passed to the Φp's
    constructor where it takes them and ``phi_cfg`` does not set them.

    ``name`` may be a list of names, composed into a :class:`~posattn.phi.stack.PhiStack` in that
    order (``['rope', 'rpb']``); ``phi_cfg`` is then None or a list of as many option dicts (each
    None or a dict), one per name.
    """
    layer = dict(dim=dim, num_heads=num_heads, head_dim=dim // num_heads, num_prefix_tokens=num_prefix_tokens,
                 layer_index=layer_index, num_layers=num_layers)
    if table_size is not None:
        layer['table_size'] = tuple(table_size)
    if isinstance(name, str):
        return _build_with_layer(name, phi_cfg, layer)
    names, configs = checked_phi_list(name, phi_cfg)
    return PhiStack([_build_with_layer(member, config, layer) for member, config in zip(names, configs)])


def checked_phi_list(names: Sequence[str], phi_cfg: PhiOptions) -> Tuple[List[str], List[Optional[Mapping[str, Any]]]]:
    """A list of Φp names and its options, one dict (or None) per name, or an error naming the fix."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f'phi is a registered name or a list of names, e.g. [\'rope\', \'rpb\']; got {names!r}')
    if len(names) < 2:
        raise ValueError(f'a list of Φp combines two or more, got {list(names)}: give the name itself')
    if phi_cfg is None:
        return list(names), [None] * len(names)
    if isinstance(phi_cfg, Mapping) or len(phi_cfg) != len(names):
        raise ValueError(f'phi={list(names)} takes phi_cfg as a list of {len(names)} option dicts (or None), one '
                         f'per Φp in the same order, e.g. [dict(), dict(table_size=(14, 14))]; got {phi_cfg!r}')
    for config in phi_cfg:
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f'each entry of phi_cfg is a dict of one Φp\'s options or None, got {config!r}')
    return list(names), list(phi_cfg)


def _build_with_layer(name: str, phi_cfg: Optional[Mapping[str, Any]], layer: Mapping[str, Any]) -> PositionalModule:
    if phi_cfg is not None and not isinstance(phi_cfg, Mapping):
        raise TypeError(f'phi_cfg of the Φp {name!r} is a dict of its options, got {phi_cfg!r}')
    cfg = dict(phi_cfg or {})
    options = _options(phi_class(name))
    for key, value in layer.items():
        if key in options and key not in cfg:
            cfg[key] = value
    return build_phi(name, **cfg)
