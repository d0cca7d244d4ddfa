"""Exact resume: the random generators' states travel in every checkpoint.

mmengine seeds torch, numpy and Python's ``random`` once, when the runner is built. A resumed run
starts its generators from that seed, not from where the interrupted run was, so its data
augmentation, dropout and DataLoader base seeds draw other numbers and its weights drift from the
uninterrupted run's. :class:`RandomStateHook` stores the states (torch CPU, CUDA when present,
numpy, ``random``) in each checkpoint under ``'random_state'`` and, on resume, restores them just
before the continued training draws its first batch.

Two things run between a checkpoint and the next training step and would otherwise make the
resumed stream differ from the uninterrupted one:

* validation, which draws from the same generators (every DataLoader iterator draws a base seed,
  test pipelines may augment): the hook makes it neutral, saving the states at ``before_val`` and
  putting them back at ``after_val``. A checkpoint written during validation (``CheckpointHook``
  writes the last one again after a new best) stores the states from before validation.
* ``IterBasedTrainLoop``'s skipping: on resume it draws the batches already trained from the
  dataloader again, running their augmentations. The states are restored after those draws,
  just before the first new batch.

In distributed runs the checkpoint holds rank 0's states; every rank restores them, which is
exact when the ranks share one seed (mmengine's default, ``randomness.diff_rank_seed=False``).
With ``diff_rank_seed=True`` the other ranks keep the stream of their own seed and say so.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS
from mmengine.runner import IterBasedTrainLoop

__all__ = ['RandomStateHook', 'capture_random_state', 'restore_random_state']

KEY = 'random_state'


def capture_random_state() -> Dict[str, Any]:
    """The global generators' states, as tensors and plain Python values (which weights-only
    loading reads)."""
    numpy_state = np.random.get_state(legacy=False)
    state = dict(
        torch=torch.get_rng_state(),
        numpy=dict(key=torch.from_numpy(numpy_state['state']['key'].astype(np.int64)),
                   pos=int(numpy_state['state']['pos']), has_gauss=int(numpy_state['has_gauss']),
                   gauss=float(numpy_state['gauss'])),
        python=random.getstate(),
    )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def restore_random_state(state: Dict[str, Any]) -> None:
    """Set the global generators to a state :func:`capture_random_state` returned (CUDA only when
    both the state and this process have the same number of devices)."""
    torch.set_rng_state(state['torch'].cpu())
    numpy_state = state['numpy']
    np.random.set_state(dict(bit_generator='MT19937',
                             state=dict(key=numpy_state['key'].cpu().numpy().astype(np.uint32),
                                        pos=numpy_state['pos']),
                             has_gauss=numpy_state['has_gauss'], gauss=numpy_state['gauss']))
    version, internal, gauss_next = state['python']
    random.setstate((version, tuple(internal), gauss_next))
    cuda = state.get('cuda')
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


class _RestoreAfterSkipping:
    """``IterBasedTrainLoop``'s dataloader iterator: the first ``skip`` batches (the ones the loop
    draws and discards on resume) as they come, then the random state restored before the next."""

    def __init__(self, iterator: Iterator, skip: int, state: Dict[str, Any]):
        self._iterator = iterator
        self._skip = skip
        self._state: Optional[Dict[str, Any]] = state

    def __iter__(self) -> '_RestoreAfterSkipping':
        return self

    def __next__(self) -> Any:
        if self._skip:
            self._skip -= 1
        elif self._state is not None:
            restore_random_state(self._state)
            self._state = None
        return next(self._iterator)


@HOOKS.register_module()
class RandomStateHook(Hook):
    """Random states in checkpoints, restored on resume; validation leaves them as they were
    (module docstring). :class:`~posattn_openmmlab.runner.PosattnRunner` registers it."""

    priority = 'VERY_HIGH'  # first at before_val, so that no other hook draws before the capture

    def __init__(self):
        self._before_validation: Optional[Dict[str, Any]] = None
        self._loaded: Optional[Dict[str, Any]] = None

    def before_val(self, runner) -> None:
        self._before_validation = capture_random_state()

    def after_val(self, runner) -> None:
        if self._before_validation is not None:
            restore_random_state(self._before_validation)
            self._before_validation = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[KEY] = self._before_validation or capture_random_state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._loaded = checkpoint.get(KEY)

    def before_train(self, runner) -> None:
        if runner.iter == 0:  # a fresh start, or weights from load_from: not a resume
            self._loaded = None
            return
        if self._loaded is None:
            print_log(f'The checkpoint resumed at iteration {runner.iter} holds no random state: training '
                      f'continues from the seed, so it will not repeat the interrupted run exactly',
                      logger='current', level=logging.WARNING)
        elif runner.world_size > 1 and runner.rank > 0 and (runner.cfg.get('randomness') or {}).get('diff_rank_seed'):
            print_log(f'Rank {runner.rank} keeps the random stream of its own seed (diff_rank_seed=True); '
                      f'the checkpoint holds rank 0\'s', logger='current', level=logging.WARNING)
            self._loaded = None

    def before_train_epoch(self, runner) -> None:
        if self._loaded is None:
            return
        state, self._loaded = self._loaded, None
        loop = runner.train_loop
        if isinstance(loop, IterBasedTrainLoop) and loop.iter > 0:  # it skips loop.iter batches next
            loop.dataloader_iterator = _RestoreAfterSkipping(loop.dataloader_iterator, loop.iter, state)
        else:
            restore_random_state(state)
