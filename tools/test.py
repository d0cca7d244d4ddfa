"""Evaluate a checkpoint: ``python tools/test.py configs/pervit_t_shapes.py work_dirs/.../epoch_12.pth``.

Runs the config's ``test_dataloader`` / ``test_evaluator`` with mmengine; multi-GPU through
torchrun (``--launcher pytorch``). Prints the metrics, and writes them as JSON with ``--out``.

The checkpoint loads strictly: one that does not fit the config's model is an error listing the
differing keys and, for posattn's models, naming the model the checkpoint holds. ``--partial-load``
evaluates with the weights that fit and logs every key it skipped.

The runner is built without the config's training parts, so it takes no work_dir lock and writes
only its own log folder (config dump included): it can evaluate a checkpoint of a training that
is running in the same work_dir.
"""
import argparse
import json

from _common import add_runner_arguments, build_runner, load_config, parse_runner_arguments
from mmengine.config import Config
from mmengine.dist import is_main_process


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Evaluate a checkpoint with mmengine; it must fit the config's model (or pass --partial-load)")
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out', help='write the metrics to this JSON file')
    add_runner_arguments(parser)
    return parse_runner_arguments(parser, argv)


def build_config(args) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    cfg.resume = False
    # evaluation only: no training parts, so the runner neither locks nor writes the work_dir's files
    cfg.train_dataloader = cfg.train_cfg = cfg.optim_wrapper = cfg.param_scheduler = None
    if args.amp:
        cfg.test_cfg = dict(cfg.get('test_cfg') or {}, fp16=True)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    metrics = build_runner(build_config(args)).test()
    if is_main_process():
        print('\n' + ', '.join(f'{k}: {v:.4g}' for k, v in metrics.items()))
        if args.out:
            with open(args.out, 'w') as f:  # mmseg's metrics are numpy scalars
                json.dump({k: v.item() if hasattr(v, 'item') else v for k, v in metrics.items()}, f, indent=2)
    return metrics


if __name__ == '__main__':
    main()
