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
  gives 438 -> 384, as DeiT and CPVT evaluate at 384.

Any other test data, and detectors and segmentors, are an error naming the ``--cfg-options`` keys
that size the images, to set by hand.

The runner is built without the config's training parts, so it takes no work_dir lock and writes
only its own log folder (config dump included): it can evaluate a checkpoint of a training that
is running in the same work_dir.
"""
import argparse
import copy
import json
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from _common import add_runner_arguments, build_runner, load_config, parse_runner_arguments
from mmengine.config import Config
from mmengine.dist import is_main_process
from mmpretrain.models import BaseClassifier
from mmpretrain.registry import MODELS

# Config keys that size a dataset's images, in the dataset and in its pipeline's transforms
SIZE_KEYS = ('img_size', 'scale', 'crop_size', 'size')
TEST_DATASET = 'test_dataloader.dataset'
IMG_SIZE_HELP = (
    "evaluate at N x N (or H x W) pixels, without fine-tuning. The model is built as the config says (a "
    "learned position embedding keeps its trained grid and is resampled to the new one in the forward pass); "
    "the test data are rewritten: PositionalShapes is generated at N x N (the same scenes, shapes scaled "
    "with the image); a test pipeline with ResizeEdge then CenterCrop crops N and resizes the short edge to N "
    "times the config's resize / crop ratio (256 / 224: 384 gives 438 -> 384), bicubic. Other test data, "
    "detectors and segmentors: an error naming the --cfg-options to set by hand")

Size = Tuple[int, int]  # (height, width) in pixels


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Evaluate a checkpoint with mmengine; it must fit the config's model (or pass --partial-load)")
    parser.add_argument('config', help='config file')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--out', help='write the metrics, and the image size they were measured at '
                                      '(img_size: [height, width]), to this JSON file')
    parser.add_argument('--img-size', type=int, nargs='+', metavar='N', help=IMG_SIZE_HELP)
    add_runner_arguments(parser)
    args = parse_runner_arguments(parser, argv)
    if args.img_size is not None:
        try:
            args.img_size = image_size(args.img_size)
        except ValueError as error:
            parser.error(str(error))
    return args


def image_size(values: Sequence[int]) -> Size:
    """``--img-size``'s N or H W as (height, width)."""
    if len(values) not in (1, 2) or min(values) < 1:
        raise ValueError(f'--img-size takes one side N or a height and a width H W, in pixels >= 1; got '
                         f'{" ".join(map(str, values))}')
    return (values[0], values[-1])


def _transform_type(transform: Mapping[str, Any]) -> str:
    """A transform's type without its scope ('mmpretrain.ResizeEdge' -> 'ResizeEdge')."""
    return str(transform.get('type', '')).split('.')[-1]


def size_keys(dataset: Mapping[str, Any], prefix: str = TEST_DATASET) -> List[str]:
    """The ``--cfg-options`` keys of a dataset config that size its images (:data:`SIZE_KEYS`), in
    the dataset and its pipeline's transforms, e.g. ``test_dataloader.dataset.pipeline.2.crop_size``."""
    keys = [f'{prefix}.{key}' for key in SIZE_KEYS if key in dataset]
    for index, transform in enumerate(dataset.get('pipeline') or ()):
        keys += [f'{prefix}.pipeline.{index}.{key}' for key in SIZE_KEYS if key in transform]
    return keys


def resize_crop_indices(pipeline: Sequence[Mapping[str, Any]]) -> Optional[Tuple[int, int]]:
    """The indices of a short-edge ``ResizeEdge`` and of the ``CenterCrop`` after it, the only
    transforms of ``pipeline`` that size its images; None for any other pipeline."""
    sizing = [i for i, transform in enumerate(pipeline) if any(key in transform for key in SIZE_KEYS)]
    if len(sizing) != 2:
        return None
    resize, crop = sizing
    if (_transform_type(pipeline[resize]), _transform_type(pipeline[crop])) != ('ResizeEdge', 'CenterCrop') \
            or pipeline[resize].get('edge', 'short') != 'short':
        return None
    return resize, crop


def _crop_hw(crop_size: Any) -> Size:
    """mmcv's ``crop_size`` (a side, or (width, height)) as (height, width)."""
    return (crop_size, crop_size) if isinstance(crop_size, int) else (crop_size[1], crop_size[0])


def resized_pipeline(pipeline: Sequence[Mapping[str, Any]], size: Size) -> List[dict]:
    """A copy of an evaluation pipeline that resizes the short edge and crops the centre
    (:func:`resize_crop_indices`), giving ``size`` (height, width) images: the crop is ``size``, the
    short edge floor(max(size) x the pipeline's resize / crop ratio), bicubic; the other
    transforms as they are. 256 / 224 (DeiT's crop ratio 0.875) with 384 gives 438 -> 384."""
    indices = resize_crop_indices(pipeline)
    if indices is None:
        raise ValueError('the pipeline does not resize the short edge (ResizeEdge) and then crop the centre '
                         '(CenterCrop) alone')
    resize, crop = indices
    pipeline = copy.deepcopy([dict(transform) for transform in pipeline])
    short_edge, longest_crop = pipeline[resize]['scale'], max(_crop_hw(pipeline[crop]['crop_size']))
    pipeline[resize].update(scale=max(size) * short_edge // longest_crop, interpolation='bicubic')
    height, width = size
    pipeline[crop]['crop_size'] = height if height == width else (width, height)
    return pipeline


def config_test_size(cfg: Config) -> Optional[Size]:
    """(height, width) of the images the config's test split gives, where :func:`set_test_size`
    knows its data; None otherwise."""
    dataset = cfg.test_dataloader.dataset
    if _transform_type(dataset) == 'PositionalShapes':
        return (dataset.img_size,) * 2 if 'img_size' in dataset else None  # None: the dataset's default
    indices = resize_crop_indices(dataset.get('pipeline') or ())
    return None if indices is None else _crop_hw(dataset.pipeline[indices[1]].crop_size)


def _by_hand(dataset: Mapping[str, Any]) -> str:
    """The ``--cfg-options`` that set the size of ``dataset``'s images, to fill in."""
    keys = size_keys(dataset)
    return '--cfg-options ' + (' '.join(f'{key}=...' for key in keys) if keys else f'{TEST_DATASET}...')


def _require_classifier(cfg: Config) -> None:
    model_type = cfg.model.get('type')
    model_cls = MODELS.get(model_type) if isinstance(model_type, str) else model_type
    if not (isinstance(model_cls, type) and issubclass(model_cls, BaseClassifier)):
        raise ValueError(f'--img-size evaluates classifiers (mmpretrain\'s ImageClassifier and the like); this '
                         f'config\'s model is {model_type}. Set the test size of a detector or segmentor by hand: '
                         f'{_by_hand(cfg.test_dataloader.dataset)}')


def set_test_size(cfg: Config, size: Size) -> str:
    """Rewrites ``cfg.test_dataloader`` to give ``size`` (height, width) images (see the module's
    docstring); returns what it changed, in words. A ValueError names what it cannot rewrite and
    the keys to set by hand."""
    _require_classifier(cfg)
    dataset, before = cfg.test_dataloader.dataset, _in_words(config_test_size(cfg))
    if _transform_type(dataset) == 'PositionalShapes':
        if size[0] != size[1]:
            raise ValueError(f'PositionalShapes draws square images: give one side, --img-size {size[0]}; got '
                             f'{_in_words(size)}')
        dataset.img_size = size[0]
        return (f'the PositionalShapes test split generated at {_in_words(size)} pixels (the config\'s: {before}), '
                f'the same scenes')
    pipeline = dataset.get('pipeline') or ()
    indices = resize_crop_indices(pipeline)
    if indices is None:
        raise ValueError(f'--img-size cannot rewrite this config\'s test data, a {dataset.get("type")} whose '
                         f'pipeline is [{", ".join(_transform_type(t) for t in pipeline)}]: it rewrites '
                         f'PositionalShapes (img_size) and test pipelines that resize the short edge (ResizeEdge) '
                         f'and crop the centre (CenterCrop). Set the size by hand: {_by_hand(dataset)}')
    dataset.pipeline = resized_pipeline(pipeline, size)
    resize = indices[0]
    return (f'the test pipeline\'s ResizeEdge to a short edge of {dataset.pipeline[resize].scale} (the config\'s: '
            f'{pipeline[resize].scale}), bicubic, and its CenterCrop to {_in_words(size)} (the config\'s: {before})')


def _in_words(size: Optional[Size]) -> str:
    return 'unknown' if size is None else f'{size[0]} x {size[1]}'


def build_config(args) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    cfg.resume = False
    # evaluation only: no training parts, so the runner neither locks nor writes the work_dir's files
    cfg.train_dataloader = cfg.train_cfg = cfg.optim_wrapper = cfg.param_scheduler = None
    if args.amp:
        cfg.test_cfg = dict(cfg.get('test_cfg') or {}, fp16=True)
    return cfg


def main(argv=None):
    args = parse_args(argv)
    cfg = build_config(args)
    config_size, change = config_test_size(cfg), None
    if args.img_size is not None:
        try:
            change = set_test_size(cfg, args.img_size)
        except ValueError as error:
            raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    size = config_test_size(cfg)
    runner = build_runner(cfg)
    if change:
        runner.logger.info(f'--img-size {args.img_size[0]} {args.img_size[1]}: {change}; the model as the config '
                           f'builds it, without fine-tuning')
    metrics = runner.test()
    if is_main_process():
        where = '' if size is None else f' at {_in_words(size)} pixels'
        if change:
            where += f', without fine-tuning (the config\'s test size: {_in_words(config_size)})'
        print(f'\nMetrics{where}: ' + ', '.join(f'{k}: {v:.4g}' for k, v in metrics.items()))
        if args.out:
            with open(args.out, 'w') as f:  # mmseg's metrics are numpy scalars
                json.dump({**{k: v.item() if hasattr(v, 'item') else v for k, v in metrics.items()},
                           'img_size': None if size is None else list(size)}, f, indent=2)
    return metrics


if __name__ == '__main__':
    main()
