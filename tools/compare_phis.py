"""Φp compared on the embedded set, one budget per row, in five experiments:

    python tools/compare_phis.py                       # table2: 5 rows x seed 0, 10 epochs each
    python tools/compare_phis.py --epochs 3 --seeds 0 1 --rows deit_t_none pervit_t
    python tools/compare_phis.py --experiment schemes  # DeiT-T with RoPE, tables, ALiBi, GPSA; ConViT-T
    python tools/compare_phis.py --experiment swap     # DeiT-T, then a fine-tune per swapped-in Φp
    python tools/compare_phis.py --experiment ablations --seeds 0 1 2   # PerViT's study, half width
    python tools/compare_phis.py --experiment resolution --seeds 0 1 2  # each Φp tested at 0.5-2x its size

``table2`` is PerViT Table 2: the same ViT-Tiny with each Φp, and PerViT-T, from scratch.
``schemes`` puts the positional schemes of later ViTs in the same ViT-Tiny, from scratch (RoPE-Mixed,
a relative position bias table, 2D ALiBi, gated positional attention), beside plain DeiT-T and a
ConViT-T-like model. ``swap``
trains mmpretrain's own DeiT-T (``configs/swap/deit-t_shapes.py``), then fine-tunes that checkpoint
with each Φp swapped in by ``PosattnSwappedBackbone`` (``configs/swap/deit-t_finetune-*_shapes.py``).
``ablations`` is PerViT's component study (Table 1 rows (a), (b), (c)), Φp initialisations
(Table 5, top: peripheral is row (a), conv, rand) and Φp designs (Table 5, bottom: a Euclidean or a
learned embedding of the offsets, with or without the neighbourhood term N and several layers ML;
row (a) is Euc + N + ML) with PerViT-T at half width
(``configs/ablations/shapes/``); after each run ``tools/analyze.py`` measures its attention, and
the nonlocality of Φp and Φa per layer (the paper's Fig. A8) joins the run's record.
``resolution`` is CPVT Table 3's last column: each Φp in DeiT-T at half width, with PerViT-T at half
width (``configs/study/``), trained at 64 x 64 and tested, without fine-tuning, at 0.5, 0.75, 1, 1.5
and 2 times that size (``tools/test.py --img-size``: the same test scenes drawn at each size).

Every row is a config trained by ``tools/train.py`` (one process per run, its log under the work
dir) with the data and recipe of ``configs/_base_/shapes.py``: within an experiment's stage only
the model differs (the half-width models of ``configs/study/`` train at a learning rate of 1e-3).
``--epochs`` sets every run's length alike (the cosine schedule ends with it); each seed sets
mmengine's ``randomness.seed`` (initialisation and shuffling; the data is the same). A row that
starts from another (the fine-tunes) takes the last checkpoint of that row's run with the same seed.

A run that finished before in the work dir with the same config and overrides (its ``run.json``)
is reused, not trained again, and a size it was tested at is not tested again: an interrupted study
goes on where it stopped. A run's folder that holds anything else (an interrupted run, or one of
another config) is moved to ``<seed folder>.before-<time>`` and the run trained afresh. Delete a
run's folder to rerun it. Writes to the work dir:
``comparison.json`` (every run: validation top-1 per epoch, parameters, median training step
time over mmengine's logged windows, wall time, top-1 per test size), ``comparison.md`` (the
tables: mean ± standard deviation over seeds with their number, the range, and per seed the first
epoch at 95% top-1) and ``comparison.png`` (validation top-1 per epoch, and final top-1 against step
time); the resolution experiment adds ``resolution.png`` (top-1 against test size, a band over
seeds) and ``resolution.log`` (tools/test.py's output).
"""
import argparse
import functools
import hashlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
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
EXPERIMENTS['ablations'] = {  # PerViT Table 1 (a)-(c) and Table 5 (Φp inits, Φp designs), PerViT-T at half width
    'a': Row(ABLATION_CONFIGS.format('components-a'), '(a) PerViT-T, peripheral init'),
    'b': Row(ABLATION_CONFIGS.format('components-b'), '(b) without Φp'),
    'c': Row(ABLATION_CONFIGS.format('components-c'), '(c) without Φc'),
    'init_conv': Row(ABLATION_CONFIGS.format('init-conv'), '(a), conv init'),
    'init_rand': Row(ABLATION_CONFIGS.format('init-rand'), '(a), rand init'),
    'design_euc_ml': Row(ABLATION_CONFIGS.format('design-euc-ml'), '(a), Φp Euc + ML'),
    'design_euc': Row(ABLATION_CONFIGS.format('design-euc'), '(a), Φp Euc'),
    'design_lrn_n_ml': Row(ABLATION_CONFIGS.format('design-lrn-n-ml'), '(a), Φp Lrn + N + ML'),
    'design_lrn_ml': Row(ABLATION_CONFIGS.format('design-lrn-ml'), '(a), Φp Lrn + ML'),
    'design_lrn': Row(ABLATION_CONFIGS.format('design-lrn'), '(a), Φp Lrn'),
}
STUDY_CONFIGS = 'study/deit-t-half_{}_shapes.py'
EXPERIMENTS['resolution'] = {  # CPVT Table 3's last column: trained at 64 x 64, tested at other sizes as they are
    'none': Row(STUDY_CONFIGS.format('none'), 'no position (plain attention, no embedding)'),
    'ape': Row(STUDY_CONFIGS.format('ape'), 'APE (learned absolute embedding)'),
    'peg': Row(STUDY_CONFIGS.format('peg'), 'CPVT (PEG), no APE'),
    'irpe': Row(STUDY_CONFIGS.format('irpe'), 'iRPE-K + APE'),
    'peripheral': Row(STUDY_CONFIGS.format('peripheral'), 'PPE (peripheral) + APE'),
    'pervit_t': Row('study/pervit-t-half_shapes.py', 'PerViT-T (conv stem, CPE, peripheral)'),
    'rope': Row(STUDY_CONFIGS.format('rope'), 'RoPE-Mixed, no APE'),
    'rpb': Row(STUDY_CONFIGS.format('rpb'), 'bias table (rpb), no APE'),
    'alibi': Row(STUDY_CONFIGS.format('alibi'), '2D ALiBi, no APE'),
    'gpsa': Row(STUDY_CONFIGS.format('gpsa'), 'GPSA + APE'),
}
TEST_GRID_FACTORS = (0.5, 0.75, 1.0, 1.5, 2.0)  # test sizes of the resolution experiment, times the training size
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
                             "ablations: PerViT's components, Φp initialisations and designs, half width; resolution: each Φp "
                             "at half width, trained at 64 px and tested at 0.5-2x that size")
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


def parsed_options(options: list) -> dict:
    """``key=value`` overrides as tools/train.py's ``--cfg-options`` reads them (numbers, lists, tuples)."""
    return {key: DictAction._parse_iterable(value) for key, value in (option.split('=', 1) for option in options)}


def row_config(row: Row, options: list) -> Config:
    """The row's config with the run's ``--cfg-options`` applied, as tools/train.py reads them."""
    cfg = Config.fromfile(config_path(row.config))
    cfg.merge_from_dict(parsed_options(options))
    return cfg


def count_parameters(row: Row, options: list) -> int:
    from mmpretrain.registry import MODELS
    cfg = row_config(row, options)
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


@functools.lru_cache(maxsize=None)
def _test_tool():
    """tools/test.py as a module, loaded once (loaded by path: ``test`` is also a package of the standard library)."""
    spec = importlib.util.spec_from_file_location('posattn_test_tool', REPO_ROOT / 'tools' / 'test.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sizes(row: Row, options: list) -> list:
    """The image sides the resolution experiment tests a row at: its config's test size times each of
    ``TEST_GRID_FACTORS``, which must give whole pixels."""
    trained = _test_tool().config_test_size(row_config(row, options))
    if trained is None or trained[0] != trained[1]:
        raise ValueError(f'{row.config}: the resolution experiment needs a square test size in the config, got '
                         f'{trained}')
    sizes = [trained[0] * factor for factor in TEST_GRID_FACTORS]
    if any(size != int(size) for size in sizes):
        raise ValueError(f'{row.config}: a test size of {trained[0]} pixels times {TEST_GRID_FACTORS} is not a '
                         f'whole number of pixels each time')
    return [int(size) for size in sizes]


def evaluate_at_sizes(row: Row, options: list, run_dir: Path, sizes: list, log) -> dict:
    """Top-1 of the run's last checkpoint at each of ``sizes`` (``test_sizes``), without fine-tuning:
    tools/test.py ``--img-size`` in this process, its output to ``log``. Returns {side in pixels
    (str): top-1}; a size measured before (its JSON under ``run_dir/resolution``) is read, not
    measured again."""
    tool, out_dir = _test_tool(), run_dir / 'resolution'
    top1 = {}
    for size in sizes:
        out = out_dir / f'top1_at_{size}.json'
        if not out.is_file():
            argv = [str(config_path(row.config)), str(last_checkpoint(run_dir)), '--img-size', str(size),
                    '--work-dir', str(out_dir), '--out', str(out), '--cfg-options', *options]
            with redirect_stdout(log), redirect_stderr(log):
                tool.main(argv)
        top1[str(size)] = json.loads(out.read_text())['accuracy/top1']
    return top1


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


def set_aside(run_dir: Path) -> Optional[Path]:
    """Moves what ``run_dir`` holds from an earlier, unfinished or differently configured run to
    ``<run_dir>.before-<time>``, so that the new run's logs are read alone and nothing is deleted.
    Returns where it went (None: nothing there). A folder in which a training is still running is
    left as it is: the work_dir lock's error names that training."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    from posattn_openmmlab.work_dir_lock import WorkDirLock
    with WorkDirLock(str(run_dir)):  # a training still running there: WorkDirInUseError, nothing moved
        pass
    aside = run_dir.with_name(f'{run_dir.name}.before-{time.strftime("%Y%m%d-%H%M%S")}')
    run_dir.rename(aside)
    print(f'    {run_dir} held an unfinished or differently configured run: moved to {aside}', flush=True)
    return aside


def config_digest(row: Row, options: list) -> str:
    """A fingerprint of the config the run trains, ``--cfg-options`` applied: a run recorded with
    another one (the config file or a base it inherits was edited since) is trained again."""
    cfg = Config.fromfile(config_path(row.config))
    cfg.merge_from_dict(dict(option.split('=', 1) for option in options))  # as written: a fingerprint only
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished_run(work_dir: Path, options: list, digest: str):
    """The record of a run that finished in ``work_dir`` with these ``--cfg-options`` and this
    config (its ``config_digest``), else None."""
    path = work_dir / RUN_RECORD
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run if run.get('options') == options and run.get('config_digest') == digest else None


def summarise(runs: list, rows: dict) -> list:
    """One line per row: means (and spread) over its seeds."""
    table = []
    for row in dict.fromkeys(run['row'] for run in runs):
        mine = [run for run in runs if run['row'] == row]
        finals = [run['top1_per_epoch'][-1] for run in mine]
        table.append(dict(
            row=row, model=rows[row].label, config=rows[row].config, seeds=[run['seed'] for run in mine],
            top1=statistics.fmean(finals), top1_std=statistics.stdev(finals) if len(finals) > 1 else None,
            top1_spread=(max(finals) - min(finals)) if len(finals) > 1 else None,
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


def mean_std(values: list) -> str:
    """'mean ± standard deviation (n seeds)' of per-seed values; the sample deviation (n - 1)."""
    if len(values) == 1:
        return f'{values[0]:.1f} (1 seed)'
    return f'{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f} ({len(values)} seeds)'


def markdown(table: list, runs: list) -> str:
    lines = ['| model | config | params (M) | epochs | final val top-1 (%), mean ± std | range over seeds '
             f'| best epoch top-1 (%) | epochs to {TARGET_TOP1:g}% | step time (ms) | run time (min) |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for line in table:
        finals = [run['top1_per_epoch'][-1] for run in runs if run['row'] == line['row']]
        spread = '-' if line['top1_spread'] is None else f'{line["top1_spread"]:.1f}'
        reached = ', '.join('-' if epoch is None else str(epoch) for epoch in line['epochs_to_target'])
        lines.append(f'| {line["model"]} | `{line["config"]}` | {line["params_m"]:.2f} | {line["epochs"]} '
                     f'| {mean_std(finals)} | {spread} | {line["best_top1"]:.1f} | {reached} '
                     f'| {line["step_time_ms"]:.0f} | {line["wall_min"]:.1f} |')
    return '\n'.join(lines) + '\n'


def resolution_markdown(table: list, runs: list) -> str:
    """Top-1 per row at each test size, mean ± std over seeds (the resolution experiment)."""
    sizes = list(runs[0]['top1_at_size'])
    lines = ['| model | ' + ' | '.join(f'{factor:g}x: {size} px' for factor, size in zip(TEST_GRID_FACTORS, sizes))
             + ' |', '|---|' + '---|' * len(sizes)]
    for line in table:
        mine = [run for run in runs if run['row'] == line['row']]
        lines.append(f'| {line["model"]} | ' + ' | '.join(mean_std([run['top1_at_size'][size] for run in mine])
                                                          for size in sizes) + ' |')
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


def plot_resolution(table: list, runs: list, path: Path) -> None:
    """Top-1 against the test size (times the training size) per row: the mean over seeds as a line,
    the seeds' lowest to highest as a band."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from posattn.analysis.figures import DEFAULT_DPI, FIGURE_STYLE

    sizes = list(runs[0]['top1_at_size'])
    with plt.rc_context(FIGURE_STYLE):
        fig, axis = plt.subplots(figsize=(11, 5.2))
        for index, line in enumerate(table):
            per_seed = [[run['top1_at_size'][size] for size in sizes] for run in runs if run['row'] == line['row']]
            by_size = list(zip(*per_seed))
            colour = f'C{index % 10}'  # ten rows at most: one colour each
            axis.plot(TEST_GRID_FACTORS, [statistics.fmean(values) for values in by_size], color=colour, marker='o',
                      label=f'{line["model"]} ({len(per_seed)} seeds)')
            axis.fill_between(TEST_GRID_FACTORS, [min(values) for values in by_size],
                              [max(values) for values in by_size], color=colour, alpha=0.15, linewidth=0)
        axis.axvline(1.0, color='grey', linewidth=1, linestyle=':')
        axis.axhline(100 / 6, color='grey', linewidth=1, linestyle=':', label='chance')
        axis.set_xticks(TEST_GRID_FACTORS, [f'{factor:g}x\n{size} px' for factor, size in zip(TEST_GRID_FACTORS, sizes)])
        axis.set(xlabel='test size, times the training size (no fine-tuning)', ylabel='validation top-1 (%)',
                 title='PositionalShapes at other input sizes: mean over seeds, band from lowest to highest')
        axis.legend(fontsize=9, loc='upper left', bbox_to_anchor=(1.01, 1))  # beside the axes, clear of the lines
        fig.tight_layout()
        fig.savefig(path, dpi=DEFAULT_DPI)
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
        digest = config_digest(row, options)
        run = finished_run(run_dir, options, digest)
        if run is not None:
            print(f'    finished before with the same config and settings: reusing {run_dir / RUN_RECORD}')
        else:
            set_aside(run_dir)
            wall = train(row, options, run_dir)
            run = dict(row=name, seed=seed, options=options, config_digest=digest,
                       params=count_parameters(row, options), wall_s=wall, **read_run(run_dir))
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        if args.experiment in MEASURED_EXPERIMENTS and 'nonlocality' not in run:
            run['nonlocality'] = measure_nonlocality(row, options, run_dir)
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        sizes = test_sizes(row, options) if args.experiment == 'resolution' else []
        if sizes and list(run.get('top1_at_size', ())) != list(map(str, sizes)):
            with open(work_dir / 'resolution.log', 'a') as log:
                run['top1_at_size'] = evaluate_at_sizes(row, options, run_dir, sizes, log)
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
            print('    top-1 at ' + ', '.join(f'{size} px {top1:.1f}%' for size, top1 in run['top1_at_size'].items()),
                  flush=True)
        runs.append(run)
        print(f'    top-1 {run["top1_per_epoch"][-1]:.1f}% after {len(run["top1_per_epoch"])} epochs, '
              f'{1e3 * run["step_time_s"]:.0f} ms/step, {run["wall_s"] / 60:.1f} min', flush=True)

    table = summarise(runs, rows)
    command = 'python tools/compare_phis.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    (work_dir / 'comparison.json').write_text(json.dumps(dict(command=command.strip(), runs=runs, table=table), indent=1))
    measures = nonlocality_markdown(table)
    text = markdown(table, runs) + ('\n' + measures if measures else '')
    if args.experiment == 'resolution':
        text += '\nTop-1 (%) at each test size, without fine-tuning:\n\n' + resolution_markdown(table, runs)
        plot_resolution(table, runs, work_dir / 'resolution.png')
    (work_dir / 'comparison.md').write_text(text)
    plot(runs, table, rows, work_dir / 'comparison.png')
    print('\n' + text)
    print(f'wrote {work_dir / "comparison.md"}, comparison.json and comparison.png'
          + (' and resolution.png' if args.experiment == 'resolution' else ''))

if __name__ == '__main__':
    main()
