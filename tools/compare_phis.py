"""Φp compared with one budget per row: every row of a study (an mmengine config) trained with each seed,
optionally analysed or tested at other input sizes, then tables, figures and a timed training step per row.

    python tools/compare_phis.py                       # the table2 study: 5 rows x seed 0, 10 epochs each
    python tools/compare_phis.py --epochs 3 --seeds 0 1 --rows deit_t_none pervit_t
    python tools/compare_phis.py --experiment schemes  # DeiT-T with RoPE, tables, ALiBi, GPSA; ConViT-T
    python tools/compare_phis.py --experiment swap     # DeiT-T, then a fine-tune per swapped-in Φp
    python tools/compare_phis.py --experiment ablations --seeds 0 1 2   # PerViT's study, half width
    python tools/compare_phis.py --experiment resolution --seeds 0 1 2  # each Φp tested at 0.5-2x its size
    python tools/compare_phis.py --study my_study.py --seeds 0 1 2      # rows of your own
    python tools/compare_phis.py --configs a.py b.py --data my_data.py  # configs as rows, on your data

The built-in studies (``--experiment``) are the files of ``configs/studies/``. ``table2`` is PerViT
Table 2: the same ViT-Tiny with each Φp, and PerViT-T, from scratch. ``schemes`` puts the positional
schemes of later ViTs in the same ViT-Tiny, from scratch (RoPE-Mixed, a relative position bias table,
2D ALiBi, gated positional attention), beside plain DeiT-T and a ConViT-T-like model. ``swap`` trains
mmpretrain's own DeiT-T (``configs/swap/deit-t_shapes.py``), then fine-tunes that checkpoint with each
Φp swapped in by ``PosattnSwappedBackbone`` (``configs/swap/deit-t_finetune-*_shapes.py``).
``ablations`` is PerViT's component study (Table 1 rows (a), (b), (c)), Φp initialisations (Table 5,
top) and Φp designs (Table 5, bottom) with PerViT-T at half width; each run is analysed by
``tools/analyze.py``, and the nonlocality of Φp and Φa per layer (the paper's Fig. A8) joins its record.
``resolution`` is CPVT Table 3's last column: each Φp in DeiT-T at half width, with PerViT-T at half
width, trained at 64 x 64 and tested, without fine-tuning, at 0.5, 0.75, 1, 1.5 and 2 times that size
(``tools/test.py --img-size``: the same test scenes drawn at each size). ``relations`` is the harder
benchmark: PositionalRelations (which of three target shapes is leftmost and which topmost, among
distractors), every Φp of Table 2 and the schemes in DeiT-T at half width with PerViT-T at half width,
tested at other scales (``--img-size``) and extents (``tools/test.py --extent``: scenes of the training
scale on larger canvases, more tokens). ``relations_ablations`` runs the rows of ``ablations`` on
PositionalRelations; its row (a) is the PerViT-T row of ``relations``.

A study file is a Python file read by mmengine's ``Config.fromfile`` (so it may inherit another study
with ``_base_``)::

    rows = [
        dict(name='ape', config='study/deit-t-half_ape_shapes.py', label='APE'),
        dict(name='peg', config='my_peg.py', label='CPVT (PEG)'),
        dict(name='rope', config='your_data/deit_t_image_folder.py', label='RoPE', options=dict(phi='rope')),
        dict(name='ft', config='my_finetune.py', label='APE, fine-tuned', start_from='ape',
             checkpoint_keys=['load_from']),
    ]
    data = 'my_data.py'              # optional: every row's data, as --data
    analyse = True                   # optional (False): tools/analyze.py on each run, Ω per layer
    test_size_factors = (0.5, 1, 2)  # optional (none): test each run at these multiples of its test size
    test_extent_factors = (1, 2)     # optional (none), PositionalRelations: on canvases these multiples wide
    work_dir = 'work_dirs/my_study'  # optional (work_dirs/compare_phis/<study file name>)

A row's ``name`` names its folder in the work dir and what ``--rows`` picks; ``config`` is a path
relative to the study file, else to ``configs/``; ``label`` (default: the name) is what the tables and
figures call it; ``options`` are the ``--cfg-options`` of that row alone, as Python values (a dict, a
tuple or a string with spaces is kept as it is), on top of the command line's. A row with ``start_from``
starts from the last checkpoint of that row's run with the same seed, written into the config keys
``checkpoint_keys`` (default: the two ``init_cfg`` checkpoints of the swap configs,
``model.backbone.backbone`` and ``model.head``); the row it starts from is trained first. ``data`` is
relative to the study file, else to ``configs/``. Names that start with ``_`` are free for helper
variables; any other unknown setting is an error.

``--data FILE`` (or a study's ``data``) gives every row the data of a config that defines
``train_dataloader``, ``val_dataloader``, ``test_dataloader``, ``val_evaluator``, ``test_evaluator`` and
``num_classes``: those five replace the row's whole (nothing of the row's dataset is merged into
them), every other key the file sets is merged into the row's config, and ``num_classes`` goes to the
model's head and data preprocessor. The figures' title is the data config's ``dataset_name`` if it sets
one, else the training dataset's type and its root folder's name; their chance line is at
100 / the head's ``num_classes``.

Every row trains through ``tools/train.py`` (one process per run, its log under the work dir) from the
row's config with the data applied, written to ``<work dir>/<row>/config.py``, and each run's overrides
(``--cfg-options``, the row's ``options``, the seed, the budget) merged in as Python values, written to
``<work dir>/<row>/seed<N>/config.py``, which ``tools/train.py``, ``tools/test.py`` and
``tools/analyze.py`` read. Before the first run trains, every row's overrides are checked: a key that
nothing would read (a misspelt one, ``phii='rope'``) is an error naming it and the nearest key that is
read. ``--epochs`` sets every run's length alike (the configs' second scheduler ends with it); each seed
sets mmengine's ``randomness.seed`` (initialisation and shuffling; the data is the same).

After the runs, the tool times one training step of each row (forward, backward and optimizer step
of the model its config builds, with its optimizer, on random images in a batch of its
``train_dataloader.batch_size`` at the size its training pipeline gives) on the CPU with one thread:
rows take turns, 2 warm-up steps each, then the median of ``--timing-repeats`` steps. ``--no-timing``
skips it: the table then says "not measured" and the figure plots top-1 against parameters.

A run that finished before in the work dir with the same config and overrides (its ``run.json``) is
reused, not trained again, and a size it was tested at is not tested again: an interrupted study goes
on where it stopped. ``--report`` trains and tests nothing: it makes the tables, figures and step
timing of the runs that finished, each row over the seeds it has (for example five seeds for the rows
whose spread was large and three for the others: ``--seeds 0 1 2 3 4 --report``). A run's folder
that holds anything else (an interrupted run, or one of another config) is moved to ``<seed folder>.before-<time>`` and the run trained afresh. Delete a run's folder
to rerun it. Writes to the work dir: ``comparison.json`` (every run: validation top-1 per epoch,
parameters, wall time, top-1 per test size, and ``logged_step_time_s``, the median step time over
mmengine's logged windows of the run, which other jobs on the machine inflate; the table, the step
timing and the figures' labels), ``comparison.md`` (the tables: mean ± standard deviation over seeds
with their number, the range, and per seed the first epoch at 95% top-1; the rows ranked, by final
top-1 and at the largest test size of each test, each against the next with Welch's 95% t-interval
of the difference over seeds, "apart" where it excludes 0, else "the seed decides") and ``comparison.png``
(validation top-1 per epoch, and final top-1 against step time); a study with test sizes adds
``resolution.png`` (top-1 against test size, a band over seeds) and ``resolution.log``, one with
test extents ``extent.png`` and ``extent.log``.
"""
import argparse
import copy
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
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

from _common import REPO_ROOT, logged_scalars
from _step_timing import WARMUP_STEPS, batch_and_size, step_timing_note, time_training_steps
from _study import (STUDIES, Row, build_model, builtin_studies, config_file, load_data, load_study, planned_rows,
                    row_config, study_of_configs, with_options)
from mmengine.config import Config, DictAction

DEFAULT_STUDY = 'table2'
ANALYSED_IMAGES = 256
CONFIDENCE = 0.95  # of the intervals of the rankings' differences
TARGET_TOP1 = 95.0  # "epochs to reach": how fast each row learns, where most end near 100%
SKIPPED_LOGGED_WINDOWS = 1  # the first logged window of each run holds warm-up (allocation, first batches)
RUN_RECORD = 'run.json'  # per finished run: what read_run found and the wall time; lets a rerun reuse it
RUN_CONFIG = 'config.py'  # per row: its config, the data applied; per run: that with the run's overrides


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train each row of a study with one budget and compare them '
                                                 '(studies: see the docstring of tools/compare_phis.py)')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--experiment', choices=builtin_studies(),
                        help=f"a built-in study, a file of configs/studies/ (default: {DEFAULT_STUDY}). table2: "
                             "PerViT Table 2's rows from scratch; schemes: later ViTs' positional schemes in DeiT-T, "
                             "and ConViT-T; swap: DeiT-T, then a fine-tune per Φp; ablations: PerViT's components, "
                             "Φp initialisations and designs, half width; resolution: each Φp at half width, trained "
                             "at 64 px and tested at 0.5-2x that size; relations: each Φp on the harder set, "
                             "tested at other scales and extents; relations_ablations: the ablations on it")
    source.add_argument('--study', dest='study_file', metavar='FILE', help='a study file of your own')
    source.add_argument('--configs', nargs='+', metavar='CONFIG',
                        help='config files to compare, each a row named by its file name')
    parser.add_argument('--data', metavar='DATA_CONFIG',
                        help="a config defining train/val/test_dataloader, val/test_evaluator and num_classes, "
                             "given to every row in place of its own data (and the study's)")
    parser.add_argument('--rows', nargs='+', help="rows to train (default: all of the study's; a row that "
                                                  'starts from another trains that one too)')
    parser.add_argument('--seeds', nargs='+', type=int, default=[0], help='one run per row and seed')
    parser.add_argument('--epochs', type=int, help="epochs per run (default: the configs')")
    parser.add_argument('--work-dir', help="runs, tables and figures go here (default: the study's work_dir, "
                                           'else work_dirs/compare_phis/<study name>)')
    parser.add_argument('--report', action='store_true',
                        help='train and test nothing: tabulate the runs of these rows and seeds that finished in '
                             'the work dir, each row over the seeds it has (a row with none is left out)')
    parser.add_argument('--no-timing', action='store_true',
                        help='do not time a training step of each row after the runs')
    parser.add_argument('--timing-repeats', type=int, default=5,
                        help=f'timed training steps per row, after {WARMUP_STEPS} warm-up steps; '
                             'the table gives the median')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='further overrides, the same for every run, applied after --data '
                             '(e.g. train_dataloader.batch_size=32)')
    args = parser.parse_args(argv)
    try:
        if args.study_file:
            args.study = load_study(args.study_file)
        elif args.configs:
            args.study = study_of_configs(args.configs)
        else:
            args.study = load_study(STUDIES / f'{args.experiment or DEFAULT_STUDY}.py')
        if args.data:
            args.study = args.study._replace(data=config_file(args.data, Path.cwd()))
        if args.study.data:
            load_data(args.study.data)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    rows = args.study.rows
    unknown = sorted(set(args.rows or ()) - set(rows))
    if unknown:
        parser.error(f'no row {", ".join(unknown)} in the {args.study.name} study; its rows: {", ".join(rows)}')
    if args.epochs is not None and args.epochs < 2:
        parser.error(f'--epochs must be >= 2 (one warm-up epoch, then the cosine decay), got {args.epochs}')
    if args.timing_repeats < 1:
        parser.error(f'--timing-repeats must be >= 1 (or pass --no-timing), got {args.timing_repeats}')
    args.work_dir = args.work_dir or args.study.work_dir
    return args


def last_checkpoint(run_dir: Path) -> Path:
    """The checkpoint mmengine saved last in ``run_dir`` (its ``last_checkpoint`` file names it)."""
    record = run_dir / 'last_checkpoint'
    if not record.is_file():
        raise FileNotFoundError(f'{run_dir} holds no finished training (no last_checkpoint file)')
    path = Path(record.read_text().strip())
    return path if path.is_absolute() else REPO_ROOT / path


def overrides(args, seed: int, row: Row, starting_checkpoint: Optional[Path] = None) -> Dict[str, Any]:
    """The config overrides of one run, {dotted key: Python value}: the user's ``--cfg-options``, then
    the row's own ``options``, the seed, the budget and the checkpoint it starts from (if any, in the
    row's ``checkpoint_keys``)."""
    options = dict(args.cfg_options, **dict(row.options), **{'randomness.seed': seed})
    if args.epochs is not None:
        options.update({'train_cfg.max_epochs': args.epochs, 'param_scheduler.1.end': args.epochs})
    if starting_checkpoint is not None:
        options.update(dict.fromkeys(row.checkpoint_keys, str(starting_checkpoint)))
    return options


def recorded_options(options: Mapping[str, Any]) -> List[str]:
    """A run's overrides as its record names them, ``key=value`` each: what a rerun compares to reuse
    the run, and what its config digest reads. The runs themselves get the values
    (:func:`write_run_config`)."""
    return [f'{key}={value}' for key, value in options.items()]


def write_run_config(cfg: Config, options: Mapping[str, Any], run_dir: Path) -> Path:
    """Writes the config a run trains, ``cfg`` with its overrides merged as Python values (a dict, a
    tuple, a string with spaces keep their value, which ``--cfg-options`` text would not), to
    ``run_dir/config.py``, where mmengine's runner saves the config it trains; returns the file. The
    tools run on this file without ``--cfg-options``."""
    path = run_dir / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    with_options(cfg, options).dump(path)
    return path


def count_parameters(cfg: Config) -> int:
    return sum(p.numel() for p in build_model(cfg).parameters())


def train(row: Row, config: Path, work_dir: Path) -> float:
    """Runs tools/train.py on ``config`` (the run's: :func:`write_run_config`), echoing each validation
    line; returns the wall time in seconds."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO_ROOT / 'tools' / 'train.py'), str(config), '--work-dir', str(work_dir)]
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


def measure_nonlocality(row: Row, config: Path, run_dir: Path) -> dict:
    """Runs tools/analyze.py with the run's ``config`` on its last checkpoint (``ANALYSED_IMAGES``
    validation images, its figures under ``run_dir/analysis``); returns Ω of Φp and of Φa per layer,
    means over heads (Φp's None where a layer has no positional bias)."""
    out = run_dir / 'analysis'
    command = [sys.executable, str(REPO_ROOT / 'tools' / 'analyze.py'), str(config),
               str(last_checkpoint(run_dir)), '--out', str(out), '--num-images', str(ANALYSED_IMAGES)]
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


class SizeTest(NamedTuple):
    """A test of every run at other sizes, without fine-tuning: the study setting of its factors,
    tools/test.py's option, the run record's key and folder, its figure, and the words of its table's
    heading, its figure's x axis and its figure's title."""
    factors_key: str
    option: str
    record_key: str
    folder: str
    figure: str
    heading: str
    axis: str
    title: str


SIZE_TESTS = (
    SizeTest('test_size_factors', '--img-size', 'top1_at_size', 'resolution', 'resolution.png',
             'Top-1 (%) at each test size, without fine-tuning (scale: the same scenes drawn larger or smaller)',
             'test size, times the training size (no fine-tuning)', 'at other input sizes'),
    SizeTest('test_extent_factors', '--extent', 'top1_at_extent', 'extent', 'extent.png',
             'Top-1 (%) on larger canvases, without fine-tuning (extent: the training scale, more tokens)',
             'canvas side, times the training canvas (no fine-tuning)', 'on larger canvases'),
)


def test_sizes(cfg: Config, factors: Sequence[float], where: str) -> list:
    """The image sides a row is tested at: its config's test size times each of ``factors``, which
    must give whole pixels."""
    trained = _test_tool().config_test_size(cfg)
    if trained is None or trained[0] != trained[1]:
        raise ValueError(f'{where}: testing at other sizes needs a square test size in the config, got {trained}')
    sizes = [trained[0] * factor for factor in factors]
    if any(size != int(size) for size in sizes):
        raise ValueError(f'{where}: a test size of {trained[0]} pixels times {tuple(factors)} is not a '
                         f'whole number of pixels each time')
    return [int(size) for size in sizes]


def evaluate_at_sizes(config: Path, run_dir: Path, sizes: list, log, test: SizeTest = SIZE_TESTS[0]) -> dict:
    """Top-1 of the run's last checkpoint at each of ``sizes`` (``test_sizes``), without fine-tuning:
    tools/test.py on the run's ``config`` with ``test.option`` (``--img-size``, ``--extent``) in this
    process, its output to ``log``. Returns {side in pixels (str): top-1}; a size measured before (its
    JSON under ``run_dir/<test.folder>``) is read, not measured again."""
    tool, out_dir = _test_tool(), run_dir / test.folder
    top1 = {}
    for size in sizes:
        out = out_dir / f'top1_at_{size}.json'
        if not out.is_file():
            argv = [str(config), str(last_checkpoint(run_dir)), test.option, str(size),
                    '--work-dir', str(out_dir), '--out', str(out)]
            with redirect_stdout(log), redirect_stderr(log):
                tool.main(argv)
        top1[str(size)] = json.loads(out.read_text())['accuracy/top1']
    return top1


def read_run(work_dir: Path) -> dict:
    """Validation top-1 per epoch and the median step time over the logged windows (None: too few
    logged), from the run's mmengine scalars (every log folder in time order: a run that was resumed
    has one per start)."""
    rows = logged_scalars(work_dir)
    if not rows:
        raise FileNotFoundError(f'no mmengine scalars under {work_dir}')
    accuracy = [row['accuracy/top1'] for row in rows if 'accuracy/top1' in row]
    if not accuracy:
        raise ValueError(f'the scalars logged under {work_dir} hold no validation top-1 (accuracy/top1): '
                         'the runs need a val_dataloader and an Accuracy val_evaluator')
    step_times = [row['time'] for row in rows if 'loss' in row][SKIPPED_LOGGED_WINDOWS:]
    return dict(top1_per_epoch=accuracy, logged_step_time_s=statistics.median(step_times) if step_times else None)


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


def config_digest(cfg: Config, options: list) -> str:
    """A fingerprint of the config a run trains, its overrides (:func:`recorded_options`) applied: a
    run recorded with another one (the config file, a base it inherits or the data was edited since)
    is trained again."""
    cfg = copy.deepcopy(cfg)
    cfg.merge_from_dict(dict(option.split('=', 1) for option in options))  # as written: a fingerprint only
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def pending_tests(run: dict, study, cfg: Config, row: Row) -> list:
    """The study's tests at other sizes that ``run`` has no record of at the sizes they now give:
    (test, sizes) each, in the order of ``SIZE_TESTS``."""
    pending = []
    for test in SIZE_TESTS:
        factors = getattr(study, test.factors_key)
        sizes = test_sizes(cfg, factors, row.config) if factors else []
        if sizes and list(run.get(test.record_key, ())) != list(map(str, sizes)):
            pending.append((test, sizes))
    return pending


def finished_run(work_dir: Path, options: list, digest: str):
    """The record of a run that finished in ``work_dir`` with these overrides (:func:`recorded_options`)
    and this config (its ``config_digest``), else None."""
    path = work_dir / RUN_RECORD
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    if 'step_time_s' in run:  # the logged windows' median, under the name older records give it
        run['logged_step_time_s'] = run.pop('step_time_s')
    return run if run.get('options') == options and run.get('config_digest') == digest else None


def dataset_name(cfg: Config) -> str:
    """The name the figures give the config's data: its ``dataset_name``, else the training dataset's
    type (inside any dataset wrappers) and the name of its root folder (data_root, else data_prefix)."""
    if cfg.get('dataset_name'):
        return cfg.dataset_name
    dataset = cfg.train_dataloader.dataset
    while 'dataset' in dataset:  # RepeatDataset, ClassBalancedDataset, ...
        dataset = dataset.dataset
    kind = getattr(dataset.type, '__name__', dataset.type)
    root = dataset.get('data_root') or dataset.get('data_prefix') or ''
    if isinstance(root, dict):
        root = root.get('img_path', '')
    folder = Path(root).name
    return f'{kind} ({folder})' if folder else kind


def figure_labels(configs: Dict[str, Config], timing: Optional[dict]) -> dict:
    """What the figures say about the data and the timing, read from the rows' configs: the data's name,
    the chance top-1 (100 / the head's classes) and the step-time axis (None: not timed)."""
    names = dict.fromkeys(dataset_name(cfg) for cfg in configs.values())
    classes = dict.fromkeys(cfg.model.head.num_classes for cfg in configs.values())
    axis = None if timing is None else f'training step time (ms; {"; ".join(batch_and_size(timing))}; CPU, 1 thread)'
    return dict(dataset=' / '.join(names), chance_top1=[100 / count for count in classes], step_time_axis=axis)


def summarise(runs: list, rows: Dict[str, Row], timing: Optional[dict] = None) -> list:
    """One line per row: means (and spread) over its seeds, and its measured step time (None: not timed)."""
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
            nonlocality=_mean_nonlocality(mine), params_m=mine[0]['params'] / 1e6,
            step_time_ms=None if timing is None else 1e3 * timing[row]['step_time_s'],
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
        step_time = 'not measured' if line['step_time_ms'] is None else f'{line["step_time_ms"]:.0f}'
        lines.append(f'| {line["model"]} | `{line["config"]}` | {line["params_m"]:.2f} | {line["epochs"]} '
                     f'| {mean_std(finals)} | {spread} | {line["best_top1"]:.1f} | {reached} '
                     f'| {step_time} | {line["wall_min"]:.1f} |')
    return '\n'.join(lines) + '\n'


def resolution_markdown(table: list, runs: list, factors: Sequence[float], test: SizeTest = SIZE_TESTS[0]) -> str:
    """Top-1 per row at each test size, mean ± std over seeds."""
    sizes = list(runs[0][test.record_key])
    lines = ['| model | ' + ' | '.join(f'{factor:g}x: {size} px' for factor, size in zip(factors, sizes))
             + ' |', '|---|' + '---|' * len(sizes)]
    for line in table:
        mine = [run for run in runs if run['row'] == line['row']]
        lines.append(f'| {line["model"]} | ' + ' | '.join(mean_std([run[test.record_key][size] for run in mine])
                                                          for size in sizes) + ' |')
    return '\n'.join(lines) + '\n'


def difference_interval(above: Sequence[float], below: Sequence[float],
                        confidence: float = CONFIDENCE) -> Optional[tuple]:
    """Mean of ``above`` minus mean of ``below`` (per-seed values of two rows) and Welch's t-interval
    for it at ``confidence``: (difference, low, high); None where a row has one seed. Two rows
    without any spread get the difference as both ends."""
    if len(above) < 2 or len(below) < 2:
        return None
    difference = statistics.fmean(above) - statistics.fmean(below)
    if statistics.stdev(above) == 0 and statistics.stdev(below) == 0:
        return difference, difference, difference
    from scipy.stats import ttest_ind
    low, high = ttest_ind(above, below, equal_var=False).confidence_interval(confidence)
    return difference, float(low), float(high)


def ranking_markdown(table: list, runs: list, column: Optional[tuple] = None) -> str:
    """The rows ranked by mean top-1, each against the next: the difference of the means with its
    Welch t-interval over seeds, and whether it tells them apart (the interval excludes 0) or the seed
    decides. ``column``: (record key, size) for a test column, else the final validation top-1."""
    def values(row):
        mine = [run for run in runs if run['row'] == row]
        if column is None:
            return [run['top1_per_epoch'][-1] for run in mine]
        return [run[column[0]][column[1]] for run in mine]
    ranked = sorted(((line['model'], values(line['row'])) for line in table),
                    key=lambda item: statistics.fmean(item[1]), reverse=True)
    lines = [f'| rank | model | top-1 (%) | minus the next, {CONFIDENCE:.0%} interval (points) | |',
             '|---|---|---|---|---|']
    for rank, ((model, mine), below) in enumerate(zip(ranked, ranked[1:] + [None]), 1):
        interval = None if below is None else difference_interval(mine, below[1])
        if below is None:
            cells = '|'
        elif interval is None:
            cells = '- | one seed'
        else:
            difference, low, high = interval
            verdict = 'apart' if low > 0 or high < 0 else 'the seed decides'
            cells = f'{difference:+.1f} [{low:+.1f}, {high:+.1f}] | {verdict}'
        lines.append(f'| {rank} | {model} | {mean_std(mine)} | {cells} |')
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


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def comparison_figure(runs: list, table: list, rows: Dict[str, Row], labels: dict):
    """Validation top-1 per epoch (one curve per run, the chance line of ``labels``), final top-1
    against the measured step time (against parameters where not timed) and, for analysed rows,
    Ω per layer; ``labels`` are ``figure_labels``'s."""
    plt = _pyplot()
    measured = [line for line in table if line['nonlocality']]
    if measured:
        fig, axes = plt.subplots(2, 2, figsize=(10, 7.6))
        axes = axes.flatten()
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    curves, scatter = axes[:2]
    colours = dict(zip(rows, row_colours(len(rows))))
    labelled = set()
    for run in runs:  # one curve per run, one legend entry per row
        epochs = range(1, len(run['top1_per_epoch']) + 1)
        label = None if run['row'] in labelled else rows[run['row']].label
        labelled.add(run['row'])
        curves.plot(epochs, run['top1_per_epoch'], color=colours[run['row']], marker='.', label=label)
    for chance in labels['chance_top1']:
        curves.axhline(chance, color='grey', linestyle=':', linewidth=1, label=f'chance ({chance:.3g}%)')
    curves.set(xlabel='epoch', ylabel='validation top-1 (%)', title=labels['dataset'])
    curves.legend(fontsize=7)
    timed = labels['step_time_axis'] is not None
    for index, line in enumerate(table):  # labels alternately above and below, so neighbours do not overlap
        x = line['step_time_ms'] if timed else line['params_m']
        scatter.scatter(x, line['top1'], color=colours[line['row']], s=40)
        scatter.annotate(f'{line["model"]}\n{line["params_m"]:.1f} M', (x, line['top1']),
                         fontsize=7, xytext=(4, 4 if index % 2 == 0 else -20), textcoords='offset points')
    scatter.set(xlabel=labels['step_time_axis'] if timed else 'parameters (M)', ylabel='final validation top-1 (%)',
                title='accuracy vs. cost' if timed else 'accuracy vs. size (step time not measured)')
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
    return fig


def row_colours(count: int) -> list:
    """A distinct colour per row: matplotlib's default cycle for up to ten rows, its tab20 up to twenty,
    else colours spread over its turbo map."""
    import matplotlib
    if count <= 10:
        return [f'C{index}' for index in range(count)]
    if count <= 20:
        return list(matplotlib.colormaps['tab20'].colors[:count])
    return [matplotlib.colormaps['turbo'](index / (count - 1)) for index in range(count)]


def resolution_figure(table: list, runs: list, factors: Sequence[float], labels: dict,
                      test: SizeTest = SIZE_TESTS[0]):
    """Top-1 against the test size (times the training size) per row: the mean over seeds as a line,
    the seeds' lowest to highest as a band."""
    plt = _pyplot()
    from posattn.analysis.figures import FIGURE_STYLE

    sizes = list(runs[0][test.record_key])
    with plt.rc_context(FIGURE_STYLE):
        fig, axis = plt.subplots(figsize=(11, 5.2))
        for line, colour in zip(table, row_colours(len(table))):
            per_seed = [[run[test.record_key][size] for size in sizes] for run in runs if run['row'] == line['row']]
            by_size = list(zip(*per_seed))
            axis.plot(factors, [statistics.fmean(values) for values in by_size], color=colour, marker='o',
                      label=f'{line["model"]} ({len(per_seed)} seeds)')
            axis.fill_between(factors, [min(values) for values in by_size],
                              [max(values) for values in by_size], color=colour, alpha=0.15, linewidth=0)
        axis.axvline(1.0, color='grey', linewidth=1, linestyle=':')
        for chance in labels['chance_top1']:
            axis.axhline(chance, color='grey', linewidth=1, linestyle=':', label=f'chance ({chance:.3g}%)')
        axis.set_xticks(factors, [f'{factor:g}x\n{size} px' for factor, size in zip(factors, sizes)])
        axis.set(xlabel=test.axis, ylabel='validation top-1 (%)',
                 title=f'{labels["dataset"]} {test.title}: mean over seeds, band from lowest to highest')
        axis.legend(fontsize=9, loc='upper left', bbox_to_anchor=(1.01, 1))  # beside the axes, clear of the lines
        fig.tight_layout()
    return fig


def save_figure(fig, path: Path, dpi: int) -> None:
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def main(argv=None):
    args = parse_args(argv)
    study, work_dir = args.study, Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    rows, data = study.rows, load_data(study.data) if study.data else None
    planned = planned_rows(study, args.rows)
    configs, run_configs = {}, {}  # per row: its config, and its first run's (its overrides applied)
    for name in planned:
        configs[name] = row_config(rows[name], data)
        (work_dir / name).mkdir(parents=True, exist_ok=True)
        configs[name].dump(work_dir / name / RUN_CONFIG)
        try:  # every row's overrides, checked before the first run trains (the seed's value aside, alike per seed)
            with_options(configs[name], overrides(args, args.seeds[0], rows[name]))
        except ValueError as error:
            raise SystemExit(f'row {name} ({rows[name].config}): {error}') from None
    plan = [(name, seed) for name in planned for seed in args.seeds]
    runs, run_dirs = [], {}
    for index, (name, seed) in enumerate(plan, 1):
        row, run_dir = rows[name], work_dir / name / f'seed{seed}'
        run_config = run_dir / RUN_CONFIG  # the config the run trains, which mmengine's runner saves there too
        run_dirs[name, seed] = run_dir
        print(f'[{index}/{len(plan)}] {row.label} ({row.config}), seed {seed}: log {run_dir / "train.log"}', flush=True)
        start = last_checkpoint(run_dirs[row.start_from, seed]) if row.start_from else None
        options = overrides(args, seed, row, start)
        if name not in run_configs:  # the first seed's: what the tests at other sizes and the step timing read
            run_configs[name] = with_options(configs[name], options)
        digest = config_digest(configs[name], recorded_options(options))
        run = finished_run(run_dir, recorded_options(options), digest)
        if run is not None:
            run['row'] = name  # a run of the same config and options recorded under another study's row name
        if args.report:
            pending = [] if run is None else pending_tests(run, study, run_configs[name], row)
            if run is None or pending:
                missing = ('no run with this config finished there' if run is None else
                           f'not tested with {pending[0][0].option} at {", ".join(map(str, pending[0][1]))} px')
                print(f'    {missing}: left out of the tables', flush=True)
            else:
                runs.append(run)
            continue
        if run is not None:
            print(f'    finished before with the same config and settings: reusing {run_dir / RUN_RECORD}')
        else:
            set_aside(run_dir)
            wall = train(row, write_run_config(configs[name], options, run_dir), run_dir)
            run = dict(row=name, seed=seed, options=recorded_options(options), config_digest=digest,
                       params=count_parameters(with_options(configs[name], options)), wall_s=wall, **read_run(run_dir))
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        if not run_config.is_file():  # a reused run whose folder lost it
            write_run_config(configs[name], options, run_dir)
        if study.analyse and 'nonlocality' not in run:
            run['nonlocality'] = measure_nonlocality(row, run_config, run_dir)
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
        for test, sizes in pending_tests(run, study, run_configs[name], row):
            with open(work_dir / f'{test.folder}.log', 'a') as log:
                run[test.record_key] = evaluate_at_sizes(run_config, run_dir, sizes, log, test)
            (run_dir / RUN_RECORD).write_text(json.dumps(run, indent=1))
            print(f'    top-1 ({test.option}) at ' + ', '.join(f'{size} px {top1:.1f}%'
                                                           for size, top1 in run[test.record_key].items()),
                  flush=True)
        runs.append(run)
        print(f'    top-1 {run["top1_per_epoch"][-1]:.1f}% after {len(run["top1_per_epoch"])} epochs, '
              f'{run["wall_s"] / 60:.1f} min', flush=True)

    if not runs:
        raise SystemExit(f'no run of the rows {", ".join(planned)} with seeds {args.seeds} finished in {work_dir}')
    run_configs = {name: config for name, config in run_configs.items() if any(run['row'] == name for run in runs)}
    timing = None
    if not args.no_timing:
        print(f'timing a training step of each row (CPU, 1 thread, {WARMUP_STEPS} warm-up and '
              f'{args.timing_repeats} timed steps each, the rows in turn)', flush=True)
        timing = time_training_steps(run_configs, args.timing_repeats)
    table = summarise(runs, rows, timing)
    labels = figure_labels(run_configs, timing)
    note = step_timing_note(timing, args.timing_repeats)
    command = 'python tools/compare_phis.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    record = dict(command=command.strip(), study=study.name, data=None if study.data is None else str(study.data),
                  runs=runs, table=table, step_timing=dict(note=note, rows=timing), figure=labels)
    (work_dir / 'comparison.json').write_text(json.dumps(record, indent=1))
    measures = nonlocality_markdown(table)
    text = markdown(table, runs) + '\n' + note + '\n' + ('\n' + measures if measures else '')
    text += '\nRanking by final validation top-1:\n\n' + ranking_markdown(table, runs)
    from posattn.analysis.figures import DEFAULT_DPI
    figures = []
    for test in SIZE_TESTS:
        factors = getattr(study, test.factors_key)
        if factors:
            text += f'\n{test.heading}:\n\n' + resolution_markdown(table, runs, factors, test)
            largest = max(runs[0][test.record_key], key=int)
            text += (f'\nRanking at {largest} px ({test.option}):\n\n'
                     + ranking_markdown(table, runs, (test.record_key, largest)))
            save_figure(resolution_figure(table, runs, factors, labels, test), work_dir / test.figure, DEFAULT_DPI)
            figures.append(test.figure)
    (work_dir / 'comparison.md').write_text(text)
    save_figure(comparison_figure(runs, table, rows, labels), work_dir / 'comparison.png', 90)
    print('\n' + text)
    print(f'wrote {work_dir / "comparison.md"}, comparison.json and comparison.png'
          + ''.join(f' and {figure}' for figure in figures))


if __name__ == '__main__':
    main()
