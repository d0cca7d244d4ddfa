"""The cosine decay of the DeiT recipe, after its warm-up, for runs of any length: ``CosineAfterWarmupLR``.

The recipe (``configs/_base_/schedule_deit_adamw.py``) warms the lr up linearly for
``warmup_epochs``, then decays it on a cosine from there to the end of the run. With mmengine's
``CosineAnnealingLR`` a run no longer than the warm-up (``train_cfg.max_epochs=1``, a first try
on your own images) is an error before its first step: the decay would begin at or after its end
("end should be larger than begin"). ``CosineAfterWarmupLR`` has no step to act on there and is
left out, with a line in the log: the whole run is warm-up, its lr rising towards the peak it
reaches at ``warmup_epochs``. Otherwise it is ``CosineAnnealingLR``, unchanged. The configs for
your own images (``configs/your_data/``) decay with it.
"""
from __future__ import annotations

from typing import Any

from mmengine.logging import print_log
from mmengine.optim.scheduler import CosineAnnealingLR
from mmengine.optim.scheduler.param_scheduler import INF
from mmengine.registry import PARAM_SCHEDULERS

__all__ = ['CosineAfterWarmupLR']


@PARAM_SCHEDULERS.register_module()
class CosineAfterWarmupLR(CosineAnnealingLR):
    """mmengine's ``CosineAnnealingLR`` from ``begin`` (the warm-up's end) to ``end`` (the run's end,
    which mmengine's runner sets where the config does not), left out where ``end <= begin``: the run
    ends by the warm-up's end, so the decay has no step to act on. The arguments of ``CosineAnnealingLR``.
    """

    def __init__(self, optimizer: Any, *args: Any, begin: int = 0, end: int = INF, by_epoch: bool = True,
                 **kwargs: Any):
        if end <= begin:
            unit = 'epoch' if by_epoch else 'iteration'
            print_log(f'{type(self).__name__}: the run ends at {unit} {end}, by the end of the warm-up ({unit} '
                      f'{begin}): no cosine decay, the whole run is warm-up', logger='current')
            end = begin + 1  # past the run's last step: the decay never acts
        super().__init__(optimizer, *args, begin=begin, end=end, by_epoch=by_epoch, **kwargs)
