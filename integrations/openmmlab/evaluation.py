"""A classifier's checkpoint evaluated on its config's test split, at its own size or another:
the function behind ``tools/test.py`` and the tests of a study at other sizes.

:func:`evaluate_checkpoint` loads the checkpoint strictly (unless the config says ``partial_load``),
rewrites the test split to another size where asked (:mod:`.sizes`), refuses before any test data
are made a size the model cannot be tested at in memory (:func:`check_test_fits`), stops before the
first batch where the test data's classes differ from the checkpoint's
(:class:`~.class_checks.TrainedClassesCheck`), and returns the metrics with the size of the images
the model saw. The runner is built without the config's training parts, so it takes no work_dir lock
and writes only its own log folder.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Union

import torch
from mmengine.config import Config
from mmengine.dist import all_gather_object
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from torch import nn

from posattn._memory import check_fits
from posattn.attention import LogitsProbe

from .class_checks import TrainedClassesCheck
from .runner import build_runner
from .sizes import Size, set_test_extent, set_test_size

__all__ = ['Evaluation', 'evaluate_checkpoint', 'check_test_fits', 'TestedImageSizes']


class _AttentionChecked(Exception):
    """Stops :func:`check_test_fits`'s probe at the first attention layer, once its memory check passed."""


def _stop_probe(module: nn.Module, args: Any, output: Any) -> None:
    raise _AttentionChecked


def check_test_fits(model: nn.Module, size: Size, batch_size: int, fp16: bool = False) -> None:
    """Raise a MemoryError naming what cannot fit where testing at ``size`` (height, width) needs more
    memory than the model's device has available, before any test data are made:

    * a test batch as the model takes it, ``batch_size`` x 3 x height x width in float32;
    * the attention of one image: posattn's attention layers check, before they compute them, the
      (heads, N, N) terms a call needs (the Φp's logits bias, the probabilities where they are
      formed; :class:`posattn.Attention`), and one image of zeros at ``size`` is passed through the
      model as far as its first attention layer's check (the stem, and that layer's Φp, are
      computed; no further). A model without posattn's attention is not probed.

    Terms below 1 GiB are not checked.
    """
    module = model.module if is_model_wrapper(model) else model
    device = next(module.parameters()).device
    height, width = size
    check_fits(batch_size * 3 * height * width * 4, device,
               f'a test batch of {batch_size} images at {height} x {width} pixels (float32)', 'test at a smaller size')
    probes = [m for m in module.modules() if isinstance(m, LogitsProbe)]
    if not probes:
        return
    hooks = [probe.register_forward_hook(_stop_probe) for probe in probes]
    training = module.training
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            module.eval().extract_feat(torch.zeros(1, 3, height, width, device=device))
    except _AttentionChecked:
        pass
    finally:
        for hook in hooks:
            hook.remove()
        module.train(training)


class TestedImageSizes(Hook):
    """The (height, width) of every image tested, on every process, as the data loader gives them
    (before the data preprocessor, which may pad a batch)."""

    def __init__(self):
        self.sizes = set()

    def after_test_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.sizes.update(tuple(image.shape[-2:]) for image in (data_batch or {}).get('inputs', ()))

    def size(self) -> Optional[Size]:
        """The one size every process's images had; None where they differ (or none was seen)."""
        sizes = set().union(*all_gather_object(sorted(self.sizes)))
        return tuple(int(side) for side in sizes.pop()) if len(sizes) == 1 else None


class Evaluation(NamedTuple):
    """What :func:`evaluate_checkpoint` measured."""
    metrics: Dict[str, Any]
    img_size: Optional[Size]  # of every image tested; None where they were not all of one size
    change: Optional[str]  # what the test data were rewritten to, in words; None: as the config gives them


def evaluate_checkpoint(cfg: Config, checkpoint: Union[str, Path], *, size: Optional[Size] = None,
                        extent: Optional[int] = None, fp16: bool = False,
                        asked_by: str = 'the test size') -> Evaluation:
    """The test metrics of ``checkpoint`` with ``cfg`` (overrides applied, ``work_dir`` set), its
    test images at ``size`` (height, width) or its PositionalRelations scenes on an ``extent`` x
    ``extent`` canvas, without fine-tuning; at the config's own test size where neither is given.

    A ValueError names a size it cannot rewrite the test data to; a MemoryError what cannot fit; the
    class checks' errors stop it before the first batch. ``asked_by``: what asked for the size, which
    the log line that says what changed begins with (a tool's option)."""
    cfg = copy.deepcopy(cfg)
    cfg.load_from, cfg.resume = str(checkpoint), False
    # evaluation only: no training parts, so the runner neither locks nor writes the work_dir's files
    cfg.train_dataloader = cfg.train_cfg = cfg.optim_wrapper = cfg.param_scheduler = None
    if fp16:
        cfg.test_cfg = dict(cfg.get('test_cfg') or {}, fp16=True)
    change = None
    if size is not None or extent is not None:
        change = set_test_size(cfg, size) if extent is None else set_test_extent(cfg, extent)
    runner = build_runner(cfg)
    tested_at = size if extent is None else (extent, extent)
    if tested_at is not None:
        check_test_fits(runner.model, tested_at, cfg.test_dataloader.batch_size, fp16=fp16)
        runner.logger.info(f'{asked_by}: {change}; the model as the config builds it, without fine-tuning')
    runner.register_hook(TrainedClassesCheck())
    tested = TestedImageSizes()
    runner.register_hook(tested, priority='LOWEST')
    metrics = runner.test()
    return Evaluation(metrics, tested.size(), change)
