"""``PosattnRunner``: mmengine's Runner with checkpoints that are checked, resumable and exclusive.

mmengine 0.10.7 loads weights with ``strict=False``: a checkpoint of another model (``load_from``,
``--resume``, ``tools/test.py``) only logs warnings, and the run goes on with freshly initialised
weights, training from scratch or evaluating at chance, and exits 0. This runner changes four
things and keeps the rest of mmengine's Runner:

* :meth:`~PosattnRunner.load_checkpoint` is strict: a checkpoint that does not fit the model raises
  an error listing the missing, unexpected and mis-shaped keys (posattn's
  :func:`~posattn.models.registry.load_weights`) and, where the checkpoint holds one of posattn's
  models, which registered model that is and which one the config builds. ``partial_load = True``
  in the config (``--partial-load`` on ``tools/train.py`` and ``tools/test.py``) loads every
  weight that fits and logs each key it skipped; a checkpoint of which nothing fits is an error
  even then.
* ``--resume`` without a path resumes from the newest checkpoint that reads completely: when the
  one ``last_checkpoint`` names is truncated or unreadable, the run says so and falls back to the
  next newest of the ``CheckpointHook``'s checkpoints. A path given explicitly is used as it is;
  a damaged one is an error naming the file.
* :meth:`~PosattnRunner.train` holds the work_dir's lock (:mod:`.work_dir_lock`, rank 0), so a
  second training in the same work_dir stops at its start.
* :class:`~.random_state.RandomStateHook` is always registered, so that a resumed run continues
  the random streams of the interrupted one.

Configs select it with ``runner_type = 'PosattnRunner'`` (every config in ``configs/`` does);
``tools/train.py`` and ``tools/test.py`` build it. :func:`load_model_weights` is the loading step
on its own, for tools that build a model without a runner (``tools/analyze.py``).
"""
from __future__ import annotations

import logging
import os
import pickle
import re
from contextlib import contextmanager
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from mmengine.dist import broadcast_object_list, is_main_process
from mmengine.hooks import CheckpointHook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.registry import RUNNERS
from mmengine.runner import CheckpointLoader, Runner
from mmengine.runner.checkpoint import find_latest_checkpoint

from posattn.convert import is_mmengine_checkpoint, mmengine_to_posattn, to_posattn_layout, without_cancelled_biases
from posattn.models.registry import fitting_model, load_weights, state_dict_mismatch

from .random_state import RandomStateHook
from .work_dir_lock import WorkDirInUseError, WorkDirLock

__all__ = ['PosattnRunner', 'load_model_weights']

PARTIAL_LOAD_HINT = ('  to load only the weights that fit: --partial-load (tools/train.py, tools/test.py) or '
                     'partial_load = True in the config; every skipped key is then logged')


def _posattn_model_in(checkpoint: Any) -> Tuple[Optional[str], str]:
    """(the registered posattn model a checkpoint holds or None, its layout): for an mmengine
    checkpoint, the model its ``backbone.model.*`` (and classifier) keys form."""
    if not isinstance(checkpoint, Mapping):
        return None, 'unknown'
    if is_mmengine_checkpoint(checkpoint):
        return fitting_model(mmengine_to_posattn(checkpoint, model_only=True)), 'mmengine'
    state_dict, layout = to_posattn_layout(checkpoint)
    return fitting_model(state_dict), layout


def _mismatch_hints(model: torch.nn.Module, checkpoint: Any, source: str) -> List[str]:
    """What the checkpoint is, next to what the model is, where posattn's models let us tell."""
    found, layout = _posattn_model_in(checkpoint)
    expected, _ = _posattn_model_in({'state_dict': model.state_dict()})
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
    """Load a checkpoint's weights (its ``'state_dict'``, or the mapping itself) into ``model``.

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
    state_dict = checkpoint
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get('state_dict'), Mapping):
        state_dict = checkpoint['state_dict']
    if not isinstance(state_dict, Mapping):
        raise ValueError(f'checkpoint {source} holds a {type(state_dict).__name__}, not a state_dict')
    for pattern, replacement in revise_keys:
        state_dict = {re.sub(pattern, replacement, key): value for key, value in state_dict.items()}
    state_dict = without_cancelled_biases(state_dict)  # those of checkpoints from before they were dropped
    if partial:
        missing, _, wrong = state_dict_mismatch(model, state_dict)
        if len(missing) + len(wrong) == len(model.state_dict()):
            raise ValueError('\n'.join([f'checkpoint {source}: none of its weights fits {target}, so even a partial '
                                        f'load would load nothing', *_mismatch_hints(model, checkpoint, source)]))
    try:
        skipped = load_weights(model, state_dict, source=f'checkpoint {source}', target=target, strict=not partial,
                               remedy=None)  # what the checkpoint holds: _mismatch_hints, for configs
    except ValueError as error:
        hints = _mismatch_hints(model, checkpoint, source)
        raise ValueError('\n'.join([str(error), *hints, PARTIAL_LOAD_HINT])) from None
    if skipped:
        print_log(f'Partial load of checkpoint {source} into {target}: {len(skipped)} keys skipped, left as '
                  f'initialised or ignored:\n  ' + '\n  '.join(skipped), logger='current', level=logging.WARNING)
    return skipped


@RUNNERS.register_module()
class PosattnRunner(Runner):
    """mmengine's Runner with strict loading, resume from the newest complete checkpoint, one
    training per work_dir and exact resume (module docstring). Built like mmengine's Runner,
    e.g. ``PosattnRunner.from_cfg(cfg)``; reads ``partial_load`` from the config."""

    def register_hooks(self, default_hooks=None, custom_hooks=None) -> None:
        super().register_hooks(default_hooks, custom_hooks)
        if not any(isinstance(hook, RandomStateHook) for hook in self.hooks):
            self.register_hook(RandomStateHook())

    def train(self) -> torch.nn.Module:
        with self._work_dir_held():
            return super().train()

    @contextmanager
    def _work_dir_held(self) -> Iterator[None]:
        """The work_dir lock, taken by rank 0; every rank stops when it is refused."""
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
        try:
            yield
        finally:
            lock.release()

    def load_or_resume(self) -> None:
        if not self._has_loaded and self._resume and self._load_from is None:
            self._load_from = self._newest_complete_checkpoint()
            self._resume = self._load_from is not None
        super().load_or_resume()

    def _checkpoints_newest_first(self, folder: str) -> List[str]:
        """The CheckpointHook's periodic checkpoints in ``folder`` (by its ``filename_tmpl``), the
        highest epoch or iteration first."""
        found = []
        for hook in self.hooks:
            if isinstance(hook, CheckpointHook) and os.path.isdir(folder):
                pattern = re.compile('^' + re.escape(hook.filename_tmpl).replace(r'\{\}', r'(\d+)') + '$')
                for name in os.listdir(folder):
                    match = pattern.match(name)
                    if match:
                        found.append((int(match.group(1)), os.path.join(folder, name)))
        return [path for _, path in sorted(found, reverse=True)]

    def _newest_complete_checkpoint(self) -> Optional[str]:
        """What ``--resume`` without a path resumes from: the checkpoint ``last_checkpoint`` names
        when it reads completely, else the newest one that does; None when there is none."""
        latest = find_latest_checkpoint(self.work_dir) or None  # an empty pointer reads as ''
        if latest is not None and '://' in latest:
            return latest  # remote storage: mmengine reads it as it is
        folder = os.path.dirname(latest) if latest else self.work_dir
        candidates = ([latest] if latest else []) + [p for p in self._checkpoints_newest_first(folder) if p != latest]
        damaged = []
        for path in candidates:
            try:
                CheckpointLoader.load_checkpoint(path, map_location='cpu')
            except (OSError, ValueError, pickle.UnpicklingError) as error:
                damaged.append(f'{path} ({type(error).__name__}: {error})')
                continue
            if damaged:
                self.logger.warning(f'Cannot resume from the latest checkpoint: {damaged[0]}. Resuming from {path}, '
                                    f'the newest complete checkpoint in {folder}'
                                    + (f'; also damaged: {"; ".join(damaged[1:])}' if len(damaged) > 1 else ''))
            else:
                self.logger.info(f'Resuming from {path}, the latest checkpoint in {folder}')
            return path
        if damaged:
            raise RuntimeError(f'--resume found no complete checkpoint in {folder}; every one is damaged: '
                               f'{"; ".join(damaged)}. Resume from another file with --resume PATH, or start '
                               f'again without --resume.')
        self.logger.info(f'No checkpoint to resume from in {self.work_dir}: training starts from the beginning')
        return None

    def load_checkpoint(self, filename: str, map_location: Any = 'cpu', strict: Optional[bool] = None,
                        revise_keys: Sequence[Tuple[str, str]] = ((r'^module\.', ''),)) -> dict:
        """Read ``filename`` and load its weights into the model through :func:`load_model_weights`.

        ``strict=None`` (what ``load_from``, ``resume`` and ``tools/test.py`` use) follows the
        config: strict unless ``partial_load = True``. Returns the checkpoint, as mmengine's does.
        """
        checkpoint = CheckpointLoader.load_checkpoint(filename, map_location=map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        partial = bool(self.cfg.get('partial_load', False)) if strict is None else not strict
        config = os.path.basename(self.cfg.filename) if self.cfg.filename else 'the config'
        load_model_weights(model, checkpoint, source=filename, target=f'{type(model).__name__} of {config}',
                           partial=partial, revise_keys=revise_keys)
        self._has_loaded = True
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint
