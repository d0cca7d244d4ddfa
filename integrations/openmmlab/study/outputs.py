"""What a study writes to its work dir after its runs: ``comparison.json`` (every run's record, the
table and the step timing), ``comparison.md`` (:mod:`.report`'s tables) and the figures
(``comparison.png``; ``resolution.png`` and ``extent.png`` for the tests at other sizes)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from mmengine.config import Config

from .figures import comparison_figure, figure_labels, save_figure, size_figure
from .records import RunRecord
from .report import SIZE_TESTS, report_text, summarise
from .spec import Study
from .timing import batch_and_size, step_timing_note

__all__ = ['write_outputs']

FIGURE_DPI = 90


def write_outputs(work_dir: Path, study: Study, runs: Sequence[RunRecord], configs: Mapping[str, Config],
                  timing: Optional[Dict[str, dict]], timing_repeats: int, command: str, device: str = 'cpu') -> str:
    """Writes the tables, the record and the figures of ``runs`` (``configs``: each row's run config;
    ``timing``: :func:`~.timing.time_training_steps`'s on ``device``, or None); returns the tables' text."""
    from posattn.analysis.figures import DEFAULT_DPI

    from ..sizes import GENERATED
    configs = {name: cfg for name, cfg in configs.items() if any(run.row == name for run in runs)}
    table = summarise(runs, study.rows, None if timing is None else
                      {name: row['step_time_s'] for name, row in timing.items()})
    where = 'CPU, 1 thread' if device == 'cpu' else 'GPU'
    axis = None if timing is None else f'training step time (ms; {"; ".join(batch_and_size(timing))}; {where})'
    labels = figure_labels(configs, axis)
    note = step_timing_note(timing, timing_repeats, device)
    size_tests = [(test, getattr(study, test.factors_key)) for test in SIZE_TESTS if getattr(study, test.factors_key)]
    generated = all(cfg.test_dataloader.dataset.get('type') in GENERATED for cfg in configs.values())
    chance = {name: 100 / cfg.model.head.num_classes for name, cfg in configs.items()}
    text = report_text(study.equal_within, table, runs, note, size_tests, generated, chance)
    record = dict(command=command, study=study.name, data=None if study.data is None else str(study.data),
                  runs=[run.to_json() for run in runs],
                  table=[dict(dataclasses.asdict(line), top1=line.top1, top1_std=line.top1_std) for line in table],
                  step_timing=dict(note=note, rows=timing), figure=labels._asdict())
    (work_dir / 'comparison.json').write_text(json.dumps(record, indent=1))
    (work_dir / 'comparison.md').write_text(text)
    save_figure(comparison_figure(runs, table, labels), work_dir / 'comparison.png', FIGURE_DPI)
    for test, factors in size_tests:
        words = 'scene size' if generated else 'test image size'
        save_figure(size_figure(table, runs, test, factors, labels, words if test.name == 'size' else 'canvas side'),
                    work_dir / test.figure, DEFAULT_DPI)
    return text
