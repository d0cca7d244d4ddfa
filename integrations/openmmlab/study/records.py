"""The record of each run of a study, and the one store that keeps them in the study's work dir.

A run is a row trained with one seed. It leaves, in ``<work dir>/<row>/seed<N>/``, mmengine's logs
and checkpoints, the config it trained (``config.py``, its overrides merged) and its record
(``run.json``): what the study reads of it, so that a rerun reuses the run instead of training it
again while its config and overrides are the same.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from mmengine.config import Config

from ..work_dir_lock import WorkDirLock

__all__ = ['RunRecord', 'RunStore', 'read_logged_run']

SKIPPED_LOGGED_WINDOWS = 1  # the first logged window of each run holds warm-up (allocation, first batches)


@dataclasses.dataclass
class RunRecord:
    """What a study reads of one finished run.

    Attributes:
        row, seed: the run.
        options: its overrides as ``key=value`` text, what a rerun compares to reuse it.
        config_digest: a fingerprint of the config it trained (:func:`~.spec.config_digest`).
        params: the model's parameters.
        wall_s: the training's wall time in seconds.
        top1_per_epoch: validation top-1 (%) after each epoch.
        logged_step_time_s: the median step time over mmengine's logged windows (None: too few).
        nonlocality: Ω of Φp and of Φa per layer, ``{'position': [...], 'mixed': [...]}``, where analysed.
        top1_at: per test at other sizes (``'size'``, ``'extent'``), top-1 per side in pixels.
    """
    row: str
    seed: int
    options: List[str]
    config_digest: str
    params: int
    wall_s: float
    top1_per_epoch: List[float]
    logged_step_time_s: Optional[float] = None
    nonlocality: Optional[Dict[str, List[Optional[float]]]] = None
    top1_at: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def final_top1(self) -> float:
        return self.top1_per_epoch[-1]

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: Dict[str, Any]) -> 'RunRecord':
        """A record as :meth:`to_json` wrote it, or as earlier versions of the tool did (the step time
        as ``step_time_s``, the tests as ``top1_at_size`` and ``top1_at_extent``)."""
        values = dict(values)
        if 'step_time_s' in values:
            values['logged_step_time_s'] = values.pop('step_time_s')
        top1_at = dict(values.pop('top1_at', None) or {})
        for test in ('size', 'extent'):
            if f'top1_at_{test}' in values:
                top1_at[test] = values.pop(f'top1_at_{test}')
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known}, top1_at=top1_at)


def read_logged_run(run_dir: Path) -> Dict[str, Any]:
    """Validation top-1 per epoch and the median step time over the logged windows (None: too few
    logged), from the run's mmengine scalars (every log folder in time order: a run that was resumed
    has one per start)."""
    from ..logs import logged_scalars
    rows = logged_scalars(run_dir)
    if not rows:
        raise FileNotFoundError(f'no mmengine scalars under {run_dir}')
    accuracy = [row['accuracy/top1'] for row in rows if 'accuracy/top1' in row]
    if not accuracy:
        raise ValueError(f'the scalars logged under {run_dir} hold no validation top-1 (accuracy/top1): '
                         'the runs need a val_dataloader and an Accuracy val_evaluator')
    step_times = [row['time'] for row in rows if 'loss' in row][SKIPPED_LOGGED_WINDOWS:]
    return dict(top1_per_epoch=accuracy, logged_step_time_s=statistics.median(step_times) if step_times else None)


class RunStore:
    """The runs of a study in its work dir: ``<row>/seed<N>/``, each with its record and config."""

    RECORD = 'run.json'
    CONFIG = 'config.py'

    def __init__(self, work_dir: Path):
        self.work_dir = Path(work_dir)

    def row_dir(self, row: str) -> Path:
        return self.work_dir / row

    def run_dir(self, row: str, seed: int) -> Path:
        return self.work_dir / row / f'seed{seed}'

    def config_path(self, row: str, seed: int) -> Path:
        """The config the run trains (and tests and analyses with): where mmengine's runner saves it too."""
        return self.run_dir(row, seed) / self.CONFIG

    def write_config(self, cfg: Config, row: str, seed: int) -> Path:
        path = self.config_path(row, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg.dump(path)
        return path

    def finished(self, row: str, seed: int, options: List[str], digest: str) -> Optional[RunRecord]:
        """The record of the run that finished for ``row`` and ``seed`` with these overrides and this
        config, else None; under ``row`` whatever row name it was recorded under (a run of the same
        config and overrides shared with another study's row)."""
        path = self.run_dir(row, seed) / self.RECORD
        if not path.is_file():
            return None
        record = RunRecord.from_json(json.loads(path.read_text()))
        if record.options != options or record.config_digest != digest:
            return None
        return dataclasses.replace(record, row=row)

    def save(self, record: RunRecord) -> None:
        path = self.run_dir(record.row, record.seed) / self.RECORD
        path.write_text(json.dumps(record.to_json(), indent=1))

    def last_checkpoint(self, row: str, seed: int) -> Path:
        """The checkpoint mmengine saved last in the run's folder (its ``last_checkpoint`` file names it)."""
        run_dir = self.run_dir(row, seed)
        named = run_dir / 'last_checkpoint'
        if not named.is_file():
            raise FileNotFoundError(f'{run_dir} holds no finished training (no last_checkpoint file)')
        path = Path(named.read_text().strip())
        return path if path.is_absolute() else run_dir / path.name

    def set_aside(self, row: str, seed: int) -> Optional[Path]:
        """Moves what the run's folder holds from an earlier, unfinished or differently configured run
        to ``<folder>.before-<time>``, so that the new run's logs are read alone and nothing is deleted.
        Returns where it went (None: nothing there). A folder in which a training is still running is
        left as it is: the work_dir lock's error names that training."""
        run_dir = self.run_dir(row, seed)
        if not run_dir.exists() or not any(run_dir.iterdir()):
            return None
        with WorkDirLock(str(run_dir)):  # a training still running there: WorkDirInUseError, nothing moved
            pass
        aside = run_dir.with_name(f'{run_dir.name}.before-{time.strftime("%Y%m%d-%H%M%S")}')
        run_dir.rename(aside)
        return aside
