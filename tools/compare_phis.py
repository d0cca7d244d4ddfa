"""Φp compared on the embedded set, one budget per row, in four experiments:

    python tools/compare_phis.py                       # table2: 5 rows x seed 0, 10 epochs each
    python tools/compare_phis.py --epochs 3 --seeds 0 1 --rows deit_t_none pervit_t
    python tools/compare_phis.py --experiment schemes  # DeiT-T with RoPE, tables, ALiBi, GPSA; ConViT-T
    python tools/compare_phis.py --experiment swap     # DeiT-T, then a fine-tune per swapped-in Φp
    python tools/compare_phis.py --experiment ablations --seeds 0 1   # PerViT's study, 8 x 8 grid

``table2`` is PerViT Table 2: the same ViT-Tiny with each Φp, and PerViT-T, from scratch.
``schemes`` puts the positional schemes of later ViTs in the same ViT-Tiny, from scratch (RoPE-Mixed,
a relative position bias table, 2D ALiBi, gated positional attention), beside plain DeiT-T and a
ConViT-T-like model. ``swap``
trains mmpretrain's own DeiT-T (``configs/swap/deit-t_shapes.py``), then fine-tunes that checkpoint
with each Φp swapped in by ``PosattnSwappedBackbone`` (``configs/swap/deit-t_finetune-*_shapes.py``).
``ablations`` is PerViT's component study (Table 1 rows (a), (b), (c)) and Φp initialisations
(Table 5: peripheral is row (a), conv, rand) on an 8 x 8 token grid
(``configs/ablations/shapes/``); after each run ``tools/analyze.py`` measures its attention, and
the nonlocality of Φp and Φa per layer (the paper's Fig. A8) joins the run's record.

Every row is a config trained by ``tools/train.py`` (one process per run, its log under the work
dir) with the data and recipe of ``configs/_base_/shapes.py``: within an experiment's stage only
the model differs. ``--epochs`` sets every run's length alike (the cosine schedule ends with it);
each seed sets mmengine's ``randomness.seed`` (initialisation and shuffling; the data is the same).
A row that starts from another (the fine-tunes) takes the last checkpoint of that row's run with
the same seed.

A run that finished before in the work dir with the same overrides (its ``run.json``) is
reused, not trained again; delete its folder to rerun it. Writes to the work dir:
``comparison.json`` (every run: validation top-1 per epoch, parameters, median training step
time over mmengine's logged windows, wall time), ``comparison.md`` (the table: means over seeds,
and per seed the first epoch at 95% top-1) and ``comparison.png`` (validation top-1 per epoch,
and final top-1 against step time).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from typing import NamedTuple, Optional

from _common import REPO_ROOT, logged_scalars
from mmengine.config import Config, DictAction
from mmengine.registry import init_default_scope


class Row(NamedTuple):
    """One model of an experiment: its config (under configs/), what it is, and the row whose
    trained checkpoint it starts from (None: from scratch)."""
    config: str
    label: str
    start_from: Optional[str] = None


def _finetune(phi: str, label: str) -> Row:
    return Row(f'swap/deit-t_finetune-{phi}_shapes.py', f'DeiT-T fine-tuned, + {label}', start_from='deit_t')


EXPERIMENTS = {
    'table2': {  # PerViT Table 2, from scratch
        'deit_t_none': Row('deit_t_none_shapes.py', 'DeiT-T (abs. embedding)'),
        'deit_t_peg': Row('deit_t_peg_shapes.py', 'DeiT-T + CPVT (PEG)'),
        'deit_t_irpe': Row('deit_t_irpe_shapes.py', 'DeiT-T + iRPE-K'),
        'deit_t_peripheral': Row('deit_t_peripheral_shapes.py', 'DeiT-T + PPE (peripheral)'),
        'pervit_t': Row('pervit_t_shapes.py', 'PerViT-T'),
    },
    'schemes': {  # the positional schemes of later ViTs in the same DeiT-T, from scratch
        'deit_t_none': Row('deit_t_none_shapes.py', 'DeiT-T (abs. embedding)'),
        'deit_t_rope': Row('deit_t_rope_shapes.py', 'DeiT-T + RoPE-Mixed (rope)'),
        'deit_t_rpb': Row('deit_t_rpb_shapes.py', 'DeiT-T + bias table (rpb)'),
        'deit_t_alibi': Row('deit_t_alibi_shapes.py', 'DeiT-T + 2D ALiBi (alibi)'),
        'deit_t_gpsa': Row('deit_t_gpsa_shapes.py', 'DeiT-T + GPSA (gpsa)'),
        'convit_t': Row('convit_t_shapes.py', 'ConViT-T-like (gpsa in blocks 0-9)'),
    },
    'swap': {  # mmpretrain's DeiT-T, then each Φp swapped in and fine-tuned from its checkpoint
        'deit_t': Row('swap/deit-t_shapes.py', "mmpretrain's DeiT-T (abs. embedding), from scratch"),
        'finetune_none': _finetune('none', "plain attention ('none')"),
        'finetune_peg': _finetune('peg', 'CPVT (PEG)'),
        'finetune_irpe': _finetune('irpe', 'iRPE-K'),
        'finetune_peripheral': _finetune('peripheral', 'PPE (peripheral)'),
    },
}
ABLATION_CONFIGS = 'ablations/shapes/pervit-t_{}_shapes.py'
EXPERIMENTS['ablations'] = {  # PerViT Table 1 (a)-(c) and Table 5 (top), from scratch on an 8 x 8 grid
    'a': Row(ABLATION_CONFIGS.format('components-a'), '(a) PerViT-T, peripheral init'),
    'b': Row(ABLATION_CONFIGS.format('components-b'), '(b) without Φp'),
    'c': Row(ABLATION_CONFIGS.format('components-c'), '(c) without Φc'),
    'init_conv': Row(ABLATION_CONFIGS.format('init-conv'), '(a), conv init'),
    'init_rand': Row(ABLATION_CONFIGS.format('init-rand'), '(a), rand init'),
}
MEASURED_EXPERIMENTS = {'ablations'}  # their runs are analysed (tools/analyze.py) after training
ANALYSED_IMAGES = 256
# The inits that a fine-tune's starting checkpoint goes to: the swapped backbone's and the head's.
STARTING_CHECKPOINT_KEYS = ('model.backbone.backbone.init_cfg.checkpoint', 'model.head.init_cfg.checkpoint')
TARGET_TOP1 = 95.0  # "epochs to reach": how fast each row learns, where most end near 100%
SKIPPED_LOGGED_WINDOWS = 1  # the first logged window of each run holds warm-up (allocation, first batches)
RUN_RECORD = 'run.json'  # per finished run: what read_run found and the wall time; lets a rerun reuse it


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train each row of an experiment on the embedded set with one budget')
    parser.add_argument('--experiment', choices=list(EXPERIMENTS), default='table2',
                        help="table2: PerViT Table 2's rows from scratch; schemes: later ViTs' positional schemes "
                             "in DeiT-T, and ConViT-T; swap: DeiT-T, then a fine-tune per Φp; "
                             "ablations: PerViT's components and Φp initialisations on an 8 x 8 grid")
    parser.add_argument('--rows', nargs='+', help="rows to train (default: all of the experiment's; a row that "
                                                  'starts from another trains that one too)')
    parser.add_argument('--seeds', nargs='+', type=int, default=[0], help='one run per row and seed')
    parser.add_argument('--epochs', type=int, help="epochs per run (default: the configs', 10 from scratch, 5 to fine-tune)")
    parser.add_argument('--work-dir', help='runs, table and plot go here (default: work_dirs/compare_phis, '
                                           'and its swap/ folder for the swap experiment)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='further overrides, the same for every run (e.g. train_dataloader.dataset.num_images=600)')
    args = parser.parse_args(argv)
    rows = EXPERIMENTS[args.experiment]
    unknown = sorted(set(args.rows or ()) - set(rows))
    if unknown:
        parser.error(f'no row {", ".join(unknown)} in the {args.experiment} experiment; its rows: {", ".join(rows)}')
    if args.epochs is not None and args.epochs < 2:
        parser.error(f'--epochs must be >= 2 (one warm-up epoch, then the cosine decay), got {args.epochs}')
    args.work_dir = args.work_dir or ('work_dirs/compare_phis' + ('' if args.experiment == 'table2'
                                                                  else f'/{args.experiment}'))
    return args


def planned_rows(args) -> list:
    """The rows to train, in the experiment's order, with every row a chosen one starts from."""
    rows = EXPERIMENTS[args.experiment]
    chosen = set(args.rows or rows)
    chosen |= {rows[name].start_from for name in chosen if rows[name].start_from}
    return [name for name in rows if name in chosen]


def config_path(config: str) -> Path:
    return REPO_ROOT / 'configs' / config


def last_checkpoint(run_dir: Path) -> Path:
    """The checkpoint mmengine saved last in ``run_dir`` (its ``last_checkpoint`` file names it)."""
    record = run_dir / 'last_checkpoint'
    if not record.is_file():
        raise FileNotFoundError(f'{run_dir} holds no finished training (no last_checkpoint file)')
    path = Path(record.read_text().strip())
    return path if path.is_absolute() else REPO_ROOT / path


def overrides(args, seed: int, starting_checkpoint: Optional[Path] = None) -> list:
    """``--cfg-options`` for one run: the seed, the budget, the checkpoint it starts from (if any),
    and the user's extra overrides."""
    options = dict(args.cfg_options, **{'randomness.seed': seed})
    if args.epochs is not None:
        options.update({'train_cfg.max_epochs': args.epochs, 'param_scheduler.1.end': args.epochs})
    if starting_checkpoint is not None:
        options.update(dict.fromkeys(STARTING_CHECKPOINT_KEYS, str(starting_checkpoint)))
    return [f'{key}={value}' for key, value in options.items()]


def count_parameters(row: Row, options: list) -> int:
    from mmpretrain.registry import MODELS
    cfg = Config.fromfile(config_path(row.config))
    cfg.merge_from_dict(dict(option.split('=', 1) for option in options))
    init_default_scope(cfg.default_scope)
    from posattn_openmmlab import posattn_checkpoint_loading
    with posattn_checkpoint_loading():  # a swap row starts from a checkpoint of our own training
        return sum(p.numel() for p in MODELS.build(cfg.model).parameters())


def train(row: Row, options: list, work_dir: Path) -> float:
    """Runs tools/train.py, echoing each validation line; returns the wall time in seconds."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO_ROOT / 'tools' / 'train.py'), str(config_path(row.config)),
               '--work-dir', str(work_dir), '--cfg-options', *options]
    start = time.perf_counter()
    with open(work_dir / 'train.log', 'w') as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
        for line in process.stdout:
            log.write(line)
            if 'Epoch(val)' in line and 'accuracy/top1' in line:
                print('    ' + line.split(' - ')[-1].strip(), flush=True)
    if process.wait() != 0:
        tail = ''.join((work_dir / 'train.log').read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f'{row.config} failed; {work_dir / "train.log"} ends with:\n{tail}')
    return time.perf_counter() - start


def measure_nonlocality(row: Row, options: list, run_dir: Path) -> dict:
    """Runs tools/analyze.py on the run's last checkpoint (``ANALYSED_IMAGES`` validation images,
    its figures under ``run_dir/analysis``); returns Ω of Φp and of Φa per layer, means over heads
    (Φp's None where a layer has no positional bias)."""
    out = run_dir / 'analysis'
    command = [sys.executable, str(REPO_ROOT / 'tools' / 'analyze.py'), str(config_path(row.config)),
               str(last_checkpoint(run_dir)), '--out', str(out), '--num-images', str(ANALYSED_IMAGES),
               '--cfg-options', *options]
    with open(run_dir / 'analyze.log', 'w') as log:
        if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT).returncode != 0:
            raise RuntimeError(f'analysing {row.config} failed; see {run_dir / "analyze.log"}')
    layers = json.loads((out / 'metrics.json').read_text())['layers']

    def head_means(key):
        return [None if layer[key] is None else statistics.fmean(layer[key]) for layer in layers]
    return dict(position=head_means('nonlocality_position'), mixed=head_means('nonlocality_mixed'))


def read_run(work_dir: Path) -> dict:
    """Validation top-1 per epoch and mean step time, from the run's mmengine scalars (every log
    folder in time order: a run that was resumed has one per start)."""
    rows = logged_scalars(work_dir)
    if not rows:
        raise FileNotFoundError(f'no mmengine scalars under {work_dir}')
    accuracy = [row['accuracy/top1'] for row in rows if 'accuracy/top1' in row]
    step_times = [row['time'] for row in rows if 'loss' in row][SKIPPED_LOGGED_WINDOWS:]
    if not accuracy or not step_times:
        raise ValueError(f'the scalars logged under {work_dir} have no validation or too few logged iterations '
                         'to time')
    # the median over logged windows: a window in which another job took the cores is an outlier
    return dict(top1_per_epoch=accuracy, step_time_s=statistics.median(step_times))


def finished_run(work_dir: Path, options: list):
    """The record of a run that finished in ``work_dir`` with these ``--cfg-options``, else None."""
    path = work_dir / RUN_RECORD
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run if run.get('options') == options else None


def summarise(runs: list, rows: dict) -> list:
    """One line per row: means (and spread) over its seeds."""
    table = []
    for row in dict.fromkeys(run['row'] for run in runs):
        mine = [run for run in runs if run['row'] == row]
        finals = [run['top1_per_epoch'][-1] for run in mine]
        table.append(dict(
            row=row, model=rows[row].label, config=rows[row].config, seeds=[run['seed'] for run in mine],
            top1=statistics.fmean(finals), top1_spread=(max(finals) - min(finals)) if len(finals) > 1 else None,
            best_top1=statistics.fmean(max(run['top1_per_epoch']) for run in mine),
            epochs_to_target=[next((epoch for epoch, top1 in enumerate(run['top1_per_epoch'], 1) if top1 >= TARGET_TOP1),
                                   None) for run in mine],
            nonlocality=_mean_nonlocality(mine),
            params_m=mine[0]['params'] / 1e6, step_time_ms=1e3 * statistics.fmean(run['step_time_s'] for run in mine),
            wall_min=statistics.fmean(run['wall_s'] for run in mine) / 60, epochs=len(mine[0]['top1_per_epoch']),
        ))
    return table


def _mean_nonlocality(runs: list) -> Optional[dict]:
    """Ω of Φp and Φa per layer, means over the runs (seeds); None for runs not analysed."""
    if any('nonlocality' not in run for run in runs):
        return None
    means = {}
    for key in ('position', 'mixed'):
        per_layer = zip(*(run['nonlocality'][key] for run in runs))
        means[key] = [None if None in values else statistics.fmean(values) for values in per_layer]
    return means


def markdown(table: list) -> str:
    lines = ['| model | config | params (M) | epochs | final val top-1 (%) | best epoch top-1 (%) '
             f'| epochs to {TARGET_TOP1:g}% | step time (ms) | run time (min) |', '|---|---|---|---|---|---|---|---|---|']
    for line in table:
        spread = f' (range {line["top1_spread"]:.1f}, {len(line["seeds"])} seeds)' if line['top1_spread'] is not None else ''
        reached = ', '.join('-' if epoch is None else str(epoch) for epoch in line['epochs_to_target'])
        lines.append(f'| {line["model"]} | `{line["config"]}` | {line["params_m"]:.2f} | {line["epochs"]} '
                     f'| {line["top1"]:.1f}{spread} | {line["best_top1"]:.1f} | {reached} | {line["step_time_ms"]:.0f} '
                     f'| {line["wall_min"]:.1f} |')
    return '\n'.join(lines) + '\n'


def nonlocality_markdown(table: list) -> str:
    """Ω of Φa and Φp per layer (means over heads and seeds) of the measured rows; '' if none."""
    measured = [line for line in table if line['nonlocality']]
    if not measured:
        return ''

    def cells(values):
        return ' '.join('-' if value is None else f'{value:.3g}' for value in values)
    lines = ['| model | Ω of Φa, layer 1 to last | Ω of Φp, layer 1 to last |', '|---|---|---|']
    lines += [f'| {line["model"]} | {cells(line["nonlocality"]["mixed"])} | {cells(line["nonlocality"]["position"])} |'
              for line in measured]
    return '\n'.join(lines) + '\n'


def plot(runs: list, table: list, rows: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    measured = [line for line in table if line['nonlocality']]
    if measured:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7.6))
        axes = axes.flatten()
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    curves, scatter = axes[:2]
    colours = {row: f'C{i}' for i, row in enumerate(rows)}
    labelled = set()
    for run in runs:  # one curve per run, one legend entry per row
        epochs = range(1, len(run['top1_per_epoch']) + 1)
        label = None if run['row'] in labelled else rows[run['row']].label
        labelled.add(run['row'])
        curves.plot(epochs, run['top1_per_epoch'], color=colours[run['row']], marker='.', label=label)
    curves.axhline(100 / 6, color='grey', linestyle=':', linewidth=1, label='chance')
    curves.set(xlabel='epoch', ylabel='validation top-1 (%)', title='PositionalShapes')
    curves.legend(fontsize=7)
    for index, line in enumerate(table):  # labels alternately above and below, so neighbours do not overlap
        scatter.scatter(line['step_time_ms'], line['top1'], color=colours[line['row']], s=40)
        scatter.annotate(f'{line["model"]}\n{line["params_m"]:.1f} M', (line['step_time_ms'], line['top1']),
                         fontsize=7, xytext=(4, 4 if index % 2 == 0 else -20), textcoords='offset points')
    scatter.set(xlabel='training step time (ms, batch 64, CPU)', ylabel='final validation top-1 (%)',
                title='accuracy vs. cost')
    scatter.margins(0.25)
    if measured:  # the paper's Fig. A8: Ω per layer of Φa, and of Φp (unnormalised, on its own scale)
        for axis, key, name in ((axes[2], 'mixed', 'Φa'), (axes[3], 'position', 'Φp')):
            for line in measured:
                values = line['nonlocality'][key]
                if None not in values:
                    axis.plot(range(1, len(values) + 1), values, color=colours[line['row']], marker='.',
                              label=line['model'])
            axis.set(xlabel='layer', ylabel=f'nonlocality Ω of {name} (Eq. 13)', title=f'{name}, mean over heads and seeds')
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = EXPERIMENTS[args.experiment]
    plan = [(name, seed) for name in planned_rows(args) for seed in args.seeds]
    runs, run_dirs = [], {}
    for index, (name, seed) in enumerate(plan, 1):
        row, run_dir = rows[name], work_dir / name / f'seed{seed}'
        run_dirs[name, seed] = run_dir
        print(f'[{index}/{len(plan)}] {row.label} ({row.config}), seed {seed}: log {run_dir / "train.log"}', flush=True)
        start = last_checkpoint(run_dirs[row.start_from, seed]) if row.start_from else None
        options = overrides(args, seed, start)
        run = finished_run(run_dir, options)
        if run is not None:
            print(f'    finished before with the same settings: reusing {run_dir / RUN_RECORD}')
        else:
            wall = train(row, options, run_dir)
            run = dict(row=name, seed=seed, options=options, params=count_parameters(row, options), wall_s=wall,
                       **read_run(run_dir))
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        if args.experiment in MEASURED_EXPERIMENTS and 'nonlocality' not in run:
            run['nonlocality'] = measure_nonlocality(row, options, run_dir)
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        runs.append(run)
        print(f'    top-1 {run["top1_per_epoch"][-1]:.1f}% after {len(run["top1_per_epoch"])} epochs, '
              f'{1e3 * run["step_time_s"]:.0f} ms/step, {run["wall_s"] / 60:.1f} min', flush=True)

    table = summarise(runs, rows)
    command = 'python tools/compare_phis.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    (work_dir / 'comparison.json').write_text(json.dumps(dict(command=command.strip(), runs=runs, table=table), indent=1))
    measures = nonlocality_markdown(table)
    text = markdown(table) + ('\n' + measures if measures else '')
    (work_dir / 'comparison.md').write_text(text)
    plot(runs, table, rows, work_dir / 'comparison.png')
    print('\n' + text)
    print(f'wrote {work_dir / "comparison.md"}, comparison.json and comparison.png')

if __name__ == '__main__':
    main()
