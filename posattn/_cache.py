"""Caches of tensors that are never stale and never hand out a tensor of the wrong kind.

Two kinds of cached value appear in posattn:

* constants of the token grid (distance moments, bucket ids): pure functions of a few integers
  and a device, cached per argument tuple by :func:`grid_constant`;
* a Φp's positional bias at evaluation, a function of the grid *and of the Φp's parameters*,
  cached by :class:`ParameterValueCache` under the parameters' values, not their identity.

Both cache only plain tensors (exactly ``torch.Tensor``, made outside ``inference_mode``): a fake
tensor of ``torch.export``, a functional tensor of a compiler or an inference tensor is computed
again every time and never stored, so whatever mode first asked cannot poison later callers.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence, Tuple, TypeVar

import torch

__all__ = ['grid_constant', 'ParameterValueCache', 'is_plain_tensor']

Value = TypeVar('Value')


def is_plain_tensor(tensor: torch.Tensor) -> bool:
    """A real ``torch.Tensor`` (or Parameter) with storage, made outside ``inference_mode``: not a
    fake, functional or meta tensor."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != 'meta'
            and not tensor.is_inference())


def _all_plain(value: Any) -> bool:
    tensors = value if isinstance(value, tuple) else (value,)
    return all(is_plain_tensor(t) for t in tensors)


def _cacheable_context() -> bool:
    return not torch.compiler.is_compiling()


def grid_constant(maxsize: int) -> Callable[[Callable[..., Value]], Callable[..., Value]]:
    """Least-recently-used cache of a pure function of hashable arguments that returns a tensor or
    a tuple of tensors.

    The function runs with autograd off and outside ``inference_mode``, so what it returns can
    serve any later caller; a result that is not plain (under a fake mode or a compiler) is
    returned but not kept. ``.cache_clear()`` empties the cache.
    """
    def decorate(function: Callable[..., Value]) -> Callable[..., Value]:
        entries: 'OrderedDict[Tuple[Hashable, ...], Value]' = OrderedDict()

        @functools.wraps(function)
        def cached(*args: Hashable, **kwargs: Hashable) -> Value:
            if not _cacheable_context():
                return function(*args, **kwargs)
            key = (args, tuple(sorted(kwargs.items())))
            if key in entries:
                entries.move_to_end(key)
                return entries[key]
            with torch.inference_mode(False), torch.no_grad():
                value = function(*args, **kwargs)
            if _all_plain(value):
                entries[key] = value
                while len(entries) > maxsize:
                    entries.popitem(last=False)
            return value

        cached.cache_clear = entries.clear  # type: ignore[attr-defined]
        return cached
    return decorate


class ParameterValueCache:
    """Up to ``maxsize`` values computed from a few small parameters, reused while their values
    are unchanged.

    Each entry is stored with a copy of the parameters' values (Φp has a few thousand numbers a
    layer) and served only while they are bit-for-bit equal, so no way of changing a parameter
    leaves it stale: optimiser steps (fused ones included), ``.data`` writes, EMA updates,
    ``load_state_dict`` with or without ``assign``, dtype or device moves. The comparison reads the
    values, which on a GPU waits for the work that writes them.
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: 'OrderedDict[Hashable, Tuple[torch.Tensor, torch.Tensor]]' = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def __getstate__(self) -> dict:
        # Pickles and deep copies start empty: the entries are derived data.
        return {'maxsize': self.maxsize, '_entries': OrderedDict()}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, parameters: Sequence[torch.Tensor],
            compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The cached value for ``key`` and the current values of ``parameters``, or ``compute()``.

        ``compute`` runs with autograd off and outside ``inference_mode``; nothing is cached
        under a compiler or when a parameter is not a plain tensor.
        """
        if not (_cacheable_context() and all(is_plain_tensor(p) for p in parameters)):
            return compute()
        first = parameters[0]
        key = (key, first.dtype, first.device)
        values = torch.cat([p.detach().reshape(-1) for p in parameters])
        entry = self._entries.get(key)
        if entry is not None and torch.equal(entry[0], values):
            self._entries.move_to_end(key)
            return entry[1]
        with torch.inference_mode(False), torch.no_grad():
            value = compute()
            values = values.clone()  # the snapshot must not follow later in-place writes
        if is_plain_tensor(value):
            self._entries[key] = (values, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return value
