"""A study's training-step timing: one training step of each row's model (forward, backward and the
step of its config's optimizer) on random images at its training batch and input size, on the device
the runs trained on (on the CPU with one thread); the rows take turns after a few warm-up steps each,
and each row's time is the median of its steps, so that another job on the machine costs each row
alike."""
from __future__ import annotations

import copy
import functools
import json
import logging
import statistics
import time
from typing import Dict, Optional

from mmengine.config import Config
from mmengine.registry import init_default_scope

__all__ = ['build_model', 'count_parameters', 'time_training_steps', 'training_step', 'step_timing_note',
           'device_words', 'WARMUP_STEPS']

WARMUP_STEPS = 2  # untimed steps per row first: allocation, the optimizer's state


def time_training_steps(configs: Dict[str, Config], repeats: int, device: str = 'cpu') -> Dict[str, dict]:
    """Seconds per training step of each row's model on ``device`` (``'cpu'``: one thread): rows take
    turns, ``WARMUP_STEPS`` untimed steps each, then ``repeats`` timed ones each, and each row's time
    is the median of its own (a moment in which another job takes the core costs a row one sample,
    and all rows alike). Returns {row: dict(step_time_s, batch_size, input_size=[height, width])}."""
    import torch
    synchronize = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
    from mmengine.logging import MMLogger
    threads, logger = torch.get_num_threads(), MMLogger.get_current_instance()
    level = logger.level
    torch.set_num_threads(1)
    logger.setLevel(logging.WARNING)  # building each model and optimizer logs what the training logs showed
    try:
        by_dataset, input_shapes, steps = {}, {}, {}
        for name, cfg in configs.items():
            dataset = json.dumps(cfg.train_dataloader.dataset.to_dict(), sort_keys=True, default=str)
            if dataset not in by_dataset:  # rows on the same data share one look at it
                by_dataset[dataset] = training_input_shape(cfg)
            input_shapes[name] = by_dataset[dataset]
            steps[name] = training_step(cfg, input_shapes[name], device)
        for _ in range(WARMUP_STEPS):
            for step in steps.values():
                step()
        seconds = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                synchronize()
                start = time.perf_counter()
                step()
                synchronize()
                seconds[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
        logger.setLevel(level)
    return {name: dict(step_time_s=statistics.median(seconds[name]), batch_size=cfg.train_dataloader.batch_size,
                       input_size=list(input_shapes[name][-2:]))
            for name, cfg in configs.items()}


def training_input_shape(cfg: Config) -> tuple:
    """(channels, height, width) of the images the config's training pipeline gives: its first sample's."""
    from mmpretrain.registry import DATASETS
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    return tuple(DATASETS.build(cfg.train_dataloader.dataset)[0]['inputs'].shape)


def training_step(cfg: Config, input_shape: tuple, device: str = 'cpu'):
    """A call that makes one training step of the config's model on ``device`` (``train_step``: data
    preprocessor, forward, loss, backward, the config's optimizer) on a fixed batch of random images
    of ``input_shape`` and random labels, ``train_dataloader.batch_size`` of them."""
    import torch
    from mmengine.optim import build_optim_wrapper
    from mmpretrain.structures import DataSample
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    optim_wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    batch_size = cfg.train_dataloader.batch_size
    batch = dict(inputs=torch.randint(0, 256, (batch_size, *input_shape), dtype=torch.uint8),
                 data_samples=[DataSample().set_gt_label(int(label))
                               for label in torch.randint(0, cfg.model.head.num_classes, (batch_size,))])
    return functools.partial(model.train_step, batch, optim_wrapper)


def step_timing_note(timing: Optional[dict], repeats: int, device: str = 'cpu') -> str:
    """How the table's step times were measured, in words."""
    if timing is None:
        return 'Step time: not measured (--no-timing).'
    return (f'Step time: one training step (forward, backward, optimizer step) of each row\'s model on random '
            f'images, batch and input size as its training ({"; ".join(batch_and_size(timing))}), timed by '
            f'tools/compare_phis.py after the runs on {device_words(device)}: the rows in turn, '
            f'{WARMUP_STEPS} warm-up steps each, then the median of {repeats} steps.')


def device_words(device: str) -> str:
    """Where the steps were timed, in words: 'the CPU with one thread' or 'the GPU'."""
    return 'the CPU with one thread' if device == 'cpu' else 'the GPU'



def batch_and_size(timing: dict) -> list:
    """The batches and input sizes the rows were timed at, each once: ['batch 64, 64 x 64 px']."""
    return list(dict.fromkeys(f'batch {row["batch_size"]}, {row["input_size"][0]} x {row["input_size"][1]} px'
                              for row in timing.values()))


def build_model(cfg: Config):
    """The model of ``cfg`` (with its data preprocessor, as mmengine's runner builds it), not initialised."""
    from mmpretrain.registry import MODELS
    from ..checkpoint import posattn_checkpoint_loading
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    model_cfg = copy.deepcopy(cfg.model)
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with posattn_checkpoint_loading():  # a swap row starts from a checkpoint of our own training
        return MODELS.build(model_cfg)


def count_parameters(cfg: Config) -> int:
    return sum(param.numel() for param in build_model(cfg).parameters())
