"""Running a study: each planned row trained with each seed through ``tools/train.py`` (one process
per run), optionally analysed (``tools/analyze.py``) and tested at other sizes (in this process), a
record kept per run; a run that finished before with the same config and overrides is reused.

The tools run in the folder the study command ran in, so that relative paths in the configs mean
what they mean to ``tools/train.py`` there; each run's config (``<row>/seed<N>/config.py``) holds its
overrides merged as Python values, and the tools read that file.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

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


class RunFailed(RuntimeError):
    """A run of a study failed: names the row, the seed and the log to read; rerun the study to go on."""


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
    """

    def __init__(self, study: Study, store: RunStore, data: Optional[Config], cwd: Path,
                 echo: Callable[[str], None] = print):
        self.study, self.store, self.data, self.cwd, self.echo = study, store, data, cwd, echo
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
        if record is not None:
            self.echo(f'    finished before with the same config and settings: reusing '
                      f'{self.store.run_dir(name, seed) / RunStore.RECORD}')
        else:
            record = self._train(name, seed, options, cfg)
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

    def _train(self, name: str, seed: int, options: Mapping[str, Any], cfg: Config) -> RunRecord:
        aside = self.store.set_aside(name, seed)
        if aside is not None:
            self.echo(f'    {self.store.run_dir(name, seed)} held an unfinished or differently configured run: '
                      f'moved to {aside}')
        run_dir = self.store.run_dir(name, seed)
        config = self.store.write_config(cfg, name, seed)
        start = time.perf_counter()
        with open(run_dir / 'train.log', 'w') as log:
            process = subprocess.Popen([*_tool('train.py'), str(config), '--work-dir', str(run_dir)], cwd=self.cwd,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in process.stdout:
                log.write(line)
                if 'Epoch(val)' in line and 'accuracy/top1' in line:
                    self.echo('    ' + line.split(' - ')[-1].strip())
        if process.wait() != 0:
            tail = ''.join((run_dir / 'train.log').read_text().splitlines(keepends=True)[-30:])
            raise RunFailed(f'row {name}, seed {seed} failed; {run_dir / "train.log"} ends with:\n{tail}')
        record = RunRecord(row=name, seed=seed, options=recorded_options(options), config_digest=config_digest(cfg),
                           params=count_parameters(cfg), wall_s=time.perf_counter() - start, **read_logged_run(run_dir))
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
    seed, starting_checkpoint)`` gives its overrides. With ``report_only`` nothing is trained or tested:
    the runs that finished (with every test the study asks) are read, the others named and left out."""
    store, runs = runner.store, []
    plan = [(name, seed) for name in planned for seed in seeds]
    for index, (name, seed) in enumerate(plan, 1):
        row = runner.study.rows[name]
        runner.echo(f'[{index}/{len(plan)}] {row.label} ({row.config}), seed {seed}: '
                    f'log {store.run_dir(name, seed) / "train.log"}')
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
