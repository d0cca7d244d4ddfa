"""Φp compared with one budget per row: every row of a study trained with each seed, optionally analysed
or tested at other input sizes, then tables, figures and a timed training step per row.

    python tools/compare_phis.py                                  # the table2 study, seed 0
    python tools/compare_phis.py --experiment relations --seeds 0 1 2
    python tools/compare_phis.py --study my_study.py --seeds 0 1 2  # rows of your own
    python tools/compare_phis.py --configs a.py b.py --data my_data.py --seeds 0 1 2
    python tools/compare_phis.py --study my_study.py --seeds 0 1 2 3 4 --report  # tabulate, train nothing
    python tools/compare_phis.py --study my_study.py --seeds 0 1 2 --device cuda --jobs 4  # 4 runs at once on a GPU

The built-in studies are the files of ``configs/studies/``; the format of a study file is
:mod:`posattn_openmmlab.study.spec`'s; docs/your-data.md and docs/results.md say what the tables
hold. Every row, path and override is checked before the first run trains. A run that finished
before in the work dir with the same config and overrides is reused: an interrupted study goes on
where it stopped. A run that fails leaves the others training; the failures are named at the end,
and running the study again (or with --rows and --seeds naming one) reruns them alone.
"""
import argparse
import sys
from pathlib import Path

import _common  # noqa: F401  (tools/ on the path, posattn's OpenMMLab registrations)
import torch
from mmengine.config import DictAction

from posattn_openmmlab.study import (STUDIES, WARMUP_STEPS, RunFailed, RunStore, StudyError, StudyRunner,
                                     checked_run_configs, collect_runs, load_data, load_study, planned_rows,
                                     run_options, study_of_configs, time_training_steps, write_outputs)
from posattn_openmmlab.study.runs import DEVICES
from posattn_openmmlab.study.spec import config_file
from posattn_openmmlab.study.timing import device_words

DEFAULT_STUDY = 'table2'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train each row of a study with one budget and compare them')
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--experiment', choices=sorted(path.stem for path in STUDIES.glob('*.py')),
                        help=f'a built-in study, a file of configs/studies/ (default: {DEFAULT_STUDY})')
    source.add_argument('--study', dest='study_file', metavar='FILE', help='a study file of your own')
    source.add_argument('--configs', nargs='+', metavar='CONFIG', help='config files to compare, a row each')
    parser.add_argument('--data', metavar='DATA_CONFIG', help='a config defining train/val/test_dataloader, '
                        "val/test_evaluator and num_classes, given to every row in place of its own data")
    parser.add_argument('--rows', nargs='+', help="rows to train (default: all; a row that starts from another "
                                                  'trains that one too)')
    parser.add_argument('--seeds', nargs='+', type=int, default=[0], help='one run per row and seed')
    parser.add_argument('--epochs', type=int, help="epochs per run (default: the configs')")
    parser.add_argument('--device', choices=DEVICES, help='where the runs train and the steps are timed '
                        '(default: cuda where a GPU is visible, else cpu)')
    parser.add_argument('--jobs', type=int, default=1, help='runs that train at once (on the CPU each gets its '
                        'share of the cores; on a GPU they share it)')
    parser.add_argument('--work-dir', help="where runs, tables and figures go (default: the study's work_dir)")
    parser.add_argument('--report', action='store_true', help='train and test nothing: tabulate the finished runs')
    parser.add_argument('--no-timing', action='store_true', help='do not time a training step of each row')
    parser.add_argument('--timing-repeats', type=int, default=5,
                        help=f'timed steps per row after {WARMUP_STEPS} warm-up steps; the table gives the median')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='overrides for every run, after --data (e.g. train_dataloader.batch_size=32)')
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
        args.data = load_data(args.study.data) if args.study.data else None
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    unknown = sorted(set(args.rows or ()) - set(args.study.rows))
    if unknown:
        parser.error(f'no row {", ".join(unknown)} in the {args.study.name} study; its rows: '
                     f'{", ".join(args.study.rows)}')
    if args.epochs is not None and args.epochs < 2:
        parser.error(f'--epochs must be >= 2 (one warm-up epoch, then the cosine decay), got {args.epochs}')
    if args.jobs < 1:
        parser.error(f'--jobs must be >= 1, got {args.jobs}')
    cuda = torch.cuda.is_available()
    args.device = args.device or ('cuda' if cuda else 'cpu')
    if args.device == 'cuda' and not cuda:
        parser.error('--device cuda: no GPU is visible to torch here (torch.cuda.is_available() is False)')
    if args.timing_repeats < 1:
        parser.error(f'--timing-repeats must be >= 1 (or pass --no-timing), got {args.timing_repeats}')
    args.work_dir = Path(args.work_dir or args.study.work_dir)
    return args


def main(argv=None):
    args = parse_args(argv)
    study, cwd = args.study, Path.cwd()
    planned = planned_rows(study, args.rows)

    def options_of(name, seed, start=None):
        return run_options(study.rows[name], seed, args.cfg_options, args.epochs, start)
    try:
        configs = checked_run_configs(study, planned, args.data, {name: options_of(name, args.seeds[0])
                                                                  for name in planned}, cwd)
    except StudyError as error:
        raise SystemExit(f'{study.name}: {error}') from None
    args.work_dir.mkdir(parents=True, exist_ok=True)
    runner = StudyRunner(study, RunStore(args.work_dir), args.data, cwd, device=args.device, jobs=args.jobs)
    try:
        runs = collect_runs(runner, planned, args.seeds, options_of, args.report)
    except RunFailed as error:
        raise SystemExit(str(error)) from None
    if not runs:
        raise SystemExit(f'no run of the rows {", ".join(planned)} with seeds {args.seeds} finished in {args.work_dir}')
    timing = None
    if not args.no_timing:
        print(f'timing a training step of each row (on {device_words(args.device)}, {WARMUP_STEPS} warm-up and '
              f'{args.timing_repeats} timed steps each, the rows in turn)', flush=True)
        timing = time_training_steps({name: configs[name] for name in dict.fromkeys(run.row for run in runs)},
                                     args.timing_repeats, args.device)
    command = 'python tools/compare_phis.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    print('\n' + write_outputs(args.work_dir, study, runs, configs, timing, args.timing_repeats, command.strip(),
                               args.device))
    print(f'wrote {args.work_dir / "comparison.md"}, comparison.json and the figures')


if __name__ == '__main__':
    main()
