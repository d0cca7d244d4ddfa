"""The figures of PerViT's analyses (Figs. 4, 6, 7 and 8 of the paper) as PNG files, with matplotlib.

matplotlib is imported when a figure is drawn, not with posattn: ``pip install matplotlib``.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from ..grid import TokenGrid
from .collect import AttentionMaps, LayerMeasures

__all__ = ['plot_position_maps', 'plot_sample_attention', 'plot_measures']

PathLike = Union[str, os.PathLike]
Query = Tuple[int, int]


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


def _save(fig, path: PathLike) -> None:
    fig.savefig(path, dpi=80, bbox_inches='tight')
    _pyplot().close(fig)


def _hide_ticks(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def plot_position_maps(maps: Dict[str, AttentionMaps], path: PathLike, query: Optional[Query] = None) -> None:
    """Φp of one query (default: the grid centre) for every layer (rows) and head (columns), as Fig. 4.

    Args:
        maps: :func:`~posattn.analysis.collect_attention_maps` output; layers without Φp are skipped.
        path: the PNG to write.
        query: (row, col) of the query on the grid, marked with a cross.
    """
    layers = {name: m for name, m in maps.items() if m.position is not None}
    if not layers:
        raise ValueError('no layer has a position attention Φp (only Φp that add a logits bias do)')
    plt = _pyplot()
    heads = next(iter(layers.values())).position.shape[1]
    fig, axes = plt.subplots(len(layers), heads, figsize=(1.4 * heads, 1.4 * len(layers)), squeeze=False)
    for row, (name, layer) in enumerate(layers.items()):
        (qr, qc), index = _query_index(layer.grid, query)
        for head in range(heads):
            ax = axes[row, head]
            ax.imshow(_grid_image(layer.position[0, head, index], layer.grid), cmap='viridis', vmin=0)
            ax.plot(qc, qr, 'r+', markersize=5)
            _hide_ticks(ax)
            if row == 0:
                ax.set_title(f'head {head}', fontsize=8)
        axes[row, 0].set_ylabel(name, fontsize=7)
    _save(fig, path)


def plot_sample_attention(images: torch.Tensor, maps: Dict[str, AttentionMaps], path: PathLike,
                          layers: Optional[Sequence[str]] = None, query: Optional[Query] = None,
                          max_images: int = 4) -> None:
    """For each image and chosen layer, Φp, Φc and Φa of one query in every head, as Fig. 6.

    Args:
        images: (B, C, H, W) the images ``maps`` were collected on (shown min-max scaled).
        maps: :func:`~posattn.analysis.collect_attention_maps` output for those images.
        path: the PNG to write.
        layers: layer names to show (default: up to three spread over the model).
        query: (row, col) on the token grid (default: the centre).
        max_images: images shown, from the start of the batch.
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
    kinds = ('Φp', 'Φc', 'Φa')
    rows = len(shown) * len(layers)
    fig, axes = plt.subplots(rows, 1 + 3 * heads, figsize=(1.2 * (1 + 3 * heads), 1.3 * rows), squeeze=False)
    for i, image in enumerate(shown):
        picture = (image - image.min()) / (image.max() - image.min() + 1e-12)
        for j, name in enumerate(layers):
            layer = maps[name]
            (qr, qc), index = _query_index(layer.grid, query)
            row = axes[i * len(layers) + j]
            row[0].imshow(picture.permute(1, 2, 0).squeeze(-1).numpy(), cmap='gray' if picture.shape[0] == 1 else None)
            scale_y, scale_x = image.shape[-2] / layer.grid.height, image.shape[-1] / layer.grid.width
            row[0].plot((qc + 0.5) * scale_x, (qr + 0.5) * scale_y, 'r+', markersize=6)
            row[0].set_ylabel(name, fontsize=6)
            _hide_ticks(row[0])
            for head in range(heads):
                for kind, source in enumerate((layer.position, layer.content, layer.mixed)):
                    ax = row[1 + 3 * head + kind]
                    _hide_ticks(ax)
                    if i == 0 and j == 0:
                        ax.set_title(f'{kinds[kind]} h{head}', fontsize=7)
                    if source is None:
                        ax.axis('off')
                        continue
                    sample = source[min(i, source.shape[0] - 1), head, index]
                    ax.imshow(_grid_image(sample, layer.grid), cmap='viridis')
    _save(fig, path)


_SYMBOLS = {'position': 'Φp', 'content': 'Φc', 'mixed': 'Φa'}
_PANELS = (('nonlocality', ('position', 'content', 'mixed'), 'Ω (Eq. 13)'),
           ('impact', ('position', 'content'), 'Ψ (Eq. 12)'))


def plot_measures(measures: Sequence[LayerMeasures], path: PathLike) -> None:
    """Ω of Φp, Φc, Φa and Ψ of Φp, Φc per layer: a bar per head and the layer mean as a line (Figs. 7, 8)."""
    if not measures:
        raise ValueError('no layer measures to plot')
    plt = _pyplot()
    panels = [(f'{measure}_{kind}', f'{label} of {_SYMBOLS[kind]}')
              for measure, kinds, label in _PANELS for kind in kinds
              if getattr(measures[0], f'{measure}_{kind}') is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.6), squeeze=False)
    layers = torch.arange(len(measures), dtype=torch.float32).numpy()
    for ax, (key, title) in zip(axes[0], panels):
        values = torch.stack([getattr(m, key) for m in measures]).numpy()  # (layers, heads)
        heads = values.shape[1]
        width = 0.8 / heads
        for head in range(heads):
            ax.bar(layers - 0.4 + width * (head + 0.5), values[:, head], width=width, alpha=0.6)
        ax.plot(layers, values.mean(1), 'k-o', markersize=3, linewidth=1.2)
        if key.startswith('impact') and values.max() > 20 * max(values.min(), 1e-12):
            ax.set_yscale('log')  # Ψ = 1 / ||Φa - Φ||_F explodes where Φa equals Φ
        ax.set_title(title, fontsize=9)
        ax.set_xlabel('layer', fontsize=8)
        ax.set_xticks(layers.tolist())
        ax.tick_params(labelsize=7)
    _save(fig, path)
