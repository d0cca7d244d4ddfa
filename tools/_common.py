"""What the tools share: the config handling common to tools/train.py, tools/test.py and
tools/analyze.py (``--cfg-options``, checked against what reads them, with the config's linked
settings), the runner they build (``PosattnRunner``, with the classes checked against the data),
and the scalars mmengine logs in a work dir."""
import argparse
import os
import os.path as osp
from pathlib import Path

import torch
from mmengine.config import Config, DictAction

import posattn_openmmlab  # noqa: F401  (the registrations)
from posattn_openmmlab.linked_settings import LINKED_KEYS, config_value, merge_options  # noqa: F401  (the tools')
from posattn_openmmlab.logs import is_validation, logged_scalars  # noqa: F401  (the tools')
from posattn_openmmlab.runner import build_runner  # noqa: F401  (the tools')

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
    merge_options(cfg, args.cfg_options)
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


def leave_process_group() -> None:
    """End a torchrun process's part in the run: every rank waits for the others (rank 0 prints its
    summary first), then the process group is destroyed before the interpreter exits. Left to the
    interpreter's exit, gloo's threads can abort the process (SIGABRT) after its work is done."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
