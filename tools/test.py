"""Evaluate a checkpoint: ``python tools/test.py configs/pervit_t_shapes.py work_dirs/.../epoch_12.pth``.

Runs the config's ``test_dataloader`` / ``test_evaluator`` with mmengine; multi-GPU through
torchrun (``--launcher pytorch``). Prints the metrics, and writes them as JSON with ``--out``.
"""
import argparse
import json
import os

from _common import load_config
from mmengine.config import Config, DictAction
from mmengine.dist import is_main_process
from mmengine.runner import Runner


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Evaluate a checkpoint with mmengine')
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='where the logs go (default: work_dirs/<config name>)')
    parser.add_argument('--out', help='write the metrics to this JSON file')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, key=value (e.g. test_dataloader.batch_size=32)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher; torchrun needs pytorch')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def build_config(args) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    cfg.resume = False
    if args.amp:
        cfg.test_cfg = dict(cfg.get('test_cfg') or {}, fp16=True)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    metrics = Runner.from_cfg(build_config(args)).test()
    if is_main_process():
        print('\n' + ', '.join(f'{k}: {v:.2f}' for k, v in metrics.items()))
        if args.out:
            with open(args.out, 'w') as f:
                json.dump(metrics, f, indent=2)
    return metrics


if __name__ == '__main__':
    main()
