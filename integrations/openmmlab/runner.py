"""``PosattnRunner``: mmengine's Runner with checkpoints that are checked, resumable and exclusive.

mmengine 0.10.7 loads weights with ``strict=False``: a checkpoint of another model (``load_from``,
``--resume``, ``tools/test.py``) only logs warnings, and the run goes on with freshly initialised
weights, training from scratch or evaluating at chance, and exits 0. This runner changes these
things and keeps the rest of mmengine's Runner:

* :meth:`~PosattnRunner.load_checkpoint` is strict: a checkpoint that does not fit the model raises
  an error listing the missing, unexpected and mis-shaped keys (posattn's
  :func:`~posattn.models.registry.load_weights`) and, where the checkpoint holds one of posattn's
  models, which registered model that is and which one the config builds. ``partial_load = True``
  in the config (``--partial-load`` on ``tools/train.py`` and ``tools/test.py``) loads every
  weight that fits and logs each key it skipped; a checkpoint of which nothing fits is an error
  even then.
* Checkpoints are read weights-only with the allow-list of :mod:`.checkpoint` (which makes
  mmengine's own checkpoints readable on torch >= 2.6): the runner's own loading directly, and
  the ``init_cfg`` checkpoints that other libraries' code reads while the runner builds, trains,
  validates or tests, through :func:`~.checkpoint.posattn_checkpoint_loading`.
* :meth:`~PosattnRunner.save_checkpoint` writes each local checkpoint to a temporary file beside
  its name and renames it into place (:mod:`.atomic`), so a killed run never leaves a truncated
  checkpoint under a checkpoint's name.
* ``--resume`` without a path resumes from the newest checkpoint that reads completely: when the
  one ``last_checkpoint`` names is truncated or unreadable, the run says so and falls back to the
  next newest of the ``CheckpointHook``'s checkpoints. A path given explicitly is used as it is;
  a damaged one is an error naming the file. The checkpoint found is read once: the search reads
  it to know it is complete, and the resume loads what it read (:meth:`~PosattnRunner.resume_from`
  takes one that a tool found before it built the runner).
* A runner built for training (with mmengine's training parts: ``train_dataloader``,
  ``train_cfg``, ``optim_wrapper``) takes the work_dir's lock (:mod:`.work_dir_lock`, rank 0) in
  its constructor, before it writes anything (its log folder and config dump come after), and
  holds it to the end of its run: a second training in the same work_dir stops at once and leaves
  the first one's files as they are. A runner without them (``tools/test.py`` builds one) takes
  no lock and writes its config dump into its own log folder, not over the work_dir's.
* Its runs route mmcv's NMS and RoIAlign to torchvision where mmcv has no kernels for the device
  (:mod:`.torchvision_ops`; the config key ``mmcv_ops_to_torchvision``, ``'auto'`` by default:
  CUDA tensors when mmcv was compiled without CUDA), and give mmcv's ops back when they end.
* :class:`~.random_state.RandomStateHook` is always registered, so that a resumed run continues
  the random streams of the interrupted one, and so is
  :class:`~.position_cache_hook.PositionCacheHook`, which computes each Φp once per grid during
  validation and testing (``posattn.cache_positions``).

Configs select it with ``runner_type = 'PosattnRunner'`` (every config in ``configs/`` does);
``tools/train.py`` and ``tools/test.py`` build it. :func:`load_model_weights` is the loading step
on its own, for tools that build a model without a runner (``tools/analyze.py``), and
:func:`find_resumable_checkpoint` the choice ``--resume`` makes, for tools that decide before
building one (and hand what it read to :meth:`~PosattnRunner.resume_from`).
"""
from __future__ import annotations

import logging
import os
import pickle
import re
from contextlib import contextmanager
from typing import Any, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from mmengine.dist import broadcast_object_list, is_main_process, master_only
from mmengine.hooks import CheckpointHook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from posattn.convert import saved_phi_records, to_posattn_layout, unwrap_state_dict, without_cancelled_biases
from posattn.models.registry import fitting_model, load_weights, state_dict_mismatch

from ._compat import (has_loaded_checkpoint, mark_checkpoint_loaded, request_resume, resume_request,
                      runner_trains)
from .atomic import atomic_target
from .class_checks import ClassCountCheck
from .checkpoint import load_checkpoint_file, posattn_checkpoint_loading
from .position_cache_hook import PositionCacheHook
from .random_state import RandomStateHook
from .torchvision_ops import devices_without_mmcv_kernels, mmcv_ops_routed
from .linked_settings import LINKED_KEYS
from .work_dir_lock import WorkDirInUseError, WorkDirLock

__all__ = ['PosattnRunner', 'build_runner', 'load_model_weights', 'find_resumable_checkpoint', 'ResumePoint']

PARTIAL_LOAD_HINT = ('  to load only the weights that fit: --partial-load (tools/train.py, tools/test.py) or '
                     'partial_load = True in the config; every skipped key is then logged')


def _posattn_model_in(state_dict: Mapping[str, Any]) -> Tuple[Optional[str], str]:
    """(the registered posattn model a state_dict holds or None, its layout, as
    :func:`posattn.convert.to_posattn_layout` recognises it): for an mmengine model's, the model its
    ``backbone.model.*`` (and classifier) keys form."""
    posattn_state_dict, layout = to_posattn_layout(state_dict, model_only=True)
    return fitting_model(posattn_state_dict), layout


def _mismatch_hints(model: torch.nn.Module, state_dict: Mapping[str, Any], source: str) -> List[str]:
    """What the checkpoint's state_dict is, next to what the model is, where posattn's models let us tell."""
    found, layout = _posattn_model_in(state_dict)
    expected, _ = _posattn_model_in(model.state_dict())
    if found is not None and layout != 'mmengine':
        return [f"  it holds posattn's {found} in the {layout} layout, not a checkpoint of this model: to start "
                f"the backbone from it, set model.backbone.init_cfg=dict(type='Pretrained', checkpoint='{source}')"]
    if found is not None and found == expected:
        return [f"  its backbone is posattn's {found}, as is this model's: the difference is outside the backbone"]
    if found is not None:
        return [f"  its backbone is posattn's {found}" + (f"; this model's is a {expected}" if expected else '')]
    return []


def load_model_weights(model: torch.nn.Module, checkpoint: Any, *, source: str, target: str,
                       partial: bool = False,
                       revise_keys: Sequence[Tuple[str, str]] = ((r'^module\.', ''),)) -> List[str]:
    """Load a checkpoint's weights (its ``'state_dict'`` as mmengine saves it, or any state_dict
    :func:`posattn.convert.unwrap_state_dict` finds) into ``model``.

    Args:
        source: the checkpoint's name, for messages.
        target: what the model is, for messages (e.g. its class and config).
        partial: False raises a ValueError for any missing, unexpected or mis-shaped key (listing
            them, with what the checkpoint holds); True loads the keys that fit, logs every skipped
            one, and raises only when nothing fits.
        revise_keys: (pattern, replacement) applied to the checkpoint's keys first, as mmengine's
            ``load_checkpoint`` does (it strips DDP's ``module.``).

    Returns:
        The skipped keys, each with its reason (posattn's ``load_weights``); empty when all fit.
    """
    try:
        saved = unwrap_state_dict(checkpoint)
    except TypeError:
        raise ValueError(f'checkpoint {source} holds a {type(checkpoint).__name__}, not a state_dict') from None
    state_dict = saved
    for pattern, replacement in revise_keys:
        state_dict = {re.sub(pattern, replacement, key): value for key, value in state_dict.items()}
    state_dict = without_cancelled_biases(state_dict)  # those of checkpoints from before they were dropped
    if partial:
        missing, _, wrong = state_dict_mismatch(model, state_dict)
        if len(missing) + len(wrong) == len(model.state_dict()):
            raise ValueError('\n'.join([f'checkpoint {source}: none of its weights fits {target}, so even a partial '
                                        f'load would load nothing', *_mismatch_hints(model, saved, source)]))
    try:
        skipped = load_weights(model, state_dict, source=f'checkpoint {source}', target=target, strict=not partial,
                               remedy=None, saved_phis=saved_phi_records(checkpoint))  # what the checkpoint holds: _mismatch_hints, for configs
    except ValueError as error:
        hints = _mismatch_hints(model, saved, source)
        raise ValueError('\n'.join([str(error), *hints, PARTIAL_LOAD_HINT])) from None
    if skipped:
        print_log(f'Partial load of checkpoint {source} into {target}: {len(skipped)} keys skipped, left as '
                  f'initialised or ignored:\n  ' + '\n  '.join(skipped), logger='current', level=logging.WARNING)
    return skipped


def periodic_checkpoints(folder: str, filename_templates: Sequence[str]) -> List[str]:
    """The files in ``folder`` named by a ``CheckpointHook``'s ``filename_tmpl`` (``'epoch_{}.pth'``,
    ``'iter_{}.pth'``), the highest epoch or iteration first."""
    found = []
    for template in filename_templates:
        pattern = re.compile('^' + re.escape(template).replace(r'\{\}', r'(\d+)') + '$')
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            match = pattern.match(name)
            if match:
                found.append((int(match.group(1)), os.path.join(folder, name)))
    return [path for _, path in sorted(found, reverse=True)]


def _file_id(path: str) -> Optional[Tuple[int, int, int]]:
    """(inode, size, modification time in ns) of ``path``, which tell whether it is still the file it
    was; None when it cannot be read."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


class ResumePoint(NamedTuple):
    """What :func:`find_resumable_checkpoint` found."""
    path: Optional[str]  # the checkpoint to resume from; None when none reads completely
    folder: str  # where the checkpoints are
    damaged: List[str]  # the newer candidates that did not read, each with its error, newest first
    checkpoint: Any  # path's contents, read onto the CPU (None for remote storage, which is not read here)
    file_id: Optional[Tuple[int, int, int]] = None  # path's _file_id when it was read (None for remote storage)


def _resume_candidates(work_dir: str, filename_templates: Sequence[str]) -> Tuple[str, List[str]]:
    """(the folder of the checkpoints, those ``--resume`` without a path tries, in order): the one
    ``last_checkpoint`` names, then the periodic ones (by ``filename_templates``), newest first. A
    ``last_checkpoint`` on remote storage is the only candidate."""
    pointer = os.path.join(work_dir, 'last_checkpoint')  # what mmengine's find_latest_checkpoint reads
    latest = None
    if os.path.isfile(pointer):
        with open(pointer) as f:
            latest = f.read().strip() or None  # a pointer that a killed plain CheckpointHook emptied
    if latest is not None and '://' in latest:
        return os.path.dirname(latest), [latest]
    folder = os.path.dirname(latest) if latest else work_dir
    return folder, ([latest] if latest else []) + [p for p in periodic_checkpoints(folder, filename_templates)
                                                   if p != latest]


def find_resumable_checkpoint(work_dir: str, filename_templates: Sequence[str]) -> ResumePoint:
    """What ``--resume`` without a path resumes from: the checkpoint ``last_checkpoint`` names when
    it reads completely, else the newest periodic checkpoint (by ``filename_templates``) that does."""
    folder, candidates = _resume_candidates(work_dir, filename_templates)
    if candidates and '://' in candidates[0]:
        return ResumePoint(candidates[0], folder, [], None)  # remote storage: mmengine reads it
    damaged = []
    for path in candidates:
        file_id = _file_id(path)  # before reading: a file replaced meanwhile then differs from it
        try:
            return ResumePoint(path, folder, damaged, load_checkpoint_file(path, map_location='cpu'), file_id)
        except (OSError, ValueError, pickle.UnpicklingError) as error:
            damaged.append(f'{path} ({type(error).__name__}: {error})')
    return ResumePoint(None, folder, damaged, None)


def _still_newest(point: ResumePoint, work_dir: str, filename_templates: Sequence[str]) -> bool:
    """Whether ``point``, found earlier, is what :func:`find_resumable_checkpoint` would find now
    without reading anything: its file, unchanged, is still the first candidate."""
    _, candidates = _resume_candidates(work_dir, filename_templates)
    return (point.checkpoint is not None and point.file_id is not None and candidates[:1] == [point.path]
            and _file_id(point.path) == point.file_id)


@RUNNERS.register_module()
class PosattnRunner(Runner):
    """mmengine's Runner with strict, weights-only loading, atomic saves, resume from the newest
    complete checkpoint, one training per work_dir and exact resume (module docstring). Built like
    mmengine's Runner, e.g. ``PosattnRunner.from_cfg(cfg)``; reads ``partial_load`` and
    ``mmcv_ops_to_torchvision`` from the config."""

    def __init__(self, *args, **kwargs):
        self._work_dir_lock: Optional[WorkDirLock] = None
        # the checkpoint --resume found, read: held from the search (or resume_from) until it is loaded
        self._resume_point: Optional[ResumePoint] = None
        try:
            with posattn_checkpoint_loading():  # building the model may load init_cfg checkpoints
                super().__init__(*args, **kwargs)
        except BaseException:
            self._release_work_dir()
            raise

    def setup_env(self, env_cfg) -> None:
        super().setup_env(env_cfg)
        # The first point of the constructor where the process group exists and nothing is written
        # yet (the log folder, log file and config dump come next).
        if runner_trains(self):
            self._acquire_work_dir()

    @master_only
    def dump_config(self) -> None:
        if runner_trains(self):
            super().dump_config()
        else:  # not the work_dir's training: keep out of its config dump
            name = os.path.basename(self.cfg.filename) if self.cfg.filename else f'{self.timestamp}.py'
            self.cfg.dump(os.path.join(self.log_dir, name))

    def register_hooks(self, default_hooks=None, custom_hooks=None) -> None:
        super().register_hooks(default_hooks, custom_hooks)
        if not any(isinstance(hook, RandomStateHook) for hook in self.hooks):
            self.register_hook(RandomStateHook())
        if not any(isinstance(hook, PositionCacheHook) for hook in self.hooks):
            self.register_hook(PositionCacheHook())

    def train(self) -> torch.nn.Module:
        with self._running(training=True):
            return super().train()

    def val(self) -> dict:
        with self._running(training=False):
            return super().val()

    def test(self) -> dict:
        with self._running(training=False):
            return super().test()

    @contextmanager
    def _running(self, training: bool) -> Iterator[None]:
        """What each run happens in: posattn's checkpoint loading, mmcv's ops routed as configured
        and, for training, the work_dir's lock (taken now unless the constructor holds it). A lock
        held since the constructor is released when the run ends, whatever run it is."""
        if training and self._work_dir_lock is None:
            self._acquire_work_dir()
        try:
            with posattn_checkpoint_loading(), mmcv_ops_routed(self._mmcv_ops_to_torchvision()):
                yield
        finally:
            self._release_work_dir()

    def _mmcv_ops_to_torchvision(self) -> frozenset:
        """The device types whose tensors mmcv's NMS and RoIAlign send to torchvision during a run."""
        setting = self.cfg.get('mmcv_ops_to_torchvision', 'auto')
        if setting == 'auto':
            return devices_without_mmcv_kernels()
        if isinstance(setting, str) or not all(isinstance(device, str) for device in setting):
            raise ValueError(f"mmcv_ops_to_torchvision={setting!r} in the config: use 'auto' (CUDA tensors when "
                             f"mmcv has no CUDA kernels) or a list of device types, e.g. ['cuda'], or [] for none")
        return frozenset(setting)

    def _acquire_work_dir(self) -> None:
        """Take the work_dir's lock (rank 0); every rank stops when it is refused."""
        lock, refusal = WorkDirLock(self.work_dir), None
        if is_main_process():
            try:
                lock.acquire()
            except WorkDirInUseError as error:
                refusal = str(error)
        if self.distributed:
            shared = [refusal]
            broadcast_object_list(shared)
            refusal = shared[0]
        if refusal is not None:
            raise WorkDirInUseError(refusal)
        self._work_dir_lock = lock

    def _release_work_dir(self) -> None:
        if self._work_dir_lock is not None:
            self._work_dir_lock.release()
            self._work_dir_lock = None

    def resume_from(self, point: ResumePoint) -> None:
        """Resume, when the run starts, from ``point``: what :func:`find_resumable_checkpoint` found in
        this runner's work_dir before the runner was built (``tools/train.py`` reads it to check the
        run's settings), loading the checkpoint it read instead of reading the file again. Should
        another training have written a newer checkpoint meanwhile, or replaced that file, the run
        searches the work_dir again, as ``--resume`` without a path does."""
        request_resume(self, resume=True, load_from=None)
        self._resume_point = point

    def load_or_resume(self) -> None:
        try:
            resume, load_from = resume_request(self)
            if not has_loaded_checkpoint(self) and resume and load_from is None:
                newest = self._newest_complete_checkpoint()
                request_resume(self, resume=newest is not None, load_from=newest)
            super().load_or_resume()
        finally:
            self._resume_point = None  # loaded, or not wanted: a checkpoint is large

    def _newest_complete_checkpoint(self) -> Optional[str]:
        """What ``--resume`` without a path resumes from (:func:`find_resumable_checkpoint` with the
        ``CheckpointHook``'s file names, or the point given to :meth:`resume_from` while it is still
        the newest), said in the log; None when there is no checkpoint. What it read is kept for
        :meth:`load_checkpoint`."""
        templates = [hook.filename_tmpl for hook in self.hooks if isinstance(hook, CheckpointHook)]
        given = self._resume_point
        if given is None or not _still_newest(given, self.work_dir, templates):
            self._resume_point = find_resumable_checkpoint(self.work_dir, templates)
        path, folder, damaged = self._resume_point.path, self._resume_point.folder, self._resume_point.damaged
        if path is not None and damaged:
            self.logger.warning(f'Cannot resume from the latest checkpoint: {damaged[0]}. Resuming from {path}, '
                                f'the newest complete checkpoint in {folder}'
                                + (f'; also damaged: {"; ".join(damaged[1:])}' if len(damaged) > 1 else ''))
        elif path is not None:
            self.logger.info(f'Resuming from {path}, the latest checkpoint in {folder}')
        elif damaged:
            raise RuntimeError(f'--resume found no complete checkpoint in {folder}; every one is damaged: '
                               f'{"; ".join(damaged)}. Resume from another file with --resume PATH, or start '
                               f'again without --resume.')
        else:
            self.logger.info(f'No checkpoint to resume from in {self.work_dir}: training starts from the beginning')
        return path

    def load_checkpoint(self, filename: str, map_location: Any = 'cpu', strict: Optional[bool] = None,
                        revise_keys: Sequence[Tuple[str, str]] = ((r'^module\.', ''),)) -> dict:
        """Read ``filename`` weights-only (:func:`~.checkpoint.load_checkpoint_file`) and load its
        weights into the model through :func:`load_model_weights`.

        The checkpoint that ``--resume`` without a path found (:meth:`_newest_complete_checkpoint`,
        :meth:`resume_from`) is not read again: it is loaded as the search read it, onto the CPU,
        whatever ``map_location``; the model copies the weights onto its own device and the
        optimiser moves its state to its parameters'.

        ``strict=None`` (what ``load_from``, ``resume`` and ``tools/test.py`` use) follows the
        config: strict unless ``partial_load = True``. Returns the checkpoint, as mmengine's does.
        """
        checkpoint = self._read_checkpoint(filename, map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        partial = bool(self.cfg.get('partial_load', False)) if strict is None else not strict
        config = os.path.basename(self.cfg.filename) if self.cfg.filename else 'the config'
        load_model_weights(model, checkpoint, source=filename, target=f'{type(model).__name__} of {config}',
                           partial=partial, revise_keys=revise_keys)
        mark_checkpoint_loaded(self)
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint

    def _read_checkpoint(self, filename: str, map_location: Any) -> Any:
        """``filename``'s contents: those the resume search read, handed over once, else the file's."""
        found, self._resume_point = self._resume_point, None
        if found is not None and found.path == filename and found.checkpoint is not None:
            return found.checkpoint
        return load_checkpoint_file(filename, map_location=map_location)

    @master_only
    def save_checkpoint(self, out_dir: str, filename: str, file_client_args: Optional[dict] = None,
                        save_optimizer: bool = True, save_param_scheduler: bool = True, meta: Optional[dict] = None,
                        by_epoch: bool = True, backend_args: Optional[dict] = None) -> None:
        """mmengine's, with a local checkpoint written to a temporary file in its folder and renamed
        over its name (:func:`~.atomic.atomic_target`). Remote storage, or ``file_client_args`` /
        ``backend_args`` given: mmengine's, as it is."""
        options = dict(save_optimizer=save_optimizer, save_param_scheduler=save_param_scheduler, meta=meta,
                       by_epoch=by_epoch)
        if file_client_args is not None or backend_args is not None or '://' in str(out_dir):
            return super().save_checkpoint(out_dir, filename, file_client_args, backend_args=backend_args, **options)
        with atomic_target(os.path.join(out_dir, filename)) as temporary:
            super().save_checkpoint(os.path.dirname(temporary), os.path.basename(temporary), **options)


def build_runner(cfg: Any) -> PosattnRunner:
    """The config's ``runner_type`` (``PosattnRunner`` when it names none), which must be
    ``PosattnRunner`` or derive from it: the tools rely on its strict, weights-only loading, atomic
    saves, exact resume and work_dir lock. With :class:`~posattn_openmmlab.class_checks.ClassCountCheck`
    registered: a classifier with fewer outputs than its data has classes, or (a config whose
    ``linked_keys`` set ``num_classes``) with another number, stops before its first training step
    or test batch."""
    name = cfg.get('runner_type', 'PosattnRunner')
    runner_cls = RUNNERS.get(name)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, PosattnRunner)):
        raise ValueError(f"runner_type={name!r} in the config is not a PosattnRunner (posattn_openmmlab."
                         f"runner), which tools/train.py and tools/test.py need: use runner_type='PosattnRunner' "
                         f"or a subclass of it")
    runner = runner_cls.from_cfg(cfg)
    if 'num_classes' in (cfg.get(LINKED_KEYS) or {}):  # the number of class folders: exactly
        runner.register_hook(ClassCountCheck('num_classes={n}', exact=True))
    else:  # perhaps a subset of a larger label set
        runner.register_hook(ClassCountCheck('model.head.num_classes={n} data_preprocessor.num_classes={n}',
                                             exact=False))
    return runner
