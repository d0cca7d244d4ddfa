"""A study's tables: each row over its seeds, the rows ranked with a verdict on each difference, the
tests at other sizes, and Ω per layer; every column defined under its table.

Each adjacent pair of ranked rows gets Welch's 95% t-interval of the difference of their mean
top-1 over seeds, and a verdict: **apart** where the interval excludes 0, **equal within N points**
where it lies inside [-N, +N] (N the study's ``equal_within``, 3 by default), else **the seed
decides**, with the number of seeds per row that would give an interval narrow enough to say one or
the other at the spreads seen. An interval is given only where both rows have
:data:`MIN_SEEDS` seeds or more: with two, Welch's interval spans hundreds of points.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .records import RunRecord
from .spec import Row

__all__ = ['RowSummary', 'summarise', 'Verdict', 'compare', 'SizeTest', 'SIZE_TESTS', 'main_table',
           'ranking_table', 'size_table', 'nonlocality_table', 'mean_std', 'Convergence', 'convergence',
           'convergence_table']

CONFIDENCE = 0.95
MIN_SEEDS = 3  # per row, for an interval
MAX_SEEDS_TO_RESOLVE = 100
TARGET_TOP1 = 95.0  # the column "epochs to 95%"
ABOVE_CHANCE = 10.0  # points above chance that a run's top-1 has left chance at, and a learning row's mean ends
LATE_SHARE = 0.2  # the last part of a run's epochs, in which a converged run's top-1 moves by less than ...
LATE_MOVE = 1.0  # ... this many points


@dataclasses.dataclass
class RowSummary:
    """One row over its seeds (:func:`summarise`)."""
    row: str
    label: str
    config: str
    seeds: List[int]
    finals: List[float]
    best_top1: float
    epochs_to_target: List[Optional[int]]
    params_m: float
    epochs: int
    wall_min: float
    step_time_ms: Optional[float] = None
    nonlocality: Optional[Dict[str, List[Optional[float]]]] = None

    @property
    def top1(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def top1_std(self) -> Optional[float]:
        return statistics.stdev(self.finals) if len(self.finals) > 1 else None


def summarise(runs: Sequence[RunRecord], rows: Mapping[str, Row],
              step_times: Optional[Mapping[str, float]] = None) -> List[RowSummary]:
    """One summary per row of ``runs``, in their order; ``step_times``: seconds per row, where timed."""
    table = []
    for name in dict.fromkeys(run.row for run in runs):
        mine = [run for run in runs if run.row == name]
        table.append(RowSummary(
            row=name, label=rows[name].label, config=rows[name].config, seeds=[run.seed for run in mine],
            finals=[run.final_top1 for run in mine],
            best_top1=statistics.fmean(max(run.top1_per_epoch) for run in mine),
            epochs_to_target=[next((epoch for epoch, top1 in enumerate(run.top1_per_epoch, 1) if top1 >= TARGET_TOP1),
                                   None) for run in mine],
            params_m=mine[0].params / 1e6, epochs=len(mine[0].top1_per_epoch),
            wall_min=statistics.fmean(run.wall_s for run in mine) / 60,
            step_time_ms=None if step_times is None else 1e3 * step_times[name],
            nonlocality=_mean_nonlocality(mine)))
    return table


def _mean_nonlocality(runs: Sequence[RunRecord]) -> Optional[Dict[str, List[Optional[float]]]]:
    """Ω of Φp and Φa per layer, means over the seeds; None for runs not analysed."""
    if any(run.nonlocality is None for run in runs):
        return None
    means = {}
    for key in ('position', 'mixed'):
        per_layer = zip(*(run.nonlocality[key] for run in runs))
        means[key] = [None if None in values else statistics.fmean(values) for values in per_layer]
    return means


def mean_std(values: Sequence[float]) -> str:
    """'mean ± standard deviation (n seeds)' of per-seed values; the sample deviation (n - 1)."""
    if len(values) == 1:
        return f'{values[0]:.1f} (1 seed)'
    return f'{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f} ({len(values)} seeds)'


class Verdict(NamedTuple):
    """The difference of two rows' mean top-1 and what the seeds say of it (module docstring)."""
    difference: float
    interval: Optional[Tuple[float, float]]  # Welch's, where both rows have MIN_SEEDS seeds
    words: str


def _welch(above: Sequence[float], below: Sequence[float]) -> Tuple[float, float]:
    """Welch's two-sided interval of mean(above) - mean(below) at :data:`CONFIDENCE`."""
    difference = statistics.fmean(above) - statistics.fmean(below)
    if statistics.stdev(above) == 0 and statistics.stdev(below) == 0:
        return difference, difference
    from scipy.stats import ttest_ind
    low, high = ttest_ind(above, below, equal_var=False).confidence_interval(CONFIDENCE)
    return float(low), float(high)


def seeds_to_resolve(above: Sequence[float], below: Sequence[float], equal_within: float) -> Optional[int]:
    """Seeds per row at which, with the spreads and the difference seen, Welch's interval would be
    narrow enough to say "apart" or "equal within": half as wide as the larger of the difference and
    its distance to the margin; None beyond :data:`MAX_SEEDS_TO_RESOLVE`."""
    from scipy.stats import t
    difference = abs(statistics.fmean(above) - statistics.fmean(below))
    variance = statistics.variance(above) + statistics.variance(below)
    needed = max(difference, equal_within - difference)
    for seeds in range(MIN_SEEDS, MAX_SEEDS_TO_RESOLVE + 1):
        half_width = t.ppf(0.5 + CONFIDENCE / 2, 2 * seeds - 2) * math.sqrt(variance / seeds)
        if half_width < needed:
            return seeds
    return None


def compare(above: Sequence[float], below: Sequence[float], equal_within: float) -> Verdict:
    """The verdict on two rows' per-seed top-1 (module docstring)."""
    difference = statistics.fmean(above) - statistics.fmean(below)
    fewest = min(len(above), len(below))
    if fewest < MIN_SEEDS:
        return Verdict(difference, None, f'needs {MIN_SEEDS} seeds per row (has {fewest})')
    low, high = _welch(above, below)
    if low > 0 or high < 0:
        return Verdict(difference, (low, high), 'apart')
    if -equal_within <= low and high <= equal_within:
        return Verdict(difference, (low, high), f'equal within {equal_within:g} points')
    seeds = seeds_to_resolve(above, below, equal_within)
    more = f'about {seeds} seeds per row would tell' if seeds else f'over {MAX_SEEDS_TO_RESOLVE} seeds per row to tell'
    return Verdict(difference, (low, high), f'the seed decides ({more})')


class Convergence(NamedTuple):
    """How a run's validation top-1 settled (:func:`convergence`)."""
    left_chance: Optional[int]  # the first epoch at ABOVE_CHANCE points above chance (None: never)
    late_move: float  # max - min of top-1 over the last LATE_SHARE of the epochs and the epoch before them

    def converged(self) -> bool:
        return self.late_move < LATE_MOVE


def convergence(top1_per_epoch: Sequence[float], chance: float) -> Convergence:
    """Where ``top1_per_epoch`` left ``chance`` (%), and how far it moved over its last epochs: of E
    epochs, the last ceil(LATE_SHARE E), measured from the epoch before them."""
    late = math.ceil(LATE_SHARE * len(top1_per_epoch))
    tail = top1_per_epoch[-late - 1:]
    left = next((epoch for epoch, top1 in enumerate(top1_per_epoch, 1) if top1 >= chance + ABOVE_CHANCE), None)
    return Convergence(left, max(tail) - min(tail))


def convergence_table(table: Sequence[RowSummary], runs: Sequence[RunRecord], chance: Mapping[str, float]) -> str:
    """Per row, where each seed left chance and how far its last epochs moved, and the two checks a
    budget passes when every run has converged: every seed of a learning row (mean final top-1
    ABOVE_CHANCE points above chance) leaves chance by half the epochs, and the last LATE_SHARE of
    the epochs move every run's top-1 by less than LATE_MOVE points."""
    lines = [f'| model | chance (%) | learns | epoch each seed left chance | last {LATE_SHARE:.0%} of epochs: '
             'top-1 moved (points) |', '|---|---|---|---|---|']
    late_runs, slow_seeds = [], []
    for line in table:
        mine = [run for run in runs if run.row == line.row]
        found = [convergence(run.top1_per_epoch, chance[line.row]) for run in mine]
        learns = line.top1 >= chance[line.row] + ABOVE_CHANCE
        for run, seen in zip(mine, found):
            if not seen.converged():
                late_runs.append(f'{line.label} seed {run.seed} ({seen.late_move:.1f})')
            if learns and (seen.left_chance is None or seen.left_chance > len(run.top1_per_epoch) / 2):
                slow_seeds.append(f'{line.label} seed {run.seed}')
        left = ', '.join('-' if seen.left_chance is None else str(seen.left_chance) for seen in found)
        moved = ', '.join(f'{seen.late_move:.1f}' for seen in found)
        lines.append(f'| {line.label} | {chance[line.row]:.1f} | {"yes" if learns else "no"} | {left} | {moved} |')
    checks = [
        'every seed of a learning row left chance by half the epochs: '
        + ('yes' if not slow_seeds else 'no, not ' + ', '.join(slow_seeds)),
        f'the last {LATE_SHARE:.0%} of the epochs moved every run\'s top-1 by less than {LATE_MOVE:g} point: '
        + ('yes' if not late_runs else 'no, ' + ', '.join(late_runs)),
    ]
    return ('Convergence:\n\n' + '\n'.join(lines) + '\n' + _definitions([
        f'learns: the mean final top-1 is at least {ABOVE_CHANCE:g} points above chance (100 / classes)',
        f'left chance: the first epoch whose top-1 was at least {ABOVE_CHANCE:g} points above chance ("-": none)',
        f'moved: the highest minus the lowest top-1 over the last {LATE_SHARE:.0%} of the epochs and the epoch '
        'before them, per seed']) + '\n' + '\n'.join(f'Check: {check}.' for check in checks) + '\n')


class SizeTest(NamedTuple):
    """A test of every run at other sizes, without fine-tuning: its name (the run record's key), the
    study setting of its factors, tools/test.py's option, its folder in a run's and its figure, and the words of its
    table's heading for generated scenes and for a user's images (None: not for them)."""
    name: str
    factors_key: str
    option: str
    folder: str
    figure: str
    scenes: str
    images: Optional[str]


SIZE_TESTS = (
    SizeTest('size', 'test_size_factors', '--img-size', 'resolution', 'resolution.png',
             'scale: the same test scenes drawn smaller or larger', 'scale: the test images resized to each size'),
    SizeTest('extent', 'test_extent_factors', '--extent', 'extent', 'extent.png',
             'extent: test scenes of the training scale on a larger canvas (more tokens)', None),
)


def _definitions(lines: Sequence[str]) -> str:
    return '\n' + '\n'.join(f'- {line}' for line in lines) + '\n'


def main_table(table: Sequence[RowSummary], step_time_note: str) -> str:
    """Each row over its seeds, the columns defined under the table."""
    lines = ['| model | config | params (M) | epochs | final top-1 (%) | range | best-epoch top-1 (%) '
             f'| epochs to {TARGET_TOP1:g}% | step time (ms) | run time (min) |', '|---|---|---|---|---|---|---|---|---|---|']
    for line in table:
        spread = '-' if len(line.finals) < 2 else f'{max(line.finals) - min(line.finals):.1f}'
        reached = ', '.join('-' if epoch is None else str(epoch) for epoch in line.epochs_to_target)
        step_time = 'not measured' if line.step_time_ms is None else f'{line.step_time_ms:.0f}'
        lines.append(f'| {line.label} | `{line.config}` | {line.params_m:.2f} | {line.epochs} | {mean_std(line.finals)} '
                     f'| {spread} | {line.best_top1:.1f} | {reached} | {step_time} | {line.wall_min:.1f} |')
    return '\n'.join(lines) + '\n' + _definitions([
        'final top-1: validation top-1 after the last epoch; mean ± sample standard deviation over the seeds '
        '(their number in brackets)',
        'range: the highest final top-1 of the seeds minus the lowest',
        "best-epoch top-1: each seed's highest validation top-1 over the epochs, averaged over the seeds",
        f'epochs to {TARGET_TOP1:g}%: for each seed, the first epoch whose validation top-1 reached {TARGET_TOP1:g}% '
        '("-": none did)',
        f'step time: {step_time_note}',
        "run time: a run's training, wall clock, mean over the seeds (other jobs on the machine lengthen it)",
    ])


def ranking_table(table: Sequence[RowSummary], values: Mapping[str, Sequence[float]], equal_within: float,
                  what: str) -> str:
    """The rows ranked by mean ``what`` (``values``: per row, per seed), each against the next."""
    ranked = sorted(table, key=lambda line: statistics.fmean(values[line.row]), reverse=True)
    lines = [f'| rank | model | {what} (%) | minus the next (points) | {CONFIDENCE:.0%} interval | verdict |',
             '|---|---|---|---|---|---|']
    for rank, (line, below) in enumerate(zip(ranked, [*ranked[1:], None]), 1):
        cells = '| | |'
        if below is not None:
            verdict = compare(values[line.row], values[below.row], equal_within)
            interval = '-' if verdict.interval is None else f'[{verdict.interval[0]:+.1f}, {verdict.interval[1]:+.1f}]'
            cells = f'{verdict.difference:+.1f} | {interval} | {verdict.words}'
        lines.append(f'| {rank} | {line.label} | {mean_std(values[line.row])} | {cells} |')
    return '\n'.join(lines) + '\n' + _definitions([
        f'minus the next: the difference of the mean {what} of this row and of the row ranked below it',
        f"{CONFIDENCE:.0%} interval: Welch's t-interval of that difference over the seeds (given where both rows "
        f'have {MIN_SEEDS} seeds or more)',
        'apart: the interval excludes 0; '
        f'equal within {equal_within:g} points: the interval lies inside [-{equal_within:g}, +{equal_within:g}]; '
        "the seed decides: neither, with the seeds per row that would tell at the spreads seen",
    ])


def size_table(table: Sequence[RowSummary], runs: Sequence[RunRecord], test: SizeTest, factors: Sequence[float],
               generated: bool) -> str:
    """Top-1 per row at each size of ``test``, mean ± std over seeds; ``generated``: the test data
    are scenes drawn at each size (the embedded sets), else a user's images, resized."""
    sides = list(next(run.top1_at[test.name] for run in runs if test.name in run.top1_at))
    lines = [f'Top-1 (%) at each test size, without fine-tuning ({test.scenes if generated else test.images}):', '',
             '| model | ' + ' | '.join(f'{factor:g}x: {side} px' for factor, side in zip(factors, sides)) + ' |',
             '|---|' + '---|' * len(sides)]
    for line in table:
        mine = [run for run in runs if run.row == line.row]
        lines.append(f'| {line.label} | ' + ' | '.join(mean_std([run.top1_at[test.name][side] for run in mine])
                                                       for side in sides) + ' |')
    return '\n'.join(lines) + '\n' + _definitions([
        f'Nx: the test images at N times the side the row was tested at in training, {test.option} of tools/test.py, '
        'the model as trained; mean ± sample standard deviation of top-1 over the seeds'])


def nonlocality_table(table: Sequence[RowSummary]) -> str:
    """Ω of Φa and Φp per layer (means over heads and seeds) of the analysed rows; '' if none."""
    measured = [line for line in table if line.nonlocality]
    if not measured:
        return ''

    def cells(values):
        return ' '.join('-' if value is None else f'{value:.3g}' for value in values)
    lines = ['| model | Ω of Φa, layer 1 to last | Ω of Φp, layer 1 to last |', '|---|---|---|']
    lines += [f'| {line.label} | {cells(line.nonlocality["mixed"])} | {cells(line.nonlocality["position"])} |'
              for line in measured]
    return '\n'.join(lines) + '\n' + _definitions([
        'Ω (PerViT Eq. 13): 1/|P|² Σ Φ[q, k] ||q − k|| over the grid positions P, in tokens; for Φa, whose rows '
        'sum to 1, that is the mean attention distance divided by |P|; for Φp, the mean over pairs of its weight '
        'times the distance ("-": a layer without a positional bias); means over heads and seeds'])


def report_text(study_equal_within: float, table: Sequence[RowSummary], runs: Sequence[RunRecord],
                step_time_note: str, size_tests: Sequence[Tuple[SizeTest, Sequence[float]]], generated: bool,
                chance: Mapping[str, float]) -> str:
    """The whole of ``comparison.md``: the main table, Ω per layer, the ranking by final top-1, the
    convergence of the runs (``chance``: each row's chance top-1, %), and for each test at other sizes
    its table and the ranking at its largest size."""
    finals = {line.row: line.finals for line in table}
    parts = [main_table(table, step_time_note), nonlocality_table(table),
             'Ranking by final validation top-1:\n\n' + ranking_table(table, finals, study_equal_within, 'top-1'),
             convergence_table(table, runs, chance)]
    for test, factors in size_tests:
        largest = max(next(run.top1_at[test.name] for run in runs if test.name in run.top1_at), key=int)
        at_largest = {line.row: [run.top1_at[test.name][largest] for run in runs if run.row == line.row]
                      for line in table}
        parts += [size_table(table, runs, test, factors, generated),
                  f'Ranking at {largest} px ({test.option}):\n\n'
                  + ranking_table(table, at_largest, study_equal_within, f'top-1 at {largest} px')]
    return '\n'.join(part for part in parts if part)
