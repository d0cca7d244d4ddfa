"""Loading checkpoints in mmengine 0.10.7 under torch >= 2.6, deliberately and in one place.

torch 2.6 made ``torch.load`` weights-only by default. mmengine 0.10.7's local loader calls
``torch.load(filename, map_location)`` and so fails on the checkpoints mmengine itself writes:
their ``message_hub`` holds :class:`~mmengine.logging.HistoryBuffer` objects and numpy arrays,
which the weights-only unpickler refuses. That breaks ``--resume``, ``load_from`` and
``tools/test.py``.

The fix keeps weights-only loading for every file and widens it by an explicit allow-list:
:func:`load_local_checkpoint` replaces mmengine's loader for local paths (through mmengine's own
``CheckpointLoader.register_scheme(..., force=True)``) and reads through posattn's one checkpoint
reader, :func:`posattn.convert.read_checkpoint` (``torch.load(weights_only=True)``, with errors
that name an empty, truncated or foreign file), after adding to its allow-list
(:func:`posattn.convert.allow_checkpoint_globals`)

* the plain-data classes mmengine puts in its checkpoints (``HistoryBuffer``, numpy arrays,
  dtypes and scalars), which rebuild from their state and run no code of the file's choosing;
* ``getattr`` as pickled by a ``HistoryBuffer`` (its table of statistics methods is stored as
  ``getattr(HistoryBuffer, 'mean')`` ...), narrowed to exactly those lookups by
  :func:`history_buffer_method`: allowing the real ``getattr`` would let a file reach any
  attribute of any allowed object;
* ``argparse.Namespace``, which DeiT-style training checkpoints (the PerViT release's) keep
  beside the weights.

Anything else in a file (a pickled function, a module, an arbitrary class) is still refused,
with an error naming the global; foreign pretrained weights therefore load weights-only. Nothing
switches weights-only loading off globally (no ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``).
"""
from __future__ import annotations

import argparse
import os
import pickle
from typing import Any, List, Optional

import numpy as np
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader

from posattn.convert import allow_checkpoint_globals, read_checkpoint

__all__ = ['MMENGINE_CHECKPOINT_GLOBALS', 'history_buffer_method', 'load_local_checkpoint',
           'register_checkpoint_loader']


def _numpy_globals() -> List[Any]:
    """numpy's array, dtype and scalar reconstructors (their module moved in numpy 2)."""
    multiarray = getattr(getattr(np, '_core', None), 'multiarray', None) or np.core.multiarray
    dtype_classes = [type(np.dtype(name)) for name in
                     ('bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'float16', 'float32', 'float64')]
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtype_classes]


_HISTORY_BUFFER_STATISTICS = frozenset({'min', 'max', 'mean', 'current'})


def history_buffer_method(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` for the one case mmengine checkpoints pickle: a statistics method
    of :class:`HistoryBuffer`; anything else is refused."""
    allowed = _HISTORY_BUFFER_STATISTICS | set(HistoryBuffer._statistics_methods)  # + registered ones
    if owner is HistoryBuffer and name in allowed:
        return getattr(owner, name)
    raise pickle.UnpicklingError(f'refusing getattr({owner!r}, {name!r}): a checkpoint may only look up '
                                 f'HistoryBuffer statistics methods ({sorted(allowed)})')


MMENGINE_CHECKPOINT_GLOBALS: List[Any] = [HistoryBuffer, argparse.Namespace, *_numpy_globals(),
                                          (history_buffer_method, 'builtins.getattr')]


def load_local_checkpoint(filename: str, map_location: Optional[Any] = None) -> Any:
    """:func:`posattn.convert.read_checkpoint` with :data:`MMENGINE_CHECKPOINT_GLOBALS` allowed.

    The signature and the missing-file error of mmengine's ``load_from_local``, which this
    replaces; a file holding objects outside the allow-list raises ``pickle.UnpicklingError``.
    """
    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'{filename} can not be found.')
    try:
        return read_checkpoint(filename, map_location=map_location or 'cpu')
    except ValueError as error:
        if not isinstance(error.__cause__, pickle.UnpicklingError):
            raise  # empty, truncated or not a PyTorch file: read_checkpoint's message names it
        raise pickle.UnpicklingError(
            f'{filename} holds objects that weights-only loading refuses and that are not among the '
            f'mmengine checkpoint types posattn_openmmlab.checkpoint allows. If you trust the '
            f'file, load it yourself and torch.save its state_dict alone.\n{error.__cause__}') from error


def register_checkpoint_loader() -> None:
    """Make :func:`load_local_checkpoint` mmengine's loader for local paths (idempotent)."""
    allow_checkpoint_globals(MMENGINE_CHECKPOINT_GLOBALS)
    CheckpointLoader.register_scheme(prefixes='', loader=load_local_checkpoint, force=True)
