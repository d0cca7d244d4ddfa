"""The cache of Φp position terms that :func:`posattn.cache_positions` opens, and which Φp it serves.

A Φp's positional bias is a function of the grid and of the Φp's weights. Outside a
``cache_positions`` block every call computes it; inside, :class:`PositionCache` keeps it per
(module, grid, dtype, device) and serves it while the tensors it was computed from are unchanged.

Which cache serves a module is kept here, by module identity (weak references), never on the module:
a copy of a module (``copy.deepcopy``, ``pickle``, ``torch.save(model)``) made inside a block is a
module that no block attached, so it computes every call, as any module outside a block.
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .._cache import BoundedStore, cacheable_context, is_plain_tensor, tensor_bytes
from .._compat import tensor_version

__all__ = ['PositionCache', 'attached_cache', 'attach', 'detach']


class _Entry(NamedTuple):
    value: torch.Tensor
    value_version: int
    inputs: Tuple[weakref.ref, ...]
    input_states: Tuple[Tuple[int, torch.dtype], ...]


def _state(tensor: torch.Tensor) -> Tuple[int, torch.dtype]:
    return tensor_version(tensor), tensor.dtype


class PositionCache:
    """Position terms of Φp modules, kept per (module, key) within ``max_bytes``.

    Made and attached by :func:`posattn.cache_positions`. An entry is served only while every tensor
    its value was computed from is the very tensor it was, of the same dtype, and unchanged by
    autograd's count of in-place writes (optimiser steps, fused ones included, ``load_state_dict``,
    ``copy_``), and while the served tensor itself was not written in place (by a hook, say). A
    module's entries are dropped when the module is converted (``.to``, ``.half``, ``.double``:
    its ``_apply``). The checks read counters on the host, never the values, so they cost no device
    synchronisation. Writes through ``.data`` bypass those counters: after one, call :meth:`clear`.
    Nothing is cached where autograd may need the value (training, or an input that requires grad
    under grad mode), nor inside ``torch.compile`` (the compiled graph computes it). Thread-safe.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self._entries = BoundedStore(max_bytes)

    @property
    def max_bytes(self) -> int:
        return self._entries.max_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the cached values hold now."""
        return self._entries.nbytes

    def __len__(self) -> int:
        return len(self._entries.entries)

    def clear(self) -> None:
        self._entries.clear()

    def forget(self, owner: nn.Module) -> None:
        """Drop every entry of ``owner``."""
        self._entries.discard_where(lambda key: key[0] is owner)

    def __getstate__(self) -> dict:
        # Pickles and deep copies start empty: the entries are derived data.
        return {'max_bytes': self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state['max_bytes'])

    def get(self, owner: nn.Module, key: Hashable, inputs: Sequence[torch.Tensor],
            compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()``'s value for ``owner`` and ``key``, from the cache while ``inputs`` (the
        tensors it is computed from, as read for this call) are unchanged."""
        if (owner.training or not cacheable_context() or not all(is_plain_tensor(t) for t in inputs)
                or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))):
            return compute()
        key = (owner, key)
        entry = self._entries.get(key)
        if (entry is not None and tensor_version(entry.value) == entry.value_version
                and len(entry.inputs) == len(inputs)
                and all(ref() is t and _state(t) == state
                        for ref, state, t in zip(entry.inputs, entry.input_states, inputs))):
            return entry.value
        with torch.inference_mode(False), torch.no_grad():
            value = compute()
        if is_plain_tensor(value):
            self._entries.put(key, _Entry(value, tensor_version(value), tuple(weakref.ref(t) for t in inputs),
                                          tuple(_state(t) for t in inputs)), tensor_bytes(value))
        else:
            self._entries.discard(key)
        return value


_lock = threading.Lock()
# Per module, the caches of the blocks open on it, oldest first: the newest serves it. A block
# removes its own cache wherever it stands, so blocks may close in any order, from any thread.
_attached: 'weakref.WeakKeyDictionary[nn.Module, List[PositionCache]]' = weakref.WeakKeyDictionary()


def attached_cache(module: nn.Module) -> Optional[PositionCache]:
    """The cache serving ``module`` now (that of the newest block open on it), or None."""
    with _lock:
        caches = _attached.get(module)
        return caches[-1] if caches else None


def attach(modules: Sequence[nn.Module], cache: PositionCache) -> None:
    """Serve ``modules`` from ``cache`` until :func:`detach` removes it."""
    with _lock:
        for module in modules:
            _attached.setdefault(module, []).append(cache)


def detach(modules: Sequence[nn.Module], cache: PositionCache) -> None:
    """Stop serving ``modules`` from ``cache``; each is served again by the newest cache still
    attached to it, or by none."""
    with _lock:
        for module in modules:
            caches = _attached.get(module, [])
            kept = [attached for attached in caches if attached is not cache]
            if kept:
                _attached[module] = kept
            else:
                _attached.pop(module, None)
