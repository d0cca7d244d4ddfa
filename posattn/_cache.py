"""Caches of tensors that are bounded, thread-safe and never hand out a tensor of the wrong kind.

Two kinds of cached value appear in posattn:

* constants of the token grid (distance moments, bucket ids): pure functions of a few integers
  and a device, cached per argument tuple by :func:`grid_constant`, always, within a byte budget
  per function (this module);
* a Φp's positional bias, a function of the grid *and of the Φp's weights*: cached only where a
  user asks for it, by :func:`posattn.cache_positions` (:mod:`posattn.phi.cache`, which builds on
  the bounded store here); otherwise every call computes it.

Both cache only plain tensors (exactly ``torch.Tensor``, made outside ``inference_mode``): a fake
tensor of ``torch.export``, a functional tensor of a compiler or an inference tensor is computed
again every time and never stored, so whatever mode first asked cannot poison later callers.
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Tuple, TypeVar

import torch

__all__ = ['grid_constant', 'is_plain_tensor', 'tensor_bytes', 'cacheable_context', 'BoundedStore']

Value = TypeVar('Value')


def is_plain_tensor(tensor: torch.Tensor) -> bool:
    """A real ``torch.Tensor`` (or Parameter) with storage, made outside ``inference_mode``: not a
    fake, functional or meta tensor."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != 'meta'
            and not tensor.is_inference())


def _all_plain(value: Any) -> bool:
    tensors = value if isinstance(value, tuple) else (value,)
    return all(is_plain_tensor(t) for t in tensors)


def cacheable_context() -> bool:
    """Not while a compiler or ``torch.jit.trace`` records the computation: the recording must
    compute the constant, not read what an earlier call left."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing())


def tensor_bytes(value: Any) -> int:
    """Bytes held by a tensor or a tuple of tensors."""
    tensors = value if isinstance(value, tuple) else (value,)
    return sum(t.numel() * t.element_size() for t in tensors)


class BoundedStore:
    """Least-recently-used entries within a byte budget, behind one lock. A value larger than the
    whole budget is not kept."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f'max_bytes must be >= 0, got {max_bytes}')
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.entries: 'OrderedDict[Hashable, Tuple[Any, int]]' = OrderedDict()
        self.nbytes = 0

    def get(self, key: Hashable) -> Optional[Any]:
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        with self.lock:
            self._drop(key)
            if nbytes > self.max_bytes:
                return
            self.entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                self._drop(next(iter(self.entries)))

    def discard(self, key: Hashable) -> None:
        with self.lock:
            self._drop(key)

    def discard_where(self, condition: Callable[[Hashable], bool]) -> None:
        """Drop every entry whose key meets ``condition``."""
        with self.lock:
            for key in [key for key in self.entries if condition(key)]:
                self._drop(key)

    def _drop(self, key: Hashable) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.nbytes = 0


def grid_constant(max_bytes: int) -> Callable[[Callable[..., Value]], Callable[..., Value]]:
    """Least-recently-used cache of a pure function of hashable arguments that returns a tensor or
    a tuple of tensors, holding at most ``max_bytes`` (thread-safe).

    The function runs with autograd off and outside ``inference_mode``, so what it returns can
    serve any later caller; a result that is not plain (under a fake mode or a compiler), or larger
    than the budget, is returned but not kept. ``.cache_clear()`` empties the cache;
    ``.cache_nbytes()`` says how much it holds.
    """
    def decorate(function: Callable[..., Value]) -> Callable[..., Value]:
        entries = BoundedStore(max_bytes)

        @functools.wraps(function)
        def cached(*args: Hashable, **kwargs: Hashable) -> Value:
            if not cacheable_context():
                return function(*args, **kwargs)
            key = (args, tuple(sorted(kwargs.items())))
            value = entries.get(key)
            if value is not None:
                return value
            with torch.inference_mode(False), torch.no_grad():
                value = function(*args, **kwargs)
            if _all_plain(value):
                entries.put(key, value, tensor_bytes(value))
            return value

        cached.cache_clear = entries.clear  # type: ignore[attr-defined]
        cached.cache_nbytes = lambda: entries.nbytes  # type: ignore[attr-defined]
        return cached
    return decorate
