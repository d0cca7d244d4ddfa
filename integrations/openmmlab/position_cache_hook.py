"""Validation and testing with each Φp's positional bias computed once per grid.

The weights do not change during a validation or test epoch, so :class:`PositionCacheHook` opens
:func:`posattn.cache_positions` on the model at the start of each and closes it at the end, which
frees what it held: the peripheral Φp (and iRPE in bias mode) is computed once per grid instead of
once per batch, within the cache's byte budget (``max_bytes``), and nothing is kept between
epochs or during training. ``PosattnRunner`` registers it; a config can register one of its own
with another budget, ``custom_hooks = [dict(type='PositionCacheHook', max_bytes=...)]``.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Optional

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

import posattn

__all__ = ['PositionCacheHook']


@HOOKS.register_module()
class PositionCacheHook(Hook):
    """Holds :func:`posattn.cache_positions` on the model for every validation and test epoch.

    Args:
        max_bytes: the cache's budget for the whole model (1 GiB by default).
    """
    priority = 'LOWEST'  # after hooks that swap weights in for evaluation (EMA)

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._open: Optional[ExitStack] = None

    def _enter(self, runner) -> None:
        self._leave()
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        self._open = ExitStack()
        self._open.enter_context(posattn.cache_positions(model, self.max_bytes))

    def _leave(self, *args, **kwargs) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def before_val_epoch(self, runner) -> None:
        self._enter(runner)

    def before_test_epoch(self, runner) -> None:
        self._enter(runner)

    after_val_epoch = after_test_epoch = _leave
