"""The figures of PerViT's analyses (Figs. 4, 6, 7 and 8 of the paper) and of a training run, with matplotlib.

Each ``plot_*`` function draws one figure, writes it to ``path`` in the format of the path's
extension (``.png``, ``.pdf``, ``.svg``, or any other that matplotlib writes) at ``dpi`` dots per
inch, and returns the :class:`matplotlib.figure.Figure`. The figures are drawn with
:data:`FIGURE_STYLE`'s text sizes, set in an rc context inside each function: pyplot, the backend and
matplotlib's global rcParams are left as they are. Maps that share a figure share one colour scale
from 0, shown by a titled colour bar, so that their colours compare: Φp maps in
:data:`POSITION_COLOURS`, attention probabilities (Φc, Φa) in :data:`PROBABILITY_COLOURS`; per-head
plots carry a legend naming the heads.

matplotlib is imported when a figure is drawn, not with posattn: ``pip install matplotlib``.
"""
from __future__ import annotations

import functools
import math
import os
import re
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..grid import TokenGrid
from .collect import AttentionMaps, LayerMeasures

__all__ = ['plot_position_maps', 'plot_sample_attention', 'plot_measures', 'plot_training_curve']

PathLike = Union[str, os.PathLike]
Query = Tuple[int, int]

DEFAULT_DPI = 100  # a screen-size preview; a paper wants .pdf / .svg, or dpi=300 for .png
POSITION_COLOURS = 'viridis'  # Φp: position gates, not normalised
PROBABILITY_COLOURS = 'magma'  # Φc, Φa: attention probabilities
QUERY_MARK = dict(marker='+', color='red', markersize=9, markeredgewidth=1.5)
# Text sizes in points, readable at DEFAULT_DPI (matplotlib's defaults are 10 and 12)
FIGURE_STYLE = {'font.size': 11, 'axes.titlesize': 11, 'axes.labelsize': 11, 'xtick.labelsize': 10,
                'ytick.labelsize': 10, 'legend.fontsize': 10, 'figure.titlesize': 13}


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError('posattn.analysis figures need matplotlib: pip install matplotlib') from None
    return matplotlib


def _styled(draw):
    """``draw`` run inside a matplotlib rc context of :data:`FIGURE_STYLE`."""
    @functools.wraps(draw)
    def styled(*args, **kwargs):
        with _matplotlib().rc_context(FIGURE_STYLE):
            return draw(*args, **kwargs)
    return styled


def _figure(width: float, height: float):
    """A constrained-layout :class:`~matplotlib.figure.Figure` of ``width`` x ``height`` inches,
    made without pyplot (so nothing registers it, and no backend is chosen)."""
    _matplotlib()
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout='constrained')


def _query_index(grid: TokenGrid, query: Optional[Query]) -> Tuple[Query, int]:
    row, col = query if query is not None else (grid.height // 2, grid.width // 2)
    if not (0 <= row < grid.height and 0 <= col < grid.width):
        raise ValueError(f'query ({row}, {col}) is outside the {grid.height}x{grid.width} grid')
    return (row, col), row * grid.width + col


def _grid_image(values: torch.Tensor, grid: TokenGrid):
    """One map's (P,) values as an (H, W) array for imshow."""
    return values.view(grid.height, grid.width).float().cpu().numpy()


def _shared_scale(images: Iterable):
    """One colour scale for ``images``: from 0 (no attention, a closed gate) to their largest value."""
    from matplotlib.colors import Normalize
    return Normalize(vmin=0.0, vmax=max(float(image.max()) for image in images))


def _add_colorbar(fig, axes, scale, colours: str, title: str, label: str):
    """A colour bar for maps drawn on ``scale`` in ``colours``, beside all of ``axes``: ``title``
    (what the maps are) above it, ``label`` (how the scale is shared) along it."""
    from matplotlib.cm import ScalarMappable
    bar = fig.colorbar(ScalarMappable(norm=scale, cmap=colours), ax=list(axes), shrink=0.9, aspect=40)
    bar.ax.set_title(title, pad=8)
    bar.set_label(label)
    return bar


def _save(fig, path: PathLike, dpi: float):
    """Write ``fig`` to ``path`` (format from the extension)."""
    fig.savefig(path, dpi=dpi, bbox_inches='tight')
    return fig


def _layer_label(name: str) -> str:
    """A row label short enough to stand beside a map: 'block 11' for 'model.blocks.11.attn' (the
    block index of a model's attention), the module name itself otherwise."""
    found = re.search(r'(?:^|\.)blocks\.(\d+)\.', name)
    return f'block {found.group(1)}' if found else name


def _hide_ticks(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def _position_title(queries: Dict[str, Tuple[Query, int]], grids: Iterable[TokenGrid], title: Optional[str]) -> str:
    """What the Φp figure shows: the query's row and column (or the centre, where the layers' grids
    differ), and ``title`` (the model or checkpoint) on a second line."""
    cells = {cell for cell, _ in queries.values()}
    sizes = {f'{grid.height}x{grid.width}' for grid in grids}
    if len(cells) == 1:
        (row, col), = cells
        where = f'row {row}, column {col} of the {"/".join(sorted(sizes))} token grid'
    else:
        where = "the centre of each layer's token grid"
    return f'Φp of the query at {where}' + (f'\n{title}' if title else '')


@_styled
def plot_position_maps(maps: Dict[str, AttentionMaps], path: PathLike, query: Optional[Query] = None,
                       title: Optional[str] = None, dpi: float = DEFAULT_DPI):
    """Φp of one query (default: the grid centre) for every layer (rows) and head (columns), as Fig. 4.

    All maps share one colour scale, 0 to the largest Φp shown, so a flat map draws flat and the
    layers compare. The figure's title names the query's row and column, and ``title``.

    Args:
        maps: :func:`~posattn.analysis.collect_attention_maps` output; layers without Φp are skipped.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        query: (row, col) of the query on the grid, marked with a cross.
        title: what the maps come from, e.g. the checkpoint's name; a second line of the figure's title.
        dpi: dots per inch (for ``.pdf`` and ``.svg``, of the map images inside).

    Returns:
        The :class:`matplotlib.figure.Figure`, already written.
    """
    layers = {name: m for name, m in maps.items() if m.position is not None}
    if not layers:
        raise ValueError('no layer has a position attention Φp (only Φp that add a logits bias or mix in a '
                         'positional attention do)')
    heads = next(iter(layers.values())).position.shape[1]
    queries = {name: _query_index(layer.grid, query) for name, layer in layers.items()}
    images = {name: [_grid_image(layer.position[0, head, queries[name][1]], layer.grid) for head in range(heads)]
              for name, layer in layers.items()}
    scale = _shared_scale(image for row in images.values() for image in row)
    fig = _figure(1.5 * heads + 1.8, 1.5 * len(layers) + 1.0)
    axes = fig.subplots(len(layers), heads, squeeze=False)
    for row, name in enumerate(layers):
        (qr, qc), _ = queries[name]
        for head, ax in enumerate(axes[row]):
            ax.imshow(images[name][head], cmap=POSITION_COLOURS, norm=scale)
            ax.plot(qc, qr, **QUERY_MARK)
            _hide_ticks(ax)
            if row == 0:
                ax.set_title(f'head {head}')
        axes[row, 0].set_ylabel(_layer_label(name))
    _add_colorbar(fig, axes.flat, scale, POSITION_COLOURS, 'Φp',
                  'Φp of the query (one scale for every layer and head)')
    fig.suptitle(_position_title(queries, (layer.grid for layer in layers.values()), title))
    return _save(fig, path, dpi)


# (AttentionMaps field, symbol, colour scale): Φc and Φa are probabilities, Φp a gate, not normalised
_KINDS = (('position', 'Φp', 'position'), ('content', 'Φc', 'probability'), ('mixed', 'Φa', 'probability'))
# colour scale: (colour map, colour bar title, colour bar label)
_SCALES = {'position': (POSITION_COLOURS, 'Φp', 'Φp (one scale for every Φp map)'),
           'probability': (PROBABILITY_COLOURS, 'Φc, Φa', 'attention probability (one scale for every Φc, Φa map)')}


def _sample_cells(maps: Dict[str, AttentionMaps], layers: Sequence[str], num_images: int, heads: int,
                   query: Optional[Query]) -> Dict[Tuple[int, str, int, str], object]:
    """{(image, layer, head, kind): (H, W) array} of the query's map, for every map the layers have."""
    cells = {}
    for name in layers:
        layer = maps[name]
        _, index = _query_index(layer.grid, query)
        for kind, _, _ in _KINDS:
            source = getattr(layer, kind)
            if source is None:
                continue
            for i in range(num_images):
                for head in range(heads):
                    cells[i, name, head, kind] = _grid_image(source[min(i, source.shape[0] - 1), head, index],
                                                             layer.grid)
    return cells


def _sample_scales(cells: Dict[Tuple[int, str, int, str], object]) -> Dict[str, object]:
    """{'position' and / or 'probability': the colour scale shared by the ``cells`` drawn on it}."""
    scale_of = {kind: scale for kind, _, scale in _KINDS}
    grouped = {}
    for (*_, kind), image in cells.items():
        grouped.setdefault(scale_of[kind], []).append(image)
    return {scale: _shared_scale(grouped[scale]) for scale in _SCALES if scale in grouped}


def _draw_picture(ax, image: torch.Tensor, grid: TokenGrid, query: Optional[Query]) -> None:
    """The input image, min-max scaled, with the query's token marked."""
    (qr, qc), _ = _query_index(grid, query)
    picture = (image - image.min()) / (image.max() - image.min() + 1e-12)
    ax.imshow(picture.permute(1, 2, 0).squeeze(-1).numpy(), cmap='gray' if picture.shape[0] == 1 else None)
    scale_y, scale_x = image.shape[-2] / grid.height, image.shape[-1] / grid.width
    ax.plot((qc + 0.5) * scale_x, (qr + 0.5) * scale_y, **QUERY_MARK)
    _hide_ticks(ax)


@_styled
def plot_sample_attention(images: torch.Tensor, maps: Dict[str, AttentionMaps], path: PathLike,
                          layers: Optional[Sequence[str]] = None, query: Optional[Query] = None,
                          max_images: int = 4, title: Optional[str] = None, dpi: float = DEFAULT_DPI):
    """For each image and chosen layer, Φp, Φc and Φa of one query in every head, as Fig. 6.

    Φc and Φa (attention probabilities) share one colour scale and colour map, and Φp (position
    gates, which are not normalised) another, each from 0 to the largest value shown, over all
    images, layers and heads; each scale has its colour bar, titled with the maps it colours.

    Args:
        images: (B, C, H, W) the images ``maps`` were collected on (shown min-max scaled).
        maps: :func:`~posattn.analysis.collect_attention_maps` output for those images.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        layers: layer names to show (default: up to three spread over the model).
        query: (row, col) on the token grid (default: the centre).
        max_images: images shown, from the start of the batch.
        title: what the maps come from, e.g. the checkpoint's name; the figure's title.
        dpi: dots per inch (for ``.pdf`` and ``.svg``, of the images inside).

    Returns:
        The :class:`matplotlib.figure.Figure`, already written.
    """
    names = list(maps)
    if layers is None:
        layers = [names[i] for i in sorted({0, len(names) // 2, len(names) - 1})]
    unknown = [name for name in layers if name not in maps]
    if unknown:
        raise ValueError(f'no maps for layers {unknown}; collected: {names}')
    shown = images[:max_images].detach().float().cpu()
    heads = maps[layers[0]].content.shape[1]
    cells = _sample_cells(maps, layers, len(shown), heads, query)
    scales = _sample_scales(cells)
    rows = len(shown) * len(layers)
    fig = _figure(1.25 * (1 + 3 * heads) + 2.6, 1.3 * rows + 0.8)
    axes = fig.subplots(rows, 1 + 3 * heads, squeeze=False)
    for i, image in enumerate(shown):
        for j, name in enumerate(layers):
            row = axes[i * len(layers) + j]
            _draw_picture(row[0], image, maps[name].grid, query)
            row[0].set_ylabel(f'image {i}, {_layer_label(name)}', fontsize='small')
            for head in range(heads):
                for k, (kind, symbol, scale) in enumerate(_KINDS):
                    ax = row[1 + 3 * head + k]
                    _hide_ticks(ax)
                    if i == 0 and j == 0:
                        ax.set_title(f'{symbol} h{head}')
                    if (i, name, head, kind) not in cells:
                        ax.axis('off')
                        continue
                    ax.imshow(cells[i, name, head, kind], cmap=_SCALES[scale][0], norm=scales[scale])
    for scale, norm in scales.items():
        _add_colorbar(fig, axes.flat, norm, *_SCALES[scale])
    if title:
        fig.suptitle(title)
    return _save(fig, path, dpi)


_SYMBOLS = {'position': 'Φp', 'content': 'Φc', 'mixed': 'Φa'}
# Each panel's y axis: the quantity and its unit. Ω (Eq. 13) sums Φ[q, k] ||q - k|| over the pairs and
# divides by |P|^2: of Φc and Φa, whose rows sum to 1, that is the mean attention distance over |P|;
# of Φp, whose values are weights (exp of the bias, a sigmoid for peripheral), the mean over pairs of
# weight times distance.
_AXES = {'nonlocality_position': 'Ω: pair mean of Φp x distance (tokens)',
         'nonlocality_content': 'Ω: mean attention distance / |P| (tokens)',
         'nonlocality_mixed': 'Ω: mean attention distance / |P| (tokens)',
         'impact_position': 'Ψ = 1 / ||Φa - Φp||_F (no unit)',
         'impact_content': 'Ψ = 1 / ||Φa - Φc||_F (no unit)'}
# (measure, the maps it is taken of, symbol and equation)
_PANELS = (('nonlocality', ('position', 'content', 'mixed'), 'Ω (Eq. 13)'),
           ('impact', ('position', 'content'), 'Ψ (Eq. 12)'))
# Ψ grows without bound as Φa approaches the map (a Φp that adds nothing leaves Φa = Φc): bars are drawn
# up to this and marked where the value is larger, which metrics.json keeps as it is.
IMPACT_SHOWN = 1e3


@_styled
def plot_measures(measures: Sequence[LayerMeasures], path: PathLike, title: Optional[str] = None,
                  dpi: float = DEFAULT_DPI):
    """Ω of Φp, Φc, Φa (top row) and Ψ of Φp, Φc (bottom row) per layer: a bar per head and the
    layer mean as a line (Figs. 7, 8).

    Each panel's axis gives its unit (:data:`_AXES`: Ω of Φc and Φa is the mean attention distance
    over |P|, Ω of Φp a pair mean of weight times distance); Ψ, one over a Frobenius distance between
    maps, has no unit and no bound (Φa equal to the map gives infinity): bars above
    :data:`IMPACT_SHOWN` are cut there and hatched, the panel says so. One legend, beside the panels,
    names the heads' colours (the same in every panel) and the mean.

    Args:
        measures: :func:`~posattn.analysis.measure_attention` output.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        title: what was measured, e.g. the checkpoint's name; the figure's title.
        dpi: dots per inch.

    Returns:
        The :class:`matplotlib.figure.Figure`, already written.
    """
    if not measures:
        raise ValueError('no layer measures to plot')
    panel_rows = [[(f'{measure}_{kind}', f'{symbol} of {_SYMBOLS[kind]}', _AXES[f'{measure}_{kind}']) for kind in kinds
                   if getattr(measures[0], f'{measure}_{kind}') is not None]
                  for measure, kinds, symbol in _PANELS]
    panel_rows = [row for row in panel_rows if row]
    columns = max(len(row) for row in panel_rows)
    fig = _figure(3.6 * columns + 1.4, 3.0 * len(panel_rows) + (0.4 if title else 0))
    axes = fig.subplots(len(panel_rows), columns, squeeze=False)
    layers = torch.arange(len(measures), dtype=torch.float32).numpy()
    legend = {}  # label: an artist drawn in that style (the same in every panel)
    for axes_row, panels in zip(axes, panel_rows):
        for ax in axes_row[len(panels):]:
            ax.axis('off')
        for ax, (key, panel_title, y_label) in zip(axes_row, panels):
            values = torch.stack([getattr(m, key) for m in measures]).numpy()  # (layers, heads)
            cut = key.startswith('impact') and values.max() > IMPACT_SHOWN
            if cut:
                values = values.clip(max=IMPACT_SHOWN)
                panel_title += f'\n(bars at {IMPACT_SHOWN:g}, hatched: larger; Φa = map gives infinity)'
            heads = values.shape[1]
            width = 0.8 / heads
            for head in range(heads):
                legend[f'head {head}'] = bars = ax.bar(layers - 0.4 + width * (head + 0.5), values[:, head],
                                                       width=width, alpha=0.6, color=f'C{head}')
                for bar, value in zip(bars, values[:, head]):
                    if cut and value >= IMPACT_SHOWN:
                        bar.set_hatch('///')
            legend['layer mean'], = ax.plot(layers, values.mean(1), 'k-o', markersize=3, linewidth=1.2)
            if key.startswith('impact') and values.max() > 20 * max(values.min(), 1e-12):
                ax.set_yscale('log')  # Ψ = 1 / ||Φa - Φ||_F explodes where Φa equals Φ
            ax.set_title(panel_title)
            ax.set_xlabel('layer')
            ax.set_ylabel(y_label)
            ax.set_xticks(layers.tolist()[::max(1, math.ceil(len(measures) / 12))])
    fig.legend(list(legend.values()), list(legend), loc='outside right center')
    if title:
        fig.suptitle(title)
    return _save(fig, path, dpi)


@_styled
def plot_training_curve(losses: Mapping[int, float], validations: Mapping[str, Mapping[float, float]],
                        path: PathLike, validation_unit: str = 'epoch', title: Optional[str] = None,
                        dpi: float = DEFAULT_DPI):
    """A training run: the training loss per logged iteration (left) and each validation metric per
    validation (right; left out when nothing was validated).

    The loss is drawn on a log axis where it spans more than a decade. Metrics that were not logged
    at some validations are drawn at those that logged them.

    Args:
        losses: {iteration: training loss}, e.g. every ``interval`` iterations as mmengine logs it.
        validations: {metric name: {epoch or iteration: value}}; metrics without a value are skipped.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        validation_unit: what the keys of ``validations`` count, ``'epoch'`` or ``'iteration'``.
        title: the figure's title, e.g. the config's name.
        dpi: dots per inch.

    Returns:
        The :class:`matplotlib.figure.Figure`, already written.
    """
    if validation_unit not in ('epoch', 'iteration'):
        raise ValueError(f"validation_unit must be 'epoch' or 'iteration', got {validation_unit!r}")
    metrics = {name: dict(sorted(points.items())) for name, points in validations.items() if points}
    if not losses and not metrics:
        raise ValueError('nothing to plot: no training loss and no validation metric')
    fig = _figure(5.0 * (bool(losses) + bool(metrics)) + 0.4, 3.8 + (0.4 if title else 0))
    axes = iter(fig.subplots(1, bool(losses) + bool(metrics), squeeze=False)[0])
    if losses:
        _draw_losses(next(axes), losses)
    if metrics:
        _draw_validations(next(axes), metrics, validation_unit)
    if title:
        fig.suptitle(title)
    return _save(fig, path, dpi)


def _draw_losses(ax, losses: Mapping[int, float]) -> None:
    """The training loss per iteration, on ``ax``."""
    from matplotlib.ticker import MaxNLocator
    iterations, values = zip(*sorted(losses.items()))
    ax.plot(iterations, values, '-', marker='o' if len(values) < 30 else None, markersize=3, linewidth=1.2)
    if min(values) > 0 and max(values) > 10 * min(values):
        ax.set_yscale('log')
    ax.set(title='training loss', xlabel='iteration', ylabel='loss')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_validations(ax, metrics: Mapping[str, Mapping[float, float]], validation_unit: str) -> None:
    """Each validation metric per validation, on ``ax``: a legend where there are several."""
    from matplotlib.ticker import MaxNLocator
    for name, points in metrics.items():
        ax.plot(list(points), list(points.values()), '-o', markersize=4, linewidth=1.2, label=name)
    ax.set(title='validation', xlabel=validation_unit, ylabel=next(iter(metrics)) if len(metrics) == 1 else 'metric')
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(metrics) > 1:
        ax.legend()
