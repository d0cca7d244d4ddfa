"""Train a model from an mmengine config: ``python tools/train.py configs/pervit_t_shapes.py``.

The arguments of OpenMMLab's ``tools/train.py``; multi-GPU and multi-node through torchrun
(``tools/dist_train.sh``, ``--launcher pytorch``). Ends by printing the last validation metrics,
where the checkpoints are, and (for classifiers) the tools/analyze.py command for the checkpoint.

Runs ``PosattnRunner`` (integrations/openmmlab/runner.py): one training per work_dir (a second one
stops at its start, naming the run that holds it); checkpoints written atomically, old ones removed
only after the new one is complete; ``--resume`` continues bit for bit where the run stopped (the
random generators' states are in every checkpoint) and, without a path, from the newest checkpoint
that reads completely; ``load_from`` and ``--resume`` load strictly unless ``--partial-load``.
"""
import argparse

from _common import add_runner_arguments, build_runner, load_config, parse_runner_arguments
from mmengine.config import Config
from mmengine.dist import is_main_process
from mmengine.hooks import Hook


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train a model with mmengine: one training per work dir, checkpoints written atomically, '
                    '--resume continuing bit for bit, checkpoints loaded strictly (see docs/openmmlab.md)')
    parser.add_argument('config', help='config file')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from a checkpoint; without a path, from the latest in the work dir that '
                             'reads completely (a damaged latest one is reported and skipped)')
    parser.add_argument('--no-validate', action='store_true', help='skip validation during training')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help="scale the lr from the config's auto_scale_lr.base_batch_size to the batch used")
    add_runner_arguments(parser)
    return parse_runner_arguments(parser, argv)


def build_config(args) -> Config:
    """The config with the command line's overrides applied."""
    cfg = load_config(args)
    if args.amp:
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    if args.resume == 'auto':
        cfg.resume, cfg.load_from = True, None
    elif args.resume is not None:
        cfg.resume, cfg.load_from = True, args.resume
    if args.no_validate:
        cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    if args.auto_scale_lr:
        cfg.auto_scale_lr.enable = True
    return cfg


class LastMetrics(Hook):
    """Keeps the metrics of the latest validation, for the closing summary."""

    def __init__(self):
        self.metrics = {}

    def after_val_epoch(self, runner, metrics=None):
        self.metrics = dict(metrics or {})


def main(argv=None):
    args = parse_args(argv)
    runner = build_runner(build_config(args))
    last_metrics = LastMetrics()
    runner.register_hook(last_metrics, priority='LOWEST')
    runner.train()
    if is_main_process():
        hub = runner.message_hub
        results = ', '.join(f'{k}: {v:.4g}' for k, v in last_metrics.metrics.items()) or 'no validation run'
        print(f'\nFinished {runner.epoch} epochs / {runner.iter} iterations. Last validation: {results}')
        print(f'Last checkpoint: {hub.get_info("last_ckpt", "none saved")}')
        if hub.get_info('best_ckpt') is not None:
            print(f'Best checkpoint: {hub.get_info("best_ckpt")} ({hub.get_info("best_score"):.4g})')
        print(f'Logs: {runner.log_dir}')
        checkpoint = hub.get_info('best_ckpt') or hub.get_info('last_ckpt')
        if checkpoint is not None and runner.cfg.get('default_scope') == 'mmpretrain':  # classifiers only
            print(f'What the attention learned (Φp maps, nonlocality, impact; docs/analysis.md):\n'
                  f'  python tools/analyze.py {args.config} {checkpoint} --out {runner.work_dir}/analysis')


if __name__ == '__main__':
    main()
