"""Train a model from an mmengine config: ``python tools/train.py configs/pervit_t_shapes.py``.

The arguments of OpenMMLab's ``tools/train.py``; multi-GPU and multi-node through torchrun
(``tools/dist_train.sh``, ``--launcher pytorch``). Ends by printing how far the training went (in
epochs or iterations, what its loop counts), the last validation metrics, where the checkpoints are,
the training curve it draws into the work_dir (``training_curve.png``: the logged loss per
iteration and the validation metric per validation) and (for classifiers) the tools/analyze.py
command for the checkpoint.

Run again in a work_dir that holds a training of the same config, without ``--resume``, it does
not start that training over beside the old one's files: an unfinished training is resumed from its
newest complete checkpoint, and a finished one is reported (its last validation and checkpoints,
and how to train again) without training. A work_dir whose checkpoints come from other settings is
an error that lists the differences. ``--resume`` resumes whatever the settings.

Runs ``PosattnRunner`` (integrations/openmmlab/runner.py): one training per work_dir (a second one
stops before it writes anything, naming the run that holds it); checkpoints written atomically, old
ones removed only after the new one is complete; ``--resume`` continues bit for bit where the run
stopped (the random generators' states are in every checkpoint) and, without a path, from the
newest checkpoint that reads completely; ``load_from`` and ``--resume`` load strictly unless
``--partial-load``.
"""
import argparse
import os
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from _common import (LOGGED_NON_METRICS, add_runner_arguments, build_runner, is_validation, leave_process_group,
                     load_config, logged_scalars, parse_runner_arguments)
from mmengine.config import Config
from mmengine.dist import is_main_process
from mmengine.hooks import Hook, LoggerHook

from posattn.analysis import plot_training_curve
from posattn_openmmlab.class_checks import ClassCountMismatch
from posattn_openmmlab.data_checks import EmptyImageFiles
from posattn_openmmlab.runner import ResumePoint, find_resumable_checkpoint

# Config keys that say how a run is launched or started, not what it trains: a training resumed,
# or launched with another launcher, is still the same training.
LAUNCH_KEYS = ('work_dir', 'launcher', 'resume', 'load_from', 'env_cfg', 'model_wrapper_cfg')
# What a training loop counts, by the key of its length in train_cfg: (that key, the checkpoint meta's
# count of it, its name)
LOOP_COUNTS = (('max_epochs', 'epoch', 'epochs'), ('max_iters', 'iter', 'iterations'))
TRAINING_CURVE = 'training_curve.png'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train a model with mmengine: one training per work dir, checkpoints written atomically, '
                    '--resume continuing bit for bit, checkpoints loaded strictly (see docs/openmmlab.md). '
                    'Run again in the same work dir, it resumes an unfinished training and reports a finished one')
    parser.add_argument('config', help='config file')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from a checkpoint; without a path, from the latest in the work dir that '
                             'reads completely (a damaged latest one is reported and skipped), whatever '
                             'settings it was trained with')
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


def _differences(old, new, key='') -> Iterator[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(set(old) | set(new), key=str):
            inner = f'{key}.{name}' if key else name
            yield from _differences(old.get(name, '(unset)'), new.get(name, '(unset)'), inner)
    elif isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new) and old != new:
        for index, (was, now) in enumerate(zip(old, new)):  # each item by its index, as --cfg-options names it
            yield from _differences(was, now, f'{key}.{index}')
    elif old != new:
        yield f'{key}: was {_short(old)}, now {_short(new)}'


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + '...'


def differing_settings(saved_config: str, cfg: Config) -> List[str]:
    """Where the config a checkpoint was trained with (its ``meta['cfg']`` text) differs from
    ``cfg``, :data:`LAUNCH_KEYS` aside: one ``key: was value, now value`` line per setting."""
    if not saved_config:
        return ['(the checkpoint records no config)']
    try:
        saved = Config.fromstring(saved_config, '.py').to_dict()
    except Exception as error:  # a config text this mmengine cannot read back
        return [f'(the config saved in the checkpoint does not read: {type(error).__name__}: {error})']
    current = Config.fromstring(cfg.pretty_text, '.py').to_dict()  # the same round trip as the saved one
    for key in LAUNCH_KEYS:
        saved.pop(key, None)
        current.pop(key, None)
    return list(_differences(saved, current))


def checkpoint_templates(cfg: Config) -> List[str]:
    """The file names of the config's periodic checkpoints (CheckpointHook's ``filename_tmpl``)."""
    hook = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    return [hook.get('filename_tmpl') or ('epoch_{}.pth' if hook.get('by_epoch', True) else 'iter_{}.pth')]


def last_validation(work_dir: str) -> str:
    """The metrics of the last validation logged in ``work_dir`` (mmengine's scalars of each run)."""
    validations = [row for row in logged_scalars(work_dir) if is_validation(row)]
    if not validations:
        return 'none logged'
    metrics = {k: v for k, v in validations[-1].items() if k not in LOGGED_NON_METRICS}
    return ', '.join(f'{k}: {v:.4g}' if isinstance(v, float) else f'{k}: {v}' for k, v in metrics.items())


def loop_count(cfg: Config) -> Optional[Tuple[str, str, str]]:
    """The :data:`LOOP_COUNTS` entry of the config's training loop; None for a loop that states neither
    ``max_epochs`` nor ``max_iters``."""
    train_cfg = cfg.get('train_cfg') or {}
    return next((count for count in LOOP_COUNTS if count[0] in train_cfg), None)


def finished_line(cfg: Config, epochs: int, iterations: int) -> str:
    """How far a training went, in what its loop counts: epochs (with their iterations) or iterations."""
    count = loop_count(cfg)
    if count is None:
        return f'Finished training at epoch {epochs}, iteration {iterations}.'
    if count[2] == 'epochs':
        return f'Finished {epochs} epochs ({iterations} iterations).'
    return f'Finished {iterations} iterations.'


class TrainingHistory(NamedTuple):
    """What a training curve draws (:func:`~posattn.analysis.plot_training_curve`'s data)."""
    losses: Dict[int, float]  # {iteration: training loss}
    validations: Dict[str, Dict[int, float]]  # {metric: {epoch or iteration: value}}
    validation_unit: str  # what the validations' keys count: 'epoch' or 'iteration'


def curve_metrics(cfg: Config, rows: Sequence[dict]) -> List[str]:
    """The validation metrics a training curve draws: those the checkpoint hook's ``save_best`` names,
    else (``'auto'`` or unset) the first one logged, the metric mmengine's ``'auto'`` picks."""
    save_best = ((cfg.get('default_hooks') or {}).get('checkpoint') or {}).get('save_best')
    named = [name for name in ([save_best] if isinstance(save_best, str) else save_best or []) if name != 'auto']
    first = next((row for row in rows if is_validation(row)), {})
    return named or [key for key in first if key not in LOGGED_NON_METRICS][:1]


def training_history(rows: Sequence[dict], metrics: Sequence[str], counts_epochs: bool,
                     metrics_by_epoch: bool) -> TrainingHistory:
    """The training loss per logged iteration and ``metrics`` per validation, from logged ``rows``
    (:func:`logged_scalars`, in order).

    An iteration logged twice (a killed run's last ones, trained again after its resume) keeps the
    later value, and so does a validation. Where a validation is drawn: at its logged step, the
    epoch where the loop counts epochs (``counts_epochs``) and the LoggerHook logs metrics by epoch
    (``metrics_by_epoch``, mmengine's default), the iteration where the hook logs them by iteration
    (``log_metric_by_epoch=False``). An iteration loop whose hook logs metrics by epoch logs the
    loop's epoch (0 on an infinite sampler) as their step: those validations are drawn at the last
    training iteration logged before them, at most the logger's interval before they ran.
    """
    use_step = counts_epochs or not metrics_by_epoch
    losses, validations, reached = {}, {name: {} for name in metrics}, 0
    for row in rows:
        if not is_validation(row):
            reached = row.get('iter', row['step'])
            if 'loss' in row:
                losses[reached] = row['loss']
            continue
        for name in metrics:
            if name in row:
                validations[name][row['step'] if use_step else reached] = row[name]
    return TrainingHistory(losses, validations, 'epoch' if counts_epochs and metrics_by_epoch else 'iteration')


def metrics_logged_by_epoch(runner) -> bool:
    """Whether the runner's LoggerHook logs validation metrics at the epoch (mmengine's default) or
    at the iteration."""
    return next((hook.log_metric_by_epoch for hook in runner.hooks if isinstance(hook, LoggerHook)), True)


def write_training_curve(cfg: Config, work_dir: str, metrics_by_epoch: bool) -> str:
    """Draws the training curve of the runs logged in ``work_dir`` to ``work_dir/training_curve.png``;
    returns the line saying where it is, or why none was drawn."""
    rows = logged_scalars(work_dir)
    count = loop_count(cfg)
    history = training_history(rows, curve_metrics(cfg, rows), count is not None and count[2] == 'epochs',
                               metrics_by_epoch)
    if not history.losses and not any(history.validations.values()):
        return f'Training curve: none drawn, {work_dir} holds no logged loss or validation'
    path = Path(work_dir) / TRAINING_CURVE
    try:
        plot_training_curve(history.losses, history.validations, path, validation_unit=history.validation_unit,
                            title=Path(cfg.filename).stem if cfg.filename else None)
    except ImportError as error:  # matplotlib, an optional dependency
        return f'Training curve: none drawn ({error})'
    return f'Training curve: {path}'


def continue_previous_training(cfg: Config, found: Optional[ResumePoint] = None) -> bool:
    """What this run does about a training of this config already in its work_dir (called when
    ``--resume`` is not given). Returns False when there is nothing to train. ``found``: what
    :func:`find_resumable_checkpoint` found there, when the caller has looked already.

    * no checkpoint: True, a training from the beginning;
    * the checkpoints of an unfinished training: True, with ``cfg`` set to resume it;
    * those of a finished training: False, after printing its results and how to train again;
    * checkpoints of other settings, or none that reads completely: SystemExit with the reason
      and the choices.
    """
    work_dir = cfg.work_dir
    if found is None:
        found = find_resumable_checkpoint(work_dir, checkpoint_templates(cfg))
    if found.path is None and found.damaged:
        raise SystemExit(f'{work_dir} holds checkpoints of an earlier training, and none reads completely: '
                         f'{"; ".join(found.damaged)}. To train from the beginning, give another --work-dir or '
                         f'delete them; --resume PATH resumes from a checkpoint elsewhere.')
    if found.path is None:
        return True
    if found.checkpoint is None:  # remote storage, not read here: resume as mmengine would
        cfg.resume, cfg.load_from = True, None
        return True
    meta = found.checkpoint.get('meta') or {}
    differences = differing_settings(meta.get('cfg', ''), cfg)
    if differences:
        raise SystemExit(f'{work_dir} holds a training with other settings than this one ({found.path}):\n  '
                         + '\n  '.join(differences) + f'\nTo train from the beginning, give another --work-dir or '
                         f'delete {work_dir}; to continue from its checkpoints anyway, add --resume.')
    count = loop_count(cfg)
    length = None if count is None else (meta.get(count[1], 0), cfg.train_cfg[count[0]], count[2])
    if length is None or length[0] < length[1]:  # a loop that states no length carries on
        if is_main_process():
            where = f', at {length[0]} of {length[1]} {length[2]}' if length else ''
            print(f'{work_dir} holds an unfinished training of this config (newest complete checkpoint '
                  f'{found.path}{where}): resuming it. To train from the beginning instead, give another '
                  f'--work-dir or delete {work_dir}.', flush=True)
        cfg.resume, cfg.load_from = True, None
        return True
    if is_main_process():
        hub = (found.checkpoint.get('message_hub') or {}).get('runtime_info') or {}
        done, total, unit = length
        print(f'{work_dir} holds a finished training of this config ({done} of {total} {unit}): nothing to train.')
        print(f'Last validation: {last_validation(work_dir)}')
        print(f'Last checkpoint: {found.path}')
        if hub.get('best_ckpt') is not None:
            print(f'Best checkpoint: {hub["best_ckpt"]} ({hub.get("best_score", float("nan")):.4g})')
        if (Path(work_dir) / TRAINING_CURVE).is_file():
            print(f'Training curve: {Path(work_dir) / TRAINING_CURVE}')
        print(f'To train from the beginning, give another --work-dir or delete {work_dir}; to train on from '
              f'{os.path.basename(found.path)} (with a longer schedule), add --resume.')
    return False


def trained_config(args, work_dir: str) -> str:
    """The config to analyse or test the training with: the one given, or with --cfg-options the
    config the runner saved in the work_dir, which holds them."""
    saved = Path(work_dir) / Path(args.config).name
    return str(saved) if args.cfg_options and saved.is_file() else args.config


class LastMetrics(Hook):
    """Keeps the metrics of the latest validation, for the closing summary."""

    def __init__(self):
        self.metrics = {}

    def after_val_epoch(self, runner, metrics=None):
        self.metrics = dict(metrics or {})


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as error:  # --cfg-options that disagree with the config's linked keys
        raise SystemExit(f'tools/train.py {args.config}: {error}') from None
    found = find_resumable_checkpoint(cfg.work_dir, checkpoint_templates(cfg)) if args.resume is None else None
    if found is not None and not continue_previous_training(cfg, found):
        return
    runner = build_runner(cfg)
    if found is not None and cfg.resume:  # the unfinished training found above: load what was read there
        runner.resume_from(found)
    last_metrics = LastMetrics()
    runner.register_hook(last_metrics, priority='LOWEST')
    try:
        runner.train()
    except (ClassCountMismatch, EmptyImageFiles) as error:  # before the first step
        raise SystemExit(f'tools/train.py {args.config}: {error}') from None
    if is_main_process():
        hub = runner.message_hub
        # a run that was finished before (--resume of its last checkpoint) validates nothing now: its log has it
        results = (', '.join(f'{k}: {v:.4g}' for k, v in last_metrics.metrics.items())
                   or last_validation(runner.work_dir))
        print(f'\n{finished_line(runner.cfg, runner.epoch, runner.iter)} Last validation: {results}')
        print(f'Last checkpoint: {hub.get_info("last_ckpt", "none saved")}')
        if hub.get_info('best_ckpt') is not None:
            print(f'Best checkpoint: {hub.get_info("best_ckpt")} ({hub.get_info("best_score"):.4g})')
        print(f'Logs: {runner.log_dir}')
        print(write_training_curve(runner.cfg, runner.work_dir, metrics_logged_by_epoch(runner)))
        checkpoint = hub.get_info('best_ckpt') or hub.get_info('last_ckpt')
        if checkpoint is not None and runner.cfg.get('default_scope') == 'mmpretrain':  # classifiers only
            print(f'What the attention learned (Φp maps, nonlocality, impact; docs/analysis.md):\n'
                  f'  python tools/analyze.py {trained_config(args, runner.work_dir)} {checkpoint} '
                  f'--out {runner.work_dir}/analysis')
    leave_process_group()


if __name__ == '__main__':
    main()
