"""Evaluate a checkpoint: ``python tools/test.py configs/pervit_t_shapes.py work_dirs/.../epoch_12.pth``.

Runs the config's ``test_dataloader`` / ``test_evaluator`` with mmengine; multi-GPU through
torchrun (``--launcher pytorch``). Prints the metrics and the image size they were measured at
(where the tool can read it from the config), and writes both as JSON with ``--out``.

The checkpoint loads strictly: one that does not fit the config's model is an error listing the
differing keys and, for posattn's models, naming the model the checkpoint holds. ``--partial-load``
evaluates with the weights that fit and logs every key it skipped.

``--img-size N`` (or ``H W``) evaluates a classifier at another input size, without fine-tuning
(CPVT's Table 3, "@384 without fine-tuning"). The model is built as the config says: its
``img_size`` is the grid its learned position embedding was trained on, which the checkpoint holds,
and the embedding is resampled to each input's grid in the forward pass (posattn's ViT, mmpretrain's
ViT); relative Φp and PerViT's are computed for the grid they see. The test data are rewritten:

* ``PositionalShapes`` (the embedded set) is generated at N x N: the same scenes, the shapes scaled
  with the image, only the pixel noise drawn afresh;
* a test pipeline that resizes the short edge and crops the centre (``ResizeEdge``, then
  ``CenterCrop``: DeiT's and CPVT's evaluation) crops N and resizes the short edge to N times the
  config's ratio of the two, floored, bicubic: 256 / 224 in every ImageNet config here, so 384
  gives 438 -> 384, as DeiT and CPVT evaluate at 384;
* a test pipeline whose one sizing transform gives images of a fixed size (``Resize`` to a
  ``scale`` without ``keep_ratio``, ``RandomResizedCrop``) gives them at N x N instead;
* any other test pipeline whose sizing keys the config links to its ``img_size`` (``linked_keys``)
  has them set to N.

Any other test data, and detectors and segmentors, are an error naming the keys that size the
images: those to link to ``img_size``, or to set by hand.

``--extent N`` tests the extent of a classifier trained on ``PositionalRelations``: its test scenes
are drawn on a canvas of N x N pixels at the training scale (the shapes keep their pixel sizes;
more tokens), where ``--img-size N`` draws the same scenes scaled. The two are exclusive.

A size the test cannot fit in memory is an error before any test data are made
(:func:`posattn_openmmlab.evaluation.check_test_fits`): a batch of its images, or the attention of one image.

The size printed with the metrics and written to ``--out`` (``img_size``) is that of the images the
model was tested on, however it was set (``--img-size``, the config, ``--cfg-options``): null where
they were not all of one size.

Test data whose classes differ from those the checkpoint was trained on (which mmengine records in
it) stop the test before its first batch, with an error naming the classes that differ
(:class:`~posattn_openmmlab.class_checks.TrainedClassesCheck`): their labels would stand for other
classes than the model's outputs.

The runner is built without the config's training parts, so it takes no work_dir lock and writes
only its own log folder (config dump included): it can evaluate a checkpoint of a training that
is running in the same work_dir.
"""
import argparse
import json
from typing import Sequence

from _common import add_runner_arguments, leave_process_group, load_config, parse_runner_arguments
from mmengine.dist import is_main_process

from posattn_openmmlab.class_checks import ClassCountMismatch, TrainedClassesMismatch
from posattn_openmmlab.data_checks import EmptyImageFiles
from posattn_openmmlab.evaluation import evaluate_checkpoint
from posattn_openmmlab.sizes import Size, config_test_size, in_words

IMG_SIZE_HELP = (
    "evaluate at N x N (or H x W) pixels, without fine-tuning. The model is built as the config says (a "
    "learned position embedding keeps its trained grid and is resampled to the new one in the forward pass); "
    "the test data are rewritten: PositionalShapes is generated at N x N (the same scenes, shapes scaled "
    "with the image); a test pipeline with ResizeEdge then CenterCrop crops N and resizes the short edge to N "
    "times the config's resize / crop ratio (256 / 224: 384 gives 438 -> 384), bicubic; one whose only sizing "
    "transform is a Resize without keep_ratio or a RandomResizedCrop resizes to N x N; one whose sizing keys the "
    "config links to img_size has them set to N. Other test data, detectors and segmentors: an error naming the keys "
    "to link or to set by hand")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Evaluate a checkpoint with mmengine; it must fit the config's model (or pass --partial-load)")
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out', help='write the metrics, and the image size they were measured at '
                                      '(img_size: [height, width]), to this JSON file')
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument('--img-size', type=int, nargs='+', metavar='N', help=IMG_SIZE_HELP)
    sizes.add_argument('--extent', type=int, metavar='N',
                       help='PositionalRelations only: draw the test scenes on an N x N canvas at the training scale '
                            '(the shapes keep their pixel sizes, the image has more tokens), without fine-tuning')
    add_runner_arguments(parser)
    args = parse_runner_arguments(parser, argv)
    if args.img_size is not None:
        try:
            args.img_size = image_size(args.img_size)
        except ValueError as error:
            parser.error(str(error))
    if args.extent is not None and args.extent < 1:
        parser.error(f'--extent takes a canvas side in pixels >= 1; got {args.extent}')
    return args


def image_size(values: Sequence[int]) -> Size:
    """``--img-size``'s N or H W as (height, width)."""
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f'--img-size takes one side N or a height and a width H W, in pixels >= 1; got '
                         f'{" ".join(map(str, values))}')
    return (values[0], values[-1])


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ValueError as error:
        raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    config_size = config_test_size(cfg)
    option = None if args.img_size is None and args.extent is None else (
        f'--img-size {args.img_size[0]} {args.img_size[1]}' if args.extent is None else f'--extent {args.extent}')
    try:
        result = evaluate_checkpoint(cfg, args.checkpoint, size=args.img_size, extent=args.extent, fp16=args.amp,
                                     asked_by=option or 'the test size')
    except (ValueError, ClassCountMismatch, TrainedClassesMismatch, EmptyImageFiles) as error:
        raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    except MemoryError as error:
        raise SystemExit(f'tools/test.py {args.config}: {option} cannot be tested here: {error}. The config '
                         f'tests at {in_words(config_size)}') from None
    if is_main_process():
        where = '' if result.img_size is None else f' at {in_words(result.img_size)} pixels'
        if result.change:
            where += f', without fine-tuning (the config\'s test size: {in_words(config_size)})'
        print(f'\nMetrics{where}: ' + ', '.join(f'{k}: {v:.4g}' for k, v in result.metrics.items()))
        if args.out:
            with open(args.out, 'w') as f:  # mmseg's metrics are numpy scalars
                json.dump({**{k: v.item() if hasattr(v, 'item') else v for k, v in result.metrics.items()},
                           'img_size': None if result.img_size is None else list(result.img_size),
                           'extent': args.extent}, f, indent=2)
    leave_process_group()
    return result.metrics


if __name__ == '__main__':
    main()
