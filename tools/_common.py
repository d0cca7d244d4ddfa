"""What tools/train.py and tools/test.py share: the repository root on ``sys.path`` (so they run
from a clone without installing; ``integrations`` is not part of the installed ``posattn``), and
the config handling common to both."""
import os.path as osp
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from mmengine.config import Config  # noqa: E402

import integrations.openmmlab  # noqa: E402,F401  (registrations, weights-only checkpoint loader)


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
