"""What a classifier's attention learned: PerViT's measures and figures for a config and checkpoint.

    python tools/analyze.py configs/pervit_t_shapes.py work_dirs/pervit_t_shapes/epoch_10.pth --out analysis/

Runs the config's validation images through the model (eval mode, no gradients) and writes to
``--out``: ``metrics.json`` (per layer and head: nonlocality Ω of Φp, Φc, Φa; impact Ψp, Ψc;
peripheral regions; see docs/analysis.md), ``position.png`` (Φp of the centre query, Fig. 4 of
the paper), ``samples.png`` (Φp, Φc, Φa on a few images, Fig. 6) and ``measures.png`` (Figs. 7, 8),
each titled with the config's and the checkpoint's names.
``--format pdf`` or ``svg`` writes the figures in that format instead, ``--dpi`` sets their resolution.

The checkpoint may be one that tools/train.py wrote (loaded strictly, as tools/test.py loads it: one
that does not fit the config's model is an error naming what it holds), or backbone weights in
posattn's or the PerViT release's layout (loaded as the backbone's ``Pretrained`` init, classifier
left out); without one, the initialised model is analysed.
"""
import argparse
import itertools
import json
from pathlib import Path
from typing import Optional

import torch
from _common import merge_options
from mmengine.config import Config, DictAction
from mmengine.registry import init_default_scope
from mmengine.runner import Runner
from mmengine.utils import ProgressBar

from posattn.analysis import (collect_attention_maps, measure_attention, plot_measures, plot_position_maps,
                              plot_sample_attention)
from posattn.analysis.figures import DEFAULT_DPI
from posattn_openmmlab.checkpoint import load_checkpoint_file, posattn_checkpoint_loading
from posattn_openmmlab.runner import load_model_weights


FIGURE_FORMATS = ('png', 'pdf', 'svg')


def positive_int(text: str) -> int:
    """argparse type: an integer above 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f'must be a positive integer, got {value}')
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Analyse the attention of a classifier (PerViT Sec. 4.1)')
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', nargs='?', help='checkpoint (default: the initialised model)')
    parser.add_argument('--out', help='output folder (default: work_dirs/<config name>/analysis)')
    parser.add_argument('--num-images', type=int, default=256, help='validation images to average over')
    parser.add_argument('--show-images', type=int, default=3, help='images in the samples figure')
    parser.add_argument('--query', type=int, nargs=2, metavar=('ROW', 'COL'),
                        help='query position on the token grid for the maps (default: the centre)')
    parser.add_argument('--format', default='png', choices=FIGURE_FORMATS,
                        help='file format of the figures (default: png; pdf and svg keep text and lines as vectors)')
    parser.add_argument('--dpi', type=positive_int, default=DEFAULT_DPI,
                        help=f'figure resolution in dots per inch (default: {DEFAULT_DPI}, a screen preview; '
                             'for pdf and svg, of the map images inside)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, help='override config entries, key=value')
    return parser.parse_args(argv)


def build_model(cfg: Config, checkpoint):
    """The config's classifier in eval mode, with the checkpoint's weights when one is given.

    Checkpoints load as ``PosattnRunner`` loads them, weights-only with mmengine's types allowed,
    those of ``init_cfg`` entries included (``posattn_checkpoint_loading``)."""
    from mmpretrain.registry import MODELS
    model_cfg = cfg.model.copy()
    if cfg.get('data_preprocessor') is not None:  # as mmengine's Runner does: the config's normalisation
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with posattn_checkpoint_loading():
        model = MODELS.build(model_cfg)
        if checkpoint is None:
            model.init_weights()
            return model.eval()
        loaded = load_checkpoint_file(checkpoint, map_location='cpu')
        if isinstance(loaded, dict) and 'state_dict' in loaded:  # written by tools/train.py (mmengine)
            load_model_weights(model, loaded, source=checkpoint,
                               target=f'{type(model).__name__} of {cfg.filename}')
        else:  # backbone weights, posattn or release layout
            model.init_weights()
            model.backbone.init_cfg = dict(type='Pretrained', checkpoint=checkpoint)
            model.backbone.init_weights()
    return model.eval()


def validation_images(loader, model, limit: int):
    """Batches of preprocessed validation images from ``loader``, ``limit`` images in all."""
    seen = 0
    for batch in loader:
        if seen >= limit:
            return
        inputs = model.data_preprocessor(batch, False)['inputs'][:limit - seen]
        seen += len(inputs)
        yield inputs


def figure_title(config: str, checkpoint: Optional[str]) -> str:
    """What the figures show the attention of: the config's and the checkpoint's file names."""
    weights = Path(checkpoint).name if checkpoint else 'initialised model (no checkpoint)'
    return f'{Path(config).stem}: {weights}'


def write_figures(out: Path, images, maps, measures, query, fmt: str, dpi: int, title: Optional[str] = None):
    """position, samples and measures figures as ``out/<name>.<fmt>`` (position only where a layer has
    a Φp with a position map: a logits bias, or positional probabilities it mixes in), each titled ``title``; returns the file names written."""
    figures = []
    if any(m.position is not None for m in maps.values()):
        figures.append(f'position.{fmt}')
        plot_position_maps(maps, out / figures[-1], query=query, title=title, dpi=dpi)
    figures.append(f'samples.{fmt}')
    plot_sample_attention(images, maps, out / figures[-1], query=query, title=title, dpi=dpi)
    figures.append(f'measures.{fmt}')
    plot_measures(measures, out / figures[-1], title=title, dpi=dpi)
    return figures


def main(argv=None):
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    try:
        merge_options(cfg, args.cfg_options)
    except ValueError as error:  # --cfg-options that disagree with the config's linked keys
        raise SystemExit(f'tools/analyze.py {args.config}: {error}') from None
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    out = Path(args.out or Path(cfg.get('work_dir') or Path('work_dirs') / Path(args.config).stem) / 'analysis')
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg, args.checkpoint)
    backbone = model.backbone

    loader = Runner.build_dataloader(cfg.val_dataloader)
    count = min(args.num_images, len(loader.dataset))
    if count < args.num_images:
        print(f'the validation split holds {len(loader.dataset)} images: analysing all of them '
              f'(--num-images {args.num_images})')
    progress = ProgressBar(count)

    def counted(batches):
        for images in batches:
            yield images
            progress.update(len(images))

    batches = validation_images(loader, model, count)
    first = next(batches)
    measures = measure_attention(backbone, counted(itertools.chain([first], batches)))
    shown = first[:args.show_images]
    maps = collect_attention_maps(backbone, shown)
    query = tuple(args.query) if args.query else None

    record = {'config': args.config, 'checkpoint': args.checkpoint, 'num_images': measures[0].num_samples,
              'layers': [m.to_dict() for m in measures]}
    (out / 'metrics.json').write_text(json.dumps(record, indent=1))
    figures = write_figures(out, shown, maps, measures, query, args.format, args.dpi,
                            title=figure_title(args.config, args.checkpoint))

    print(f'\nmeans over heads; {measures[0].num_samples} images, grid {measures[0].grid.height}x{measures[0].grid.width}')
    width = max(len(m.name) for m in measures) + 2
    print(f'{"layer":<{width}}{"Ω Φp":>10}{"Ω Φa":>10}{"Ψ Φp":>10}{"Ψ Φc":>10}  regions')
    for m in measures:
        cells = [m.nonlocality_position, m.nonlocality_mixed, m.impact_position, m.impact_content]
        text = ''.join(f'{"-" if c is None else format(c.mean().item(), ".3g"):>10}' for c in cells)
        print(f'{m.name:<{width}}{text}  {", ".join(m.regions) if m.regions else "-"}')
    print(f'wrote {out / "metrics.json"} and {", ".join(figures)}')


if __name__ == '__main__':
    with torch.no_grad():
        main()
