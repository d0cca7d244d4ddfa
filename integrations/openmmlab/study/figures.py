"""A study's figures: validation top-1 per epoch (a colour per row, a line style per seed), final
top-1 against cost, Ω per layer of the analysed rows, and top-1 at each test size."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import List, Mapping, NamedTuple, Optional, Sequence

from mmengine.config import Config

from .records import RunRecord
from .report import RowSummary, SizeTest

__all__ = ['FigureLabels', 'figure_labels', 'dataset_name', 'comparison_figure', 'size_figure', 'row_colours',
           'save_figure']

SEED_STYLES = ('-', '--', ':', '-.', (0, (5, 1)), (0, (1, 3)), (0, (3, 1, 1, 1, 1, 1)))


class FigureLabels(NamedTuple):
    """What the figures say about the data and the cost axis."""
    dataset: str  # the data's name, the curves' title
    chance_top1: List[float]  # 100 / the classes, per distinct number of classes
    step_time_axis: Optional[str]  # the cost axis where steps were timed; None: parameters


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


def figure_labels(configs: Mapping[str, Config], step_time_axis: Optional[str]) -> FigureLabels:
    names = dict.fromkeys(dataset_name(cfg) for cfg in configs.values())
    classes = dict.fromkeys(cfg.model.head.num_classes for cfg in configs.values())
    return FigureLabels(' / '.join(names), [100 / count for count in classes], step_time_axis)


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def row_colours(count: int) -> list:
    """A distinct colour per row: matplotlib's default cycle for up to ten rows, its tab20 up to twenty,
    else colours spread over its turbo map."""
    import matplotlib
    if count <= 10:
        return [f'C{index}' for index in range(count)]
    if count <= 20:
        return list(matplotlib.colormaps['tab20'].colors[:count])
    return [matplotlib.colormaps['turbo'](index / (count - 1)) for index in range(count)]


def _curves(axis, runs: Sequence[RunRecord], table: Sequence[RowSummary], colours: Mapping[str, object],
            labels: FigureLabels) -> None:
    """Top-1 per epoch, a curve per run: the row's colour, a line style per seed, with a legend of both."""
    from matplotlib.lines import Line2D
    seeds = sorted({run.seed for run in runs})
    styles = {seed: SEED_STYLES[index % len(SEED_STYLES)] for index, seed in enumerate(seeds)}
    for run in runs:
        axis.plot(range(1, len(run.top1_per_epoch) + 1), run.top1_per_epoch, color=colours[run.row],
                  linestyle=styles[run.seed], marker='.', markersize=3, linewidth=1.1)
    handles = [Line2D([], [], color=colours[line.row], label=line.label) for line in table]
    if len(seeds) > 1:
        handles += [Line2D([], [], color='black', linestyle=styles[seed], label=f'seed {seed}') for seed in seeds]
    for chance in labels.chance_top1:
        handles.append(axis.axhline(chance, color='grey', linestyle=':', linewidth=1, label=f'chance ({chance:.3g}%)'))
    axis.set(xlabel='epoch', ylabel='validation top-1 (%)', title=labels.dataset)
    axis.legend(handles=handles, fontsize=7)


def comparison_figure(runs: Sequence[RunRecord], table: Sequence[RowSummary], labels: FigureLabels):
    """Validation top-1 per epoch, final top-1 against the measured step time (against parameters
    where not timed) and, for analysed rows, Ω per layer of Φa and of Φp, each in its own unit."""
    plt = _pyplot()
    measured = [line for line in table if line.nonlocality]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.6)) if measured else plt.subplots(1, 2, figsize=(10, 3.8))
    axes = list(axes.flatten())
    colours = dict(zip((line.row for line in table), row_colours(len(table))))
    _curves(axes[0], runs, table, colours, labels)
    timed = labels.step_time_axis is not None
    for index, line in enumerate(table):  # labels alternately above and below, so neighbours do not overlap
        x = line.step_time_ms if timed else line.params_m
        axes[1].scatter(x, line.top1, color=colours[line.row], s=40)
        axes[1].annotate(f'{line.label}\n{line.params_m:.1f} M', (x, line.top1), fontsize=7,
                         xytext=(4, 4 if index % 2 == 0 else -20), textcoords='offset points')
    axes[1].set(xlabel=labels.step_time_axis if timed else 'parameters (M)', ylabel='final validation top-1 (%)',
                title='accuracy vs. cost' if timed else 'accuracy vs. size (step time not measured)')
    axes[1].margins(0.25)
    units = {'mixed': 'tokens / |P| (mean attention distance / |P|)', 'position': 'tokens (pair mean of weight x distance)'}
    for axis, key, name in ((axes[2], 'mixed', 'Φa'), (axes[3], 'position', 'Φp')) if measured else ():
        for line in measured:
            values = line.nonlocality[key]
            if None not in values:
                axis.plot(range(1, len(values) + 1), values, color=colours[line.row], marker='.', label=line.label)
        axis.set(xlabel='layer', ylabel=f'Ω of {name} (Eq. 13), {units[key]}',
                 title=f'{name}, mean over heads and seeds')
        axis.legend(fontsize=7)
    fig.tight_layout()
    return fig


def size_figure(table: Sequence[RowSummary], runs: Sequence[RunRecord], test: SizeTest, factors: Sequence[float],
                labels: FigureLabels, axis_words: str):
    """Top-1 against the test size (times the training size) per row: the mean over seeds as a line,
    the seeds' lowest to highest as a band."""
    plt = _pyplot()
    from posattn.analysis.figures import FIGURE_STYLE
    sides = list(next(run.top1_at[test.name] for run in runs if test.name in run.top1_at))
    with plt.rc_context(FIGURE_STYLE):
        fig, axis = plt.subplots(figsize=(11, 5.2))
        for line, colour in zip(table, row_colours(len(table))):
            per_seed = [[run.top1_at[test.name][side] for side in sides] for run in runs if run.row == line.row]
            by_size = list(zip(*per_seed))
            axis.plot(factors, [statistics.fmean(values) for values in by_size], color=colour, marker='o',
                      label=f'{line.label} ({len(per_seed)} seeds)')
            axis.fill_between(factors, [min(values) for values in by_size], [max(values) for values in by_size],
                              color=colour, alpha=0.15, linewidth=0)
        axis.axvline(1.0, color='grey', linewidth=1, linestyle=':')
        for chance in labels.chance_top1:
            axis.axhline(chance, color='grey', linewidth=1, linestyle=':', label=f'chance ({chance:.3g}%)')
        axis.set_xticks(factors, [f'{factor:g}x\n{side} px' for factor, side in zip(factors, sides)])
        axis.set(xlabel=f'{axis_words}, times the training size (no fine-tuning)', ylabel='validation top-1 (%)',
                 title=f'{labels.dataset}: mean over seeds, band from lowest to highest')
        axis.legend(fontsize=9, loc='upper left', bbox_to_anchor=(1.01, 1))  # beside the axes, clear of the lines
        fig.tight_layout()
    return fig


def save_figure(fig, path: Path, dpi: int) -> None:
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
