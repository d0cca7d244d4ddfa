"""The figures of PerViT's analyses (Figs. 4, 6, 7 and 8 of the paper), with matplotlib.

Each ``plot_*`` function draws one figure, writes it to ``path`` in the format of the path's
extension (``.png``, ``.pdf``, ``.svg``, or any other that matplotlib writes) at ``dpi`` dots per
inch, and returns the :class:`matplotlib.figure.Figure`. Maps that share a figure share one colour
scale from 0, shown by a labelled colour bar, so that their colours compare; per-head plots carry a
legend naming the heads.

matplotlib is imported when a figure is drawn, not with posattn: ``pip install matplotlib``.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from ..grid import TokenGrid
from .collect import AttentionMaps, LayerMeasures

__all__ = ['plot_position_maps', 'plot_sample_attention', 'plot_measures']

PathLike = Union[str, os.PathLike]
Query = Tuple[int, int]

DEFAULT_DPI = 80  # a screen-size preview; a paper wants .pdf / .svg, or dpi=300 for .png
MAP_COLOURS = 'viridis'


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError('posattn.analysis figures need matplotlib: pip install matplotlib') from None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


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


def _add_colorbar(fig, axes, scale, label: str):
    """A labelled colour bar for maps drawn on ``scale``, beside all of ``axes``."""
    from matplotlib.cm import ScalarMappable
    bar = fig.colorbar(ScalarMappable(norm=scale, cmap=MAP_COLOURS), ax=list(axes), fraction=0.025, pad=0.04,
                       aspect=40)
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return bar


def _save(fig, path: PathLike, dpi: float):
    """Write ``fig`` to ``path`` (format from the extension) and release it from pyplot."""
    fig.savefig(path, dpi=dpi, bbox_inches='tight')
    _pyplot().close(fig)
    return fig


def _hide_ticks(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def plot_position_maps(maps: Dict[str, AttentionMaps], path: PathLike, query: Optional[Query] = None,
                       dpi: float = DEFAULT_DPI):
    """Φp of one query (default: the grid centre) for every layer (rows) and head (columns), as Fig. 4.

    All maps share one colour scale, 0 to the largest Φp shown, so a flat map draws flat and the
    layers compare.

    Args:
        maps: :func:`~posattn.analysis.collect_attention_maps` output; layers without Φp are skipped.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        query: (row, col) of the query on the grid, marked with a cross.
        dpi: dots per inch (for ``.pdf`` and ``.svg``, of the map images inside).

    Returns:
        The :class:`matplotlib.figure.Figure`, already written and closed in pyplot.
    """
    layers = {name: m for name, m in maps.items() if m.position is not None}
    if not layers:
        raise ValueError('no layer has a position attention Φp (only Φp that add a logits bias do)')
    plt = _pyplot()
    heads = next(iter(layers.values())).position.shape[1]
    queries = {name: _query_index(layer.grid, query) for name, layer in layers.items()}
    images = {name: [_grid_image(layer.position[0, head, queries[name][1]], layer.grid) for head in range(heads)]
              for name, layer in layers.items()}
    scale = _shared_scale(image for row in images.values() for image in row)
    fig, axes = plt.subplots(len(layers), heads, figsize=(1.4 * heads + 0.8, 1.4 * len(layers)), squeeze=False)
    for row, name in enumerate(layers):
        (qr, qc), _ = queries[name]
        for head, ax in enumerate(axes[row]):
            ax.imshow(images[name][head], cmap=MAP_COLOURS, norm=scale)
            ax.plot(qc, qr, 'r+', markersize=5)
            _hide_ticks(ax)
            if row == 0:
                ax.set_title(f'head {head}', fontsize=8)
        axes[row, 0].set_ylabel(name, fontsize=7)
    _add_colorbar(fig, axes.flat, scale, 'Φp of the query (one scale for every layer and head)')
    return _save(fig, path, dpi)


# (AttentionMaps field, symbol, colour scale): Φc and Φa are probabilities, Φp a gate, not normalised
_KINDS = (('position', 'Φp', 'position'), ('content', 'Φc', 'probability'), ('mixed', 'Φa', 'probability'))
_SCALE_LABELS = {'position': 'Φp (one scale for every Φp map)',
                 'probability': 'attention probability (one scale for every Φc, Φa map)'}


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
    return {scale: _shared_scale(grouped[scale]) for scale in _SCALE_LABELS if scale in grouped}


def _draw_picture(ax, image: torch.Tensor, grid: TokenGrid, query: Optional[Query]) -> None:
    """The input image, min-max scaled, with the query's token marked."""
    (qr, qc), _ = _query_index(grid, query)
    picture = (image - image.min()) / (image.max() - image.min() + 1e-12)
    ax.imshow(picture.permute(1, 2, 0).squeeze(-1).numpy(), cmap='gray' if picture.shape[0] == 1 else None)
    scale_y, scale_x = image.shape[-2] / grid.height, image.shape[-1] / grid.width
    ax.plot((qc + 0.5) * scale_x, (qr + 0.5) * scale_y, 'r+', markersize=6)
    _hide_ticks(ax)


def plot_sample_attention(images: torch.Tensor, maps: Dict[str, AttentionMaps], path: PathLike,
                          layers: Optional[Sequence[str]] = None, query: Optional[Query] = None,
                          max_images: int = 4, dpi: float = DEFAULT_DPI):
    """For each image and chosen layer, Φp, Φc and Φa of one query in every head, as Fig. 6.

    Φc and Φa (attention probabilities) share one colour scale, and Φp (position gates, which are
    not normalised) another, each from 0 to the largest value shown, over all images, layers and
    heads.

    Args:
        images: (B, C, H, W) the images ``maps`` were collected on (shown min-max scaled).
        maps: :func:`~posattn.analysis.collect_attention_maps` output for those images.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        layers: layer names to show (default: up to three spread over the model).
        query: (row, col) on the token grid (default: the centre).
        max_images: images shown, from the start of the batch.
        dpi: dots per inch (for ``.pdf`` and ``.svg``, of the images inside).

    Returns:
        The :class:`matplotlib.figure.Figure`, already written and closed in pyplot.
    """
    names = list(maps)
    if layers is None:
        layers = [names[i] for i in sorted({0, len(names) // 2, len(names) - 1})]
    unknown = [name for name in layers if name not in maps]
    if unknown:
        raise ValueError(f'no maps for layers {unknown}; collected: {names}')
    plt = _pyplot()
    shown = images[:max_images].detach().float().cpu()
    heads = maps[layers[0]].content.shape[1]
    cells = _sample_cells(maps, layers, len(shown), heads, query)
    scales = _sample_scales(cells)
    rows = len(shown) * len(layers)
    fig, axes = plt.subplots(rows, 1 + 3 * heads, figsize=(1.2 * (1 + 3 * heads) + 1.6, 1.3 * rows), squeeze=False)
    for i, image in enumerate(shown):
        for j, name in enumerate(layers):
            row = axes[i * len(layers) + j]
            _draw_picture(row[0], image, maps[name].grid, query)
            row[0].set_ylabel(name, fontsize=6)
            for head in range(heads):
                for k, (kind, symbol, scale) in enumerate(_KINDS):
                    ax = row[1 + 3 * head + k]
                    _hide_ticks(ax)
                    if i == 0 and j == 0:
                        ax.set_title(f'{symbol} h{head}', fontsize=7)
                    if (i, name, head, kind) not in cells:
                        ax.axis('off')
                        continue
                    ax.imshow(cells[i, name, head, kind], cmap=MAP_COLOURS, norm=scales[scale])
    for scale, norm in scales.items():
        _add_colorbar(fig, axes.flat, norm, _SCALE_LABELS[scale])
    return _save(fig, path, dpi)


_SYMBOLS = {'position': 'Φp', 'content': 'Φc', 'mixed': 'Φa'}
_PANELS = (('nonlocality', ('position', 'content', 'mixed'), 'Ω (Eq. 13)'),
           ('impact', ('position', 'content'), 'Ψ (Eq. 12)'))


def plot_measures(measures: Sequence[LayerMeasures], path: PathLike, dpi: float = DEFAULT_DPI):
    """Ω of Φp, Φc, Φa and Ψ of Φp, Φc per layer: a bar per head and the layer mean as a line (Figs. 7, 8).

    One legend, beside the panels, names the heads' colours (the same in every panel) and the mean.

    Args:
        measures: :func:`~posattn.analysis.measure_attention` output.
        path: the file to write; its extension picks the format (``.png``, ``.pdf``, ``.svg``).
        dpi: dots per inch.

    Returns:
        The :class:`matplotlib.figure.Figure`, already written and closed in pyplot.
    """
    if not measures:
        raise ValueError('no layer measures to plot')
    plt = _pyplot()
    panels = [(f'{measure}_{kind}', f'{label} of {_SYMBOLS[kind]}')
              for measure, kinds, label in _PANELS for kind in kinds
              if getattr(measures[0], f'{measure}_{kind}') is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.6), squeeze=False)
    layers = torch.arange(len(measures), dtype=torch.float32).numpy()
    legend = {}  # label: an artist drawn in that style (the same in every panel)
    for ax, (key, title) in zip(axes[0], panels):
        values = torch.stack([getattr(m, key) for m in measures]).numpy()  # (layers, heads)
        heads = values.shape[1]
        width = 0.8 / heads
        for head in range(heads):
            legend[f'head {head}'] = ax.bar(layers - 0.4 + width * (head + 0.5), values[:, head], width=width,
                                            alpha=0.6, color=f'C{head}')
        legend['layer mean'], = ax.plot(layers, values.mean(1), 'k-o', markersize=3, linewidth=1.2)
        if key.startswith('impact') and values.max() > 20 * max(values.min(), 1e-12):
            ax.set_yscale('log')  # Ψ = 1 / ||Φa - Φ||_F explodes where Φa equals Φ
        ax.set_title(title, fontsize=9)
        ax.set_xlabel('layer', fontsize=8)
        ax.set_xticks(layers.tolist())
        ax.tick_params(labelsize=7)
    fig.legend(list(legend.values()), list(legend), loc='center left', bbox_to_anchor=(1.02, 0.5),
               bbox_transform=axes[0, -1].transAxes, fontsize=7)
    return _save(fig, path, dpi)
