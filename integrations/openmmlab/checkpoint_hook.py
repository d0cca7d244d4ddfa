"""``SafeCheckpointHook``: mmengine's ``CheckpointHook`` that never leaves a work_dir without a
complete checkpoint.

mmengine 0.10.7's hook deletes the checkpoint that ``max_keep_ckpts`` drops, and the previous best
checkpoint (``save_best``), *before* it writes the new one, and writes the ``last_checkpoint``
pointer by truncating it and writing into it. A run killed during those writes loses the
checkpoint it was replacing or leaves an empty pointer. This subclass keeps mmengine's logic and
changes when things happen:

* removals are deferred until the new checkpoint (and the pointer) is complete; a save that fails
  removes nothing;
* the pointer is written in a staging folder (``.last_checkpoint.staging``, removed afterwards) and
  renamed over ``last_checkpoint``;
* the checkpoint files themselves are written atomically by ``PosattnRunner.save_checkpoint``
  (:mod:`.atomic`); partial files that killed writes left behind are deleted when training
  starts (only one training runs in a work_dir: :mod:`.work_dir_lock`).

Every argument is ``CheckpointHook``'s. Configs select it with
``default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook', ...))``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, List, Tuple

from mmengine.dist import is_main_process
from mmengine.registry import HOOKS

from ._compat import CheckpointHookSaveSteps
from .atomic import remove_partial_writes, replace_durably

__all__ = ['SafeCheckpointHook']

POINTER = 'last_checkpoint'
_POINTER_STAGING = '.last_checkpoint.staging'


class _DeferredRemovals:
    """A storage backend whose ``remove`` / ``rmtree`` wait, inside :meth:`deferring`, until the
    outermost ``deferring`` block ends without an error; everything else goes to the backend."""

    def __init__(self, backend: Any):
        self._backend = backend
        self._pending: List[Tuple[str, str]] = []
        self._depth = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def remove(self, path: str) -> None:
        self._later('remove', path)

    def rmtree(self, path: str) -> None:
        self._later('rmtree', path)

    def _later(self, method: str, path: str) -> None:
        if self._depth:
            self._pending.append((method, path))
        else:
            getattr(self._backend, method)(path)

    @contextmanager
    def deferring(self, keep: Callable[[], Iterable[str]]) -> Iterator[None]:
        """Removals requested inside run at the end, except of paths in ``keep`` (the checkpoints
        just written); after an error they are dropped, so the old checkpoints stay."""
        self._depth += 1
        try:
            yield
        except BaseException:
            self._pending.clear()
            raise
        finally:
            self._depth -= 1
        if self._depth == 0:
            pending, self._pending = self._pending, []
            kept = set(keep())
            for method, path in pending:
                if path not in kept:
                    getattr(self._backend, method)(path)


class _RunnerWithStagedPointer:
    """The runner as ``CheckpointHook`` sees it, but with ``work_dir`` at a staging folder: the
    hook writes ``last_checkpoint`` there, and :class:`SafeCheckpointHook` renames it into place."""

    def __init__(self, runner: Any, staging: str):
        self._runner = runner
        self.work_dir = staging

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


@HOOKS.register_module()
class SafeCheckpointHook(CheckpointHookSaveSteps):
    """``CheckpointHook`` with removals after the new checkpoint is complete and an atomic
    ``last_checkpoint`` pointer (module docstring)."""

    def before_train(self, runner) -> None:
        super().before_train(runner)
        if is_main_process() and os.path.isdir(self.out_dir):
            for path in remove_partial_writes(self.out_dir):
                runner.logger.info(f'Removed {path}, the partial write of a killed run')
        self.file_backend = _DeferredRemovals(self.file_backend)

    def _written(self) -> List[str]:
        """The checkpoints this hook refers to now (never removed by a deferred removal)."""
        best = [getattr(self, 'best_ckpt_path', None), *getattr(self, 'best_ckpt_path_dict', {}).values()]
        return [path for path in (self.last_ckpt, *best) if path]

    def save_checkpoint_with_step(self, runner, step, meta) -> None:
        staging = os.path.join(runner.work_dir, _POINTER_STAGING)
        if is_main_process():
            os.makedirs(staging, exist_ok=True)
        with self.file_backend.deferring(keep=self._written):
            super().save_checkpoint_with_step(_RunnerWithStagedPointer(runner, staging), step, meta)
            if is_main_process():
                replace_durably(os.path.join(staging, POINTER), os.path.join(runner.work_dir, POINTER))
                os.rmdir(staging)

    def save_best_checkpoint(self, runner, metrics) -> None:
        with self.file_backend.deferring(keep=self._written):
            super().save_best_checkpoint(runner, metrics)
