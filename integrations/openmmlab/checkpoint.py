"""Loading checkpoints in mmengine 0.10.7 under torch >= 2.6, deliberately and in one place.

torch 2.6 made ``torch.load`` weights-only by default. mmengine 0.10.7's local loader calls
``torch.load(filename, map_location)`` and so fails on the checkpoints mmengine itself writes:
their ``message_hub`` holds :class:`~mmengine.logging.HistoryBuffer` objects and numpy arrays,
which the weights-only unpickler refuses. That breaks ``--resume``, ``load_from`` and
``tools/test.py``.

The fix keeps weights-only loading for every file and widens it by an explicit allow-list:
:func:`load_local_checkpoint` reads through posattn's one checkpoint reader,
:func:`posattn.convert.read_checkpoint` (``torch.load(weights_only=True)``, with errors that name an
empty, truncated or foreign file), whose allow-list this module extends
(:func:`posattn.convert.allow_checkpoint_globals`, when it is imported) by

* the plain-data classes mmengine puts in its checkpoints (``HistoryBuffer``, numpy arrays,
  dtypes and scalars), which rebuild from their state and run no code of the file's choosing;
* ``getattr`` as pickled by a ``HistoryBuffer`` (its table of statistics methods is stored as
  ``getattr(HistoryBuffer, 'mean')`` ...), narrowed to exactly those lookups by
  :func:`history_buffer_method`: allowing the real ``getattr`` would let a file reach any
  attribute of any allowed object;
* ``argparse.Namespace``, which DeiT-style training checkpoints (the PerViT release's) keep
  beside the weights.

Anything else in a file (a pickled function, a module, an arbitrary class) is still refused,
with an error naming the global; foreign pretrained weights therefore load weights-only.

Who reads this way. mmengine's own ``CheckpointLoader`` is not replaced: code that loads through
it keeps mmengine's behaviour (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` included, where set). posattn's
own code reads through :func:`load_checkpoint_file` (local files by :func:`load_local_checkpoint`,
URLs and remote storage by mmengine's ``CheckpointLoader``): ``PosattnRunner`` (``load_from``,
``--resume``, ``tools/test.py``), the backbones' ``Pretrained`` init and ``tools/analyze.py``.
Code of other libraries that the runner calls (the toolboxes' backbones and mmengine's
``PretrainedInit``, which read ``init_cfg`` checkpoints through ``CheckpointLoader``) reads this
way inside :func:`posattn_checkpoint_loading`, which the runner holds while it builds, trains,
validates and tests, and which scripts of your own can use the same way.
"""
from __future__ import annotations

import argparse
import contextvars
import os
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader

from posattn.convert import allow_checkpoint_globals, read_checkpoint

from ._compat import history_buffer_statistics, local_checkpoint_loader, numpy_array_reconstructor, numpy_multiarray

__all__ = ['MMENGINE_CHECKPOINT_GLOBALS', 'history_buffer_method', 'load_local_checkpoint', 'load_checkpoint_file',
           'posattn_checkpoint_loading']


def _numpy_globals() -> List[Any]:
    """numpy's array, dtype and scalar reconstructors (their module moved in numpy 2)."""
    multiarray = numpy_multiarray()
    dtype_classes = [type(np.dtype(name)) for name in
                     ('bool', 'int8', 'int16', 'int32', 'int64', 'uint8', 'float16', 'float32', 'float64')]
    return [numpy_array_reconstructor(), multiarray.scalar, np.ndarray, np.dtype, *dtype_classes]


_HISTORY_BUFFER_STATISTICS = frozenset({'min', 'max', 'mean', 'current'})


def history_buffer_method(owner: Any, name: str) -> Any:
    """``getattr(owner, name)`` for the one case mmengine checkpoints pickle: a statistics method
    of :class:`HistoryBuffer`; anything else is refused."""
    allowed = _HISTORY_BUFFER_STATISTICS | set(history_buffer_statistics())  # + registered ones
    if owner is HistoryBuffer and name in allowed:
        return getattr(owner, name)
    raise pickle.UnpicklingError(f'refusing getattr({owner!r}, {name!r}): a checkpoint may only look up '
                                 f'HistoryBuffer statistics methods ({sorted(allowed)})')


MMENGINE_CHECKPOINT_GLOBALS: List[Any] = [HistoryBuffer, argparse.Namespace, *_numpy_globals(),
                                          (history_buffer_method, 'builtins.getattr')]
allow_checkpoint_globals(MMENGINE_CHECKPOINT_GLOBALS)  # posattn's reader only; torch's own list is untouched


def load_local_checkpoint(filename: str, map_location: Optional[Any] = None) -> Any:
    """:func:`posattn.convert.read_checkpoint` with :data:`MMENGINE_CHECKPOINT_GLOBALS` allowed.

    The signature and the missing-file error of mmengine's ``load_from_local``; a file holding
    objects outside the allow-list raises ``pickle.UnpicklingError``.
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


def load_checkpoint_file(filename: str, map_location: Optional[Any] = None) -> Any:
    """A checkpoint as posattn's runner, backbones and tools read it: a local file through
    :func:`load_local_checkpoint`, a URL or remote path (``https://``, ``open-mmlab://``,
    ``s3://``, any name with ``://``) through mmengine's ``CheckpointLoader``."""
    if '://' in str(filename):
        return CheckpointLoader.load_checkpoint(filename, map_location=map_location)
    return load_local_checkpoint(str(filename), map_location)


# posattn_checkpoint_loading: whether the running thread (or task) is inside the block, and the
# one loader put into CheckpointLoader while any block is open anywhere in the process.
_inside = contextvars.ContextVar('posattn_checkpoint_loading', default=False)
_installing = threading.Lock()
_open_blocks = 0
_installed: Optional[Tuple[Callable, Callable]] = None  # (the dispatching loader, the loader it stands in for)


def _dispatching_loader(mmengine_loader: Callable) -> Callable:
    def load_from_local(filename: str, map_location: Any) -> Any:  # mmengine logs a loader by its name
        if _inside.get():
            return load_local_checkpoint(filename, map_location)
        return mmengine_loader(filename, map_location)
    return load_from_local


@contextmanager
def posattn_checkpoint_loading() -> Iterator[None]:
    """Inside the block, code running in this thread that loads a local checkpoint through
    mmengine's ``CheckpointLoader`` (``load_checkpoint``, ``PretrainedInit``, the toolboxes'
    ``init_weights``) reads it with :func:`load_local_checkpoint`; other threads, and all code once
    the block ends, get mmengine's loader.

    While any such block is open, ``CheckpointLoader``'s entry for local paths is a small
    dispatcher that sends other threads' loads to the loader it replaced; the last block to close
    puts that loader back (the very same object), unless something registered another one for
    local paths meanwhile, which is then kept. Blocks nest, and may be opened by several threads.
    A thread started inside the block is outside it.

    ``PosattnRunner`` holds it while it builds the model, trains, validates and tests. Use it in a
    script of your own that loads one of posattn's training checkpoints through mmengine, e.g.
    ``with posattn_checkpoint_loading(): model = mmpretrain.get_model(config, pretrained=path)``.
    """
    global _open_blocks, _installed
    with _installing:
        if _open_blocks == 0:
            mmengine_loader = local_checkpoint_loader()
            dispatcher = _dispatching_loader(mmengine_loader)
            CheckpointLoader.register_scheme('', dispatcher, force=True)
            _installed = (dispatcher, mmengine_loader)
        _open_blocks += 1
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)
        with _installing:
            _open_blocks -= 1
            if _open_blocks == 0:
                dispatcher, mmengine_loader = _installed
                if local_checkpoint_loader() is dispatcher:
                    CheckpointLoader.register_scheme('', mmengine_loader, force=True)
                _installed = None
