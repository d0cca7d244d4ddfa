"""What tools/train.py and tools/test.py share: the repository root on ``sys.path`` (so they run
from a clone without installing; ``integrations`` is not part of the installed ``posattn``), and
the config handling common to both."""
import argparse
import os
import os.path as osp
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from mmengine.config import Config, DictAction  # noqa: E402

import integrations.openmmlab  # noqa: E402,F401  (registrations, weights-only checkpoint loader)


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments tools/train.py and tools/test.py share, as OpenMMLab's tools name them."""
    parser.add_argument('--work-dir', help='where logs (and checkpoints) go (default: work_dirs/<config name>)')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, key=value (e.g. train_cfg.max_epochs=1)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher; torchrun needs pytorch')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def load_config(args) -> Config:
    """The config with ``--cfg-options``, ``--launcher`` and ``--work-dir`` applied.

    Distributed ranks without GPUs (torchrun on CPU) get the gloo backend and a DDP wrapper
    without device ids, which CPU modules need; GPU runs keep the config's nccl. For torchrun on
    CPU the process group is started here: mmengine 0.10.7's pytorch launcher calls
    ``torch.cuda.set_device`` first, which fails without a GPU, and skips that when a group exists.
    """
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    cfg.work_dir = args.work_dir or cfg.get('work_dir') or osp.join(
        'work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.launcher != 'none' and not torch.cuda.is_available():
        cfg.env_cfg.dist_cfg = dict(backend='gloo')
        cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False)
        if args.launcher == 'pytorch' and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend='gloo')
    return cfg
