"""The token grid of each call of a swapped model, carried with the call.

A swapped attention replaces a module that its model calls with tokens alone, so the (H, W) of
those tokens comes from the model's patch embedding. That grid belongs to one call of the model,
and a :class:`GridTracker` keeps it per call, never in an attribute that another call overwrites:

* the patch embedding's output sets it in a context variable: every thread (and asyncio task) has
  its own, so concurrent calls of one model at different sizes each see their own grid;
* each block that holds a swapped attention tags the tensors it takes and returns with the grid it
  ran on. An activation-checkpointing recompute runs a block again during the backward pass, with
  the tensors it took in the forward pass (the same tensors, or detached aliases of their
  storage), so it finds the grid of the forward it repeats, not that of the latest forward; so
  does a block called again from inside another call of the model (re-entrant calls);
* the attention looks for its grid in this order: a tensor of its own call that a block tagged
  (the recompute of a layer that checkpoints inside itself passes its input as ``identity``), the
  block it runs in, the latest patch embedding of this thread.

Tags live as long as the tagged tensors (weak references) and cost a few dictionary operations
per block. Under ``torch.compile`` the whole call is one traced graph, with no threads or
recomputes of its own: the grid is then a plain value of the trace.
"""
from __future__ import annotations

import threading
from copy import deepcopy
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..grid import TokenGrid
from ..layout import ImageLayout

__all__ = ['GridTracker', 'PatchGrid']

HW = Tuple[int, int]
# What a call's patch embedding gives: one (H, W) for every image, or a grid per image.
Where = Union[HW, ImageLayout]
# How a family reads it from its patch embedding's call: (module, args, kwargs, output) -> Where.
PatchGrid = Callable[[nn.Module, Tuple[Any, ...], Dict[str, Any], Any], Where]
# Per context: tracker -> the grid (or layout) of the latest patch embedding, and of the innermost running block.
_PATCH_GRIDS: ContextVar[Mapping['GridTracker', Where]] = ContextVar('posattn_patch_grids', default={})
_BLOCK_GRIDS: ContextVar[Mapping['GridTracker', Where]] = ContextVar('posattn_block_grids', default={})
_BLOCK_TOKENS: ContextVar[Tuple[Any, ...]] = ContextVar('posattn_block_tokens', default=())


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(value)


def _storage_key(tensor: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """Where a tensor's elements live: shared by its detached aliases, None where it has no storage
    of its own to tell it by (meta, fake and other non-plain tensors)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.device.type == 'meta':
        return None
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0:
        return None
    return tensor.device, pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


class _TensorGrids:
    """Grids tagged on live tensors, found again by the tensor or by a detached alias of it.

    An entry holds a weak reference and goes when its tensor is freed, so a storage address is
    never matched after its tensor is gone. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # RLock: a weak reference's callback may fire inside
        self._by_storage: Dict[Tuple[Any, ...], Tuple[weakref.ref, Where]] = {}

    def __len__(self) -> int:
        return len(self._by_storage)

    def tag(self, tensor: torch.Tensor, hw: Where) -> None:
        key = _storage_key(tensor)
        if key is None:
            return

        def forget(ref: weakref.ref, key: Tuple[Any, ...] = key) -> None:
            with self._lock:
                if self._by_storage.get(key, (None,))[0] is ref:
                    del self._by_storage[key]

        with self._lock:
            self._by_storage[key] = (weakref.ref(tensor, forget), hw)

    def find(self, tensors: Iterable[torch.Tensor]) -> Optional[Where]:
        for tensor in tensors:
            key = _storage_key(tensor)
            if key is None:
                continue
            with self._lock:
                entry = self._by_storage.get(key)
            if entry is not None and entry[0]() is not None:
                return entry[1]
        return None


class GridTracker:
    """The token grid of each call of one swapped model (see the module's description).

    :meth:`attach` hooks the model's patch projection, whose (B, C, H, W) output gives the grid,
    and the blocks that hold its swapped attentions; :meth:`grid` is what a swapped attention
    asks. The hooks' handles are kept: :meth:`detach` removes them.
    """

    def __init__(self) -> None:
        self.handles: List[RemovableHandle] = []
        self._tagged = _TensorGrids()
        self._traced_hw: Optional[Where] = None
        self._patch_grid: PatchGrid = _output_grid

    def attach(self, patch_projection: nn.Module, blocks: Iterable[nn.Module],
               patch_grid: Optional[PatchGrid] = None) -> 'GridTracker':
        """``patch_grid``: how the patch embedding's call gives the grid, (H, W) or a layout of a
        grid per image; by default its output, (B, C, H, W)."""
        self._patch_grid = patch_grid or _output_grid
        self.handles.append(patch_projection.register_forward_hook(self._record_patch_grid, with_kwargs=True))
        for block in dict.fromkeys(blocks):  # once each, in order
            self.handles.append(block.register_forward_pre_hook(self._enter_block, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._leave_block, always_call=True))
        return self

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __deepcopy__(self, memo: Dict[int, Any]) -> 'GridTracker':
        # A copied model gets its own tracker; its hooks are copied with the modules' hook dicts
        # and refer to the copy's bound methods through the memo, and so do the handles: the
        # copy's detach removes the copy's hooks.
        copy = GridTracker()
        copy._patch_grid = self._patch_grid
        memo[id(self)] = copy
        copy.handles = deepcopy(self.handles, memo)
        return copy

    def __getstate__(self) -> Dict[str, Any]:
        # patch_grid: a module-level function, pickled by name; the handles refer to the hook dicts
        # pickled with the modules
        return {'patch_grid': self._patch_grid, 'handles': self.handles}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()
        self._patch_grid = state.get('patch_grid', _output_grid)
        self.handles = list(state.get('handles', ()))

    def _record_patch_grid(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                           output: Any) -> None:
        where = self._patch_grid(module, args, kwargs, output)
        if torch.compiler.is_compiling():  # sizes stay symbolic, so export can keep them dynamic
            self._traced_hw = where
        else:
            if not isinstance(where, ImageLayout):
                where = (int(where[0]), int(where[1]))
            _PATCH_GRIDS.set({**_PATCH_GRIDS.get(), self: where})

    def _enter_block(self, block: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return
        inputs = list(_tensors([*args, *kwargs.values()]))
        hw = self._tagged.find(inputs) or _PATCH_GRIDS.get().get(self)
        if hw is not None:
            for tensor in inputs[:1]:
                self._tagged.tag(tensor, hw)
        token = _BLOCK_GRIDS.set({**_BLOCK_GRIDS.get(), self: hw})
        _BLOCK_TOKENS.set(_BLOCK_TOKENS.get() + (token,))

    def _leave_block(self, block: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        tokens = _BLOCK_TOKENS.get()
        if not tokens:
            return
        hw = _BLOCK_GRIDS.get().get(self)
        _BLOCK_TOKENS.set(tokens[:-1])
        _BLOCK_GRIDS.reset(tokens[-1])
        if hw is not None:
            for tensor in _tensors([output]):
                self._tagged.tag(tensor, hw)

    def grid(self, num_prefix_tokens: int, *tensors: Optional[torch.Tensor]) -> Union[TokenGrid, ImageLayout]:
        """The grid of the call under way: that of a block-tagged tensor among ``tensors``, of the
        running block, or of this thread's latest patch embedding; a layout where its images each
        have their own grid."""
        if torch.compiler.is_compiling():
            hw = self._traced_hw
        else:
            hw = (self._tagged.find(t for t in tensors if t is not None) or _BLOCK_GRIDS.get().get(self)
                  or _PATCH_GRIDS.get().get(self))
        if hw is None:
            raise RuntimeError('a swapped attention takes its grid from the patch embedding of its '
                               'model: run the whole model, not the blocks alone')
        if isinstance(hw, ImageLayout):
            return hw
        return TokenGrid(*hw, num_prefix_tokens)


def _output_grid(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> HW:
    """The grid of a patch projection whose output is (B, C, H, W)."""
    if not (isinstance(output, torch.Tensor) and output.dim() == 4):
        raise RuntimeError(f'the patch projection {type(module).__name__} should give (B, C, H, W), '
                           f'got {getattr(output, "shape", type(output))}')
    return output.shape[-2], output.shape[-1]
