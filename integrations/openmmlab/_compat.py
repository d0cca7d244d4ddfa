"""The private names of mmengine, mmcv and numpy that posattn's OpenMMLab adapters use, each behind one small
function or class.

A private name (``_something``) may change in any release; it appears nowhere else in
``posattn_openmmlab``, so that a release that moves it breaks one place here, whose docstring says
what it stands for and which releases it is tested against. Where mmengine has a public API for the
same thing (``Runner.work_dir``, ``BaseModule.is_init``, ``CheckpointLoader.register_scheme``) the
adapters use that instead.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import numpy as np
from mmengine.hooks import CheckpointHook
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader

__all__ = ['mmcv_kernels', 'numpy_multiarray', 'numpy_array_reconstructor', 'local_checkpoint_loader', 'history_buffer_statistics', 'set_default_classes',
           'runner_trains', 'resume_request', 'request_resume', 'has_loaded_checkpoint', 'mark_checkpoint_loaded',
           'CheckpointHookSaveSteps']


def mmcv_kernels() -> ModuleType:
    """mmcv's compiled extension module (``mmcv._ext``), whose functions (``nms``,
    ``roi_align_forward``, ...) mmcv's Python ops look up at call time. Tested with mmcv 2.1.0."""
    return importlib.import_module('mmcv._ext')


def numpy_multiarray() -> ModuleType:
    """numpy's ``multiarray`` module, by the name a pickle of an array refers to: ``numpy._core
    .multiarray`` from numpy 2, ``numpy.core.multiarray`` before. Tested with numpy 2.4.6."""
    return getattr(getattr(np, '_core', None), 'multiarray', None) or np.core.multiarray


def numpy_array_reconstructor() -> Callable[..., Any]:
    """The function a pickled numpy array is rebuilt with (``multiarray._reconstruct``), which a
    weights-only load of an mmengine checkpoint must allow. Tested with numpy 2.4.6."""
    return numpy_multiarray()._reconstruct


def local_checkpoint_loader() -> Optional[Callable[..., Any]]:
    """The loader ``CheckpointLoader`` uses for local paths (its ``_schemes`` entry for the prefix
    ``''``), or None; set it with the public ``CheckpointLoader.register_scheme('', loader,
    force=True)``. Tested with mmengine 0.10.7."""
    return CheckpointLoader._schemes.get('')


def history_buffer_statistics() -> Iterable[str]:
    """The names of the statistics methods registered on ``HistoryBuffer`` with
    ``HistoryBuffer.register_statistics`` (its ``_statistics_methods``), which mmengine's logged
    history in a checkpoint may refer to. Tested with mmengine 0.10.7."""
    return tuple(HistoryBuffer._statistics_methods)


def set_default_classes(dataset: Any, classes: Tuple[str, ...]) -> None:
    """The dataset's ``metainfo['classes']``, where its config gave none: ``BaseDataset.metainfo`` is
    a copy, and ``load_data_list`` fills the dict behind it (``_metainfo``) as mmengine's datasets
    do. Tested with mmengine 0.10.7."""
    dataset._metainfo.setdefault('classes', classes)


def runner_trains(runner: Any) -> bool:
    """Whether the runner was configured to train (a ``train_cfg``): its ``_train_loop`` is set,
    built or not; the public ``train_loop`` would build it. Tested with mmengine 0.10.7."""
    return runner._train_loop is not None


def resume_request(runner: Any) -> Tuple[bool, Optional[str]]:
    """``(resume, load_from)``: what ``Runner.load_or_resume`` will do, as the config's ``resume``
    and ``load_from`` set it (``_resume``, ``_load_from``). Tested with mmengine 0.10.7."""
    return runner._resume, runner._load_from


def request_resume(runner: Any, resume: bool, load_from: Optional[str]) -> None:
    """Set what ``Runner.load_or_resume`` does, as the config's ``resume`` and ``load_from`` do
    (``resume=True, load_from=None``: the newest checkpoint of the work_dir). Tested with mmengine
    0.10.7."""
    runner._resume, runner._load_from = resume, load_from


def has_loaded_checkpoint(runner: Any) -> bool:
    """Whether the runner loaded a checkpoint (``_has_loaded``). Tested with mmengine 0.10.7."""
    return runner._has_loaded


def mark_checkpoint_loaded(runner: Any) -> None:
    """Record that the runner loaded a checkpoint, as ``Runner.load_checkpoint`` does, so that
    ``load_or_resume`` loads nothing more. Tested with mmengine 0.10.7."""
    runner._has_loaded = True


class CheckpointHookSaveSteps(CheckpointHook):
    """mmengine's ``CheckpointHook`` whose two saving steps, private there, are public methods a
    subclass overrides: :meth:`save_checkpoint_with_step` (every ``interval``, and the last
    checkpoint; mmengine's ``_save_checkpoint_with_step``) and :meth:`save_best_checkpoint`
    (``save_best``; ``_save_best_checkpoint``). Tested with mmengine 0.10.7."""

    def save_checkpoint_with_step(self, runner: Any, step: int, meta: Dict[str, Any]) -> None:
        """mmengine's periodic save: the checkpoint of ``step``, the ``last_checkpoint`` pointer in
        ``runner.work_dir`` and the removal of checkpoints beyond ``max_keep_ckpts``."""
        super()._save_checkpoint_with_step(runner, step, meta)

    def save_best_checkpoint(self, runner: Any, metrics: Dict[str, float]) -> None:
        """mmengine's save of the best checkpoint by ``save_best``, replacing the previous best."""
        super()._save_best_checkpoint(runner, metrics)

    def _save_checkpoint_with_step(self, runner: Any, step: int, meta: Dict[str, Any]) -> None:
        self.save_checkpoint_with_step(runner, step, meta)

    def _save_best_checkpoint(self, runner: Any, metrics: Dict[str, float]) -> None:
        self.save_best_checkpoint(runner, metrics)
