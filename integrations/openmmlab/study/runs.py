"""Running a study: each planned row trained with each seed through ``tools/train.py`` (one process
per run, ``jobs`` at a time, on the CPU or the GPU), then analysed (``tools/analyze.py``) and tested
at other sizes (in this process) as the study asks, a record kept per run; a run that finished before
with the same config and overrides is reused. A run that fails leaves the others running; the
failures are named together at the end, and the same command (or ``--rows`` and ``--seeds`` naming
one) reruns them alone.

The tools run in the folder the study command ran in, so that relative paths in the configs mean
what they mean to ``tools/train.py`` there; each run's config (``<row>/seed<N>/config.py``) holds its
overrides merged as Python values, and the tools read that file.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from mmengine.config import Config

from ..evaluation import evaluate_checkpoint
from .checks import absolute_data_roots, test_sides
from .records import RunRecord, RunStore, read_logged_run
from .report import SIZE_TESTS, SizeTest
from .spec import CHECKOUT, Row, Study, config_digest, recorded_options, row_config, with_options
from .timing import count_parameters

__all__ = ['RunFailed', 'StudyRunner', 'run_options']

ANALYSED_IMAGES = 256
EPOCHS = 'train_cfg.max_epochs'  # a run's length: the schedulers that end with the run follow it


DEVICES = ('cpu', 'cuda')
Key = Tuple[str, int]  # a run: its row and seed


class RunFailed(RuntimeError):
    """Runs of a study failed: names each row, seed and the log to read; rerun the study to go on."""


def run_options(row: Row, seed: int, common: Mapping[str, Any], epochs: Optional[int] = None,
                starting_checkpoint: Optional[Path] = None) -> Dict[str, Any]:
    """The config overrides of one run, {dotted key: Python value}: the command line's ``common``,
    then the row's own (the study's options under it), the seed, the length in epochs (the
    schedulers that ended with the run end with it: :func:`~..linked_settings.merge_options`) and
    the checkpoint it starts from (in the row's ``checkpoint_keys``)."""
    options = dict(common, **dict(row.options), **{'randomness.seed': seed})
    if epochs is not None:
        options[EPOCHS] = epochs
    if starting_checkpoint is not None:
        options.update(dict.fromkeys(row.checkpoint_keys, str(starting_checkpoint)))
    return options


def _tool(name: str) -> List[str]:
    return [sys.executable, str(CHECKOUT / 'tools' / name)]


class StudyRunner:
    """Trains, analyses and tests the runs of ``study`` in ``store``, from the folder ``cwd``.

    Args:
        data: the data config given to every row, or None.
        echo: where progress lines go (``print``).
        device: where the runs train, ``'cpu'`` or ``'cuda'`` (every run on the one GPU it sees).
        jobs: how many runs train at once; on the CPU each gets an equal share of the cores as its
            threads (unless ``OMP_NUM_THREADS`` says otherwise).
    """

    def __init__(self, study: Study, store: RunStore, data: Optional[Config], cwd: Path,
                 echo: Callable[[str], None] = print, device: str = 'cpu', jobs: int = 1):
        if device not in DEVICES:
            raise ValueError(f'device is one of {", ".join(DEVICES)}, got {device!r}')
        if jobs < 1:
            raise ValueError(f'jobs must be >= 1, got {jobs}')
        self.study, self.store, self.data, self.cwd, self.echo = study, store, data, cwd, echo
        self.device, self.jobs = device, jobs
        self.trained: Set[Key] = set()  # the runs this runner trained (not reused)
        self._row_configs: Dict[str, Config] = {}

    def row_config(self, name: str) -> Config:
        if name not in self._row_configs:
            self._row_configs[name] = row_config(self.study.rows[name], self.data)
        return self._row_configs[name]

    def run_config(self, name: str, options: Mapping[str, Any]) -> Config:
        """The config a run of ``name`` trains: its overrides merged, its data folders absolute."""
        cfg = with_options(self.row_config(name), options)
        absolute_data_roots(cfg, self.cwd)
        return cfg

    def finished(self, name: str, seed: int, options: Mapping[str, Any]) -> Optional[RunRecord]:
        """The run's record where it finished before with these overrides and config, else None."""
        return self.store.finished(name, seed, recorded_options(options),
                                   config_digest(self.run_config(name, options)))

    def pending_tests(self, record: RunRecord, cfg: Config) -> List[tuple]:
        """The study's tests at other sizes that ``record`` lacks at the sides they give: (test, sides)."""
        pending = []
        for test in SIZE_TESTS:
            factors = getattr(self.study, test.factors_key)
            sides = test_sides(cfg, factors) if factors else []
            if sides and list(record.top1_at.get(test.name, ())) != list(map(str, sides)):
                pending.append((test, sides))
        return pending

    def run(self, name: str, seed: int, options: Mapping[str, Any]) -> RunRecord:
        """The run of ``name`` with ``seed``: reused where it finished before, else trained; then
        analysed and tested as the study asks, where it was not yet."""
        cfg = self.run_config(name, options)
        record = self.finished(name, seed, options)
        if record is not None and (name, seed) not in self.trained:
            self.echo(f'    finished before with the same config and settings: reusing '
                      f'{self.store.run_dir(name, seed) / RunStore.RECORD}')
        elif record is None:
            record = self._record(name, seed, options, cfg, self._train(name, seed, cfg))
        config = self.store.config_path(name, seed)
        if not config.is_file():  # a reused run whose folder lost it
            self.store.write_config(cfg, name, seed)
        if self.study.analyse and record.nonlocality is None:
            record.nonlocality = self._analyse(name, seed, config)
            self.store.save(record)
        for test, sides in self.pending_tests(record, cfg):
            record.top1_at[test.name] = self._test(name, seed, config, test, sides)
            self.store.save(record)
            self.echo(f'    top-1 ({test.option}) at ' + ', '.join(
                f'{side} px {top1:.1f}%' for side, top1 in record.top1_at[test.name].items()))
        return record

    def train_pending(self, plan: Sequence[Key], options_of: Callable[..., Dict[str, Any]]) -> Dict[Key, str]:
        """Trains every run of ``plan`` that has not finished, :attr:`jobs` at a time, a run that starts
        from another after that one (``options_of(row, seed, starting_checkpoint)``: its overrides).
        A failed run leaves the others training; returns the failures, {run: what went wrong}."""
        waiting, failures, done = list(plan), {}, set()
        running: Dict[Future, Tuple[Key, Dict[str, Any], Config]] = {}  # each training: its run, overrides, config
        with ThreadPoolExecutor(self.jobs) as pool:
            while waiting or running:
                for key in list(waiting):
                    source = self.study.rows[key[0]].start_from
                    source_key = None if source is None else (source, key[1])
                    if source_key in failures:
                        waiting.remove(key)
                        failures[key] = f'row {key[0]}, seed {key[1]} did not train: the run it starts from failed'
                    elif (source_key is None or source_key in done or source_key not in plan) \
                            and len(running) < self.jobs:
                        waiting.remove(key)
                        self._start(pool, running, done, key, options_of)
                if running:
                    for future in wait(running, return_when=FIRST_COMPLETED)[0]:
                        key, options, cfg = running.pop(future)
                        try:
                            self._record(*key, options, cfg, future.result())
                            self.trained.add(key)
                        except RunFailed as error:
                            failures[key] = str(error)
                        done.add(key)
        return failures

    def _start(self, pool: ThreadPoolExecutor, running: Dict[Future, Tuple[Key, Dict[str, Any], Config]],
               done: Set[Key], key: Key, options_of: Callable[..., Dict[str, Any]]) -> None:
        """Submits the training of ``key`` unless it finished before (then it is done)."""
        name, seed = key
        options = options_of(name, seed, _starting_checkpoint(self.store, self.study.rows[name], seed, False))
        if self.finished(name, seed, options) is not None:
            done.add(key)
            return
        cfg = self.run_config(name, options)
        self.echo(f'training {self.study.rows[name].label}, seed {seed} on the {self.device}: log '
                  f'{self.store.run_dir(name, seed) / "train.log"}')
        running[pool.submit(self._train, name, seed, cfg)] = key, options, cfg

    def train_command(self, config: Path, run_dir: Path) -> List[str]:
        """The command that trains one run."""
        return [*_tool('train.py'), str(config), '--work-dir', str(run_dir)]

    def train_environment(self) -> Dict[str, str]:
        """The environment of a training process: on the CPU, no GPU visible and a share of the cores."""
        env = dict(os.environ)
        if self.device == 'cpu':
            env['CUDA_VISIBLE_DEVICES'] = ''
            env.setdefault('OMP_NUM_THREADS', str(max(1, (os.cpu_count() or 1) // self.jobs)))
        return env

    def _train(self, name: str, seed: int, cfg: Config) -> float:
        """Trains one run in its folder (what an unfinished run left there set aside); returns its wall
        time in seconds, or raises :class:`RunFailed` naming its log. Safe to run in a thread."""
        aside = self.store.set_aside(name, seed)
        if aside is not None:
            self.echo(f'    {self.store.run_dir(name, seed)} held an unfinished or differently configured run: '
                      f'moved to {aside}')
        run_dir = self.store.run_dir(name, seed)
        config = self.store.write_config(cfg, name, seed)
        prefix = '    ' if self.jobs == 1 else f'    [{name} seed {seed}] '
        start = time.perf_counter()
        with open(run_dir / 'train.log', 'w') as log:
            process = subprocess.Popen(self.train_command(config, run_dir), cwd=self.cwd, env=self.train_environment(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in process.stdout:
                log.write(line)
                if 'Epoch(val)' in line and 'accuracy/top1' in line:
                    self.echo(prefix + line.split(' - ')[-1].strip())
        if process.wait() != 0:
            tail = ''.join((run_dir / 'train.log').read_text().splitlines(keepends=True)[-30:])
            raise RunFailed(f'row {name}, seed {seed} failed; {run_dir / "train.log"} ends with:\n{tail}')
        return time.perf_counter() - start

    def _record(self, name: str, seed: int, options: Mapping[str, Any], cfg: Config, wall_s: float) -> RunRecord:
        """The record of a run that just trained, saved in its folder."""
        run_dir = self.store.run_dir(name, seed)
        record = RunRecord(row=name, seed=seed, options=recorded_options(options), config_digest=config_digest(cfg),
                           params=count_parameters(cfg), wall_s=wall_s, **read_logged_run(run_dir))
        self.store.save(record)
        return record

    def _analyse(self, name: str, seed: int, config: Path) -> Dict[str, List[Optional[float]]]:
        """tools/analyze.py on the run's last checkpoint; Ω of Φp and of Φa per layer, means over heads."""
        run_dir = self.store.run_dir(name, seed)
        out = run_dir / 'analysis'
        command = [*_tool('analyze.py'), str(config), str(self.store.last_checkpoint(name, seed)), '--out', str(out),
                   '--num-images', str(ANALYSED_IMAGES)]
        with open(run_dir / 'analyze.log', 'w') as log:
            if subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd).returncode != 0:
                raise RunFailed(f'analysing row {name}, seed {seed} failed; see {run_dir / "analyze.log"}')
        layers = json.loads((out / 'metrics.json').read_text())['layers']

        def head_means(key):
            return [None if layer[key] is None else statistics.fmean(layer[key]) for layer in layers]
        return dict(position=head_means('nonlocality_position'), mixed=head_means('nonlocality_mixed'))

    def _test(self, name: str, seed: int, config: Path, test: SizeTest, sides: Sequence[int]) -> Dict[str, float]:
        """Top-1 of the run's last checkpoint at each of ``sides`` with ``test``, without fine-tuning, in
        this process (:func:`~..evaluation.evaluate_checkpoint`); a side measured before (its JSON in the
        run's folder) is read, not measured again."""
        out_dir = self.store.run_dir(name, seed) / test.folder
        top1 = {}
        for side in sides:
            out = out_dir / f'top1_at_{side}.json'
            if not out.is_file():
                cfg = Config.fromfile(str(config))
                cfg.work_dir, cfg.log_level = str(out_dir), 'WARNING'  # its log in its folder, not on the console
                size = {'size': (side, side)} if test.name == 'size' else {'extent': side}
                result = evaluate_checkpoint(cfg, self.store.last_checkpoint(name, seed), **size)
                out_dir.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({**{key: float(value) for key, value in result.metrics.items()},
                                           'img_size': None if result.img_size is None else list(result.img_size)}))
            top1[str(side)] = json.loads(out.read_text())['accuracy/top1']
        return top1


def collect_runs(runner: StudyRunner, planned: Sequence[str], seeds: Sequence[int],
                 options_of: Callable[..., Dict[str, Any]], report_only: bool) -> List[RunRecord]:
    """Every planned run in order (a row after the one it starts from), each seed's; ``options_of(row,
    seed, starting_checkpoint)`` gives its overrides. The runs that did not finish train first
    (:meth:`StudyRunner.train_pending`), then each is analysed and tested; where some failed, the
    others are kept and :class:`RunFailed` names every failure. With ``report_only`` nothing is
    trained or tested: the runs that finished (with every test the study asks) are read, the others
    named and left out."""
    store, runs = runner.store, []
    plan = [(name, seed) for name in planned for seed in seeds]
    failures = {} if report_only else runner.train_pending(plan, options_of)
    for index, (name, seed) in enumerate(plan, 1):
        row = runner.study.rows[name]
        runner.echo(f'[{index}/{len(plan)}] {row.label} ({row.config}), seed {seed}: '
                    f'log {store.run_dir(name, seed) / "train.log"}')
        if (name, seed) in failures:
            runner.echo('    failed: ' + failures[name, seed].splitlines()[0])
            continue
        options = options_of(name, seed, _starting_checkpoint(store, row, seed, report_only))
        if report_only:
            record = runner.finished(name, seed, options)
            pending = [] if record is None else runner.pending_tests(record, runner.run_config(name, options))
            if record is None or pending:
                runner.echo('    ' + ('no run with this config finished there' if record is None else
                                      f'not tested with {pending[0][0].option} at '
                                      f'{", ".join(map(str, pending[0][1]))} px') + ': left out of the tables')
                continue
        else:
            record = runner.run(name, seed, options)
            runner.echo(f'    top-1 {record.final_top1:.1f}% after {len(record.top1_per_epoch)} epochs, '
                        f'{record.wall_s / 60:.1f} min')
        runs.append(record)
    if failures:
        raise RunFailed(f'{len(failures)} of {len(plan)} runs failed:\n\n' + '\n\n'.join(failures.values())
                        + '\n\nThe runs that finished are kept. Rerun a failed one alone with the same command and '
                        + '--rows ROW --seeds SEED (' + '; '.join(f'{name} {seed}' for name, seed in failures) + '), '
                        + 'or all of them with the same command.')
    return runs


def _starting_checkpoint(store: RunStore, row: Row, seed: int, report_only: bool) -> Optional[Path]:
    """The last checkpoint of the run ``row`` starts from (None: it trains from scratch, or, reporting,
    that run did not finish)."""
    if row.start_from is None:
        return None
    try:
        return store.last_checkpoint(row.start_from, seed)
    except FileNotFoundError:
        if report_only:
            return None
        raise
