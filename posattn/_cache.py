"""Caches of tensors that are bounded, thread-safe and never hand out a tensor of the wrong kind.

Two kinds of cached value appear in posattn:

* constants of the token grid (distance moments, bucket ids): pure functions of a few integers
  and a device, cached per argument tuple by :func:`grid_constant`, always, within a byte budget
  per function;
* a Φp's positional bias, a function of the grid *and of the Φp's weights*: cached only where a
  user asks for it, by :func:`posattn.cache_positions` (:class:`PositionCache`); otherwise every
  call computes it.

Both cache only plain tensors (exactly ``torch.Tensor``, made outside ``inference_mode``): a fake
tensor of ``torch.export``, a functional tensor of a compiler or an inference tensor is computed
again every time and never stored, so whatever mode first asked cannot poison later callers.
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

import torch

__all__ = ['grid_constant', 'PositionCache', 'cache_positions', 'is_plain_tensor', 'tensor_bytes']

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
    """Not while a compiler or ``torch.jit.trace`` records the computation: the recording must
    compute the constant, not read what an earlier call left."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing())


def tensor_bytes(value: Any) -> int:
    """Bytes held by a tensor or a tuple of tensors."""
    tensors = value if isinstance(value, tuple) else (value,)
    return sum(t.numel() * t.element_size() for t in tensors)


class _LRU:
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
        entries = _LRU(max_bytes)

        @functools.wraps(function)
        def cached(*args: Hashable, **kwargs: Hashable) -> Value:
            if not _cacheable_context():
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


class _Entry(NamedTuple):
    value: torch.Tensor
    value_version: int
    inputs: Tuple[weakref.ref, ...]
    input_versions: Tuple[int, ...]


class PositionCache:
    """Positional biases of Φp modules, kept per (module, grid, dtype, device) within ``max_bytes``.

    Made and attached by :func:`cache_positions`. An entry is served only while every tensor its
    bias was computed from is the very tensor it was (a parametrized or pruned weight is a new
    tensor at every call, so it is never served) and unchanged by autograd's count of in-place
    writes (optimiser steps, fused ones included, ``load_state_dict``, ``copy_``), and while the
    served tensor itself was not written in place (by a hook, say): the checks read counters on
    the host, never the values, so they cost no device synchronisation. Writes through ``.data``
    bypass those counters: after one, call :meth:`clear`. Nothing is cached where autograd may
    need the bias (training, or a weight that requires grad under grad mode), nor inside
    ``torch.compile`` (the compiled graph computes it). Thread-safe.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self._entries = _LRU(max_bytes)

    @property
    def max_bytes(self) -> int:
        return self._entries.max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the cached biases hold now."""
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries.entries)

    def clear(self) -> None:
        self._entries.clear()

    def __getstate__(self) -> dict:
        # Pickles and deep copies start empty: the entries are derived data.
        return {'max_bytes': self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state['max_bytes'])

    def get(self, owner: torch.nn.Module, key: Hashable, inputs: Sequence[torch.Tensor],
            compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``'s value for ``owner`` and ``key``, from the cache while ``inputs`` (the
        tensors it is computed from, as read for this call) are unchanged."""
        if (owner.training or not _cacheable_context() or not all(is_plain_tensor(t) for t in inputs)
                or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))):
            return compute()
        key = (owner, key)
        entry = self._entries.get(key)
        if (entry is not None and entry.value._version == entry.value_version
                and len(entry.inputs) == len(inputs)
                and all(ref() is t and t._version == version
                        for ref, version, t in zip(entry.inputs, entry.input_versions, inputs))):
            return entry.value
        with torch.inference_mode(False), torch.no_grad():
            value = compute()
        if is_plain_tensor(value):
            self._entries.put(key, _Entry(value, value._version, tuple(weakref.ref(t) for t in inputs),
                                          tuple(t._version for t in inputs)), tensor_bytes(value))
        else:
            self._entries.discard(key)
        return value


@contextmanager
def cache_positions(model: torch.nn.Module, max_bytes: int = 1 << 30) -> Iterator[PositionCache]:
    """Reuse the positional biases of ``model``'s Φp modules across calls, within ``max_bytes``.

        with posattn.cache_positions(model.eval()) as cache:
            for images in loader:
                logits = model(images)

    Inside the block, a Φp whose bias does not depend on the tokens (``peripheral``, ``rpb``,
    ``alibi``, ``irpe`` in bias mode) computes it once per grid, dtype and device and serves it again while its weights
    are unchanged (:class:`PositionCache` says what it checks). Leaving the block detaches and
    empties the cache, freeing its memory; ``cache.clear()`` empties it inside. Outside such a
    block nothing is cached: every call computes its bias.
    """
    from .phi.base import PositionalModule  # the Φp modules sit above this module

    cache = PositionCache(max_bytes)
    phis: List[PositionalModule] = [m for m in model.modules() if isinstance(m, PositionalModule)]
    previous = [phi.position_cache for phi in phis]
    for phi in phis:
        phi.position_cache = cache
    try:
        yield cache
    finally:
        for phi, before in zip(phis, previous):
            phi.position_cache = before
        cache.clear()


