"""What the tools share: the config handling common to tools/train.py and tools/test.py, the runner
they build (``PosattnRunner``), and the scalars mmengine logs in a work dir."""
import argparse
import json
import os
import os.path as osp
from pathlib import Path
from typing import List

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS

import posattn_openmmlab  # noqa: F401  (the registrations)
from posattn_openmmlab.runner import PosattnRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
# Keys of a logged validation row that are not metrics: its timing, and where it was logged
LOGGED_NON_METRICS = ('data_time', 'time', 'step')


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments tools/train.py and tools/test.py share, as OpenMMLab's tools name them."""
    parser.add_argument('--work-dir', help='where logs (and checkpoints) go (default: work_dirs/<config name>)')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, key=value (e.g. train_cfg.max_epochs=1)')
    parser.add_argument('--partial-load', action='store_true',
                        help='load the weights of a checkpoint that fit the model and log every key skipped '
                             '(load_from, --resume, the checkpoint of tools/test.py); without it a checkpoint '
                             'that does not fit is an error. The same as partial_load=True in the config')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher; torchrun needs pytorch')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def load_config(args) -> Config:
    """The config with ``--cfg-options``, ``--partial-load``, ``--launcher`` and ``--work-dir`` applied.

    Distributed ranks without GPUs (torchrun on CPU) get the gloo backend and a DDP wrapper
    without device ids, which CPU modules need; GPU runs keep the config's nccl. For torchrun on
    CPU the process group is started here: mmengine 0.10.7's pytorch launcher calls
    ``torch.cuda.set_device`` first, which fails without a GPU, and skips that when a group exists.
    """
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    if args.partial_load:
        cfg.partial_load = True
    cfg.work_dir = args.work_dir or cfg.get('work_dir') or osp.join(
        'work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.launcher != 'none' and not torch.cuda.is_available():
        cfg.env_cfg.dist_cfg = dict(backend='gloo')
        cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False)
        if args.launcher == 'pytorch' and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend='gloo')
    return cfg


def build_runner(cfg: Config) -> PosattnRunner:
    """The config's ``runner_type`` (``PosattnRunner`` when it names none), which must be
    ``PosattnRunner`` or derive from it: the tools rely on its strict, weights-only loading, atomic
    saves, exact resume and work_dir lock."""
    name = cfg.get('runner_type', 'PosattnRunner')
    runner_cls = RUNNERS.get(name)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, PosattnRunner)):
        raise ValueError(f"runner_type={name!r} in the config is not a PosattnRunner (posattn_openmmlab."
                         f"runner), which tools/train.py and tools/test.py need: use runner_type='PosattnRunner' "
                         f"or a subclass of it")
    return runner_cls.from_cfg(cfg)


def logged_scalars(work_dir) -> List[dict]:
    """The rows mmengine logged in ``work_dir`` (``<timestamp>/vis_data/scalars.json``), every run's in
    the order the runs started: a training resumed has a folder per start."""
    rows = []
    for log in sorted(Path(work_dir).glob('*/vis_data/scalars.json')):
        rows += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return rows


def is_validation(row: dict) -> bool:
    """Whether a logged row holds a validation's metrics (training rows hold the loss and the lr)."""
    return 'loss' not in row and 'lr' not in row
