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
  ``scale`` without ``keep_ratio``, ``RandomResizedCrop``) gives them at N x N instead.

Any other test data, and detectors and segmentors, are an error naming the ``--cfg-options`` keys
that size the images, to set by hand.

``--extent N`` tests the extent of a classifier trained on ``PositionalRelations``: its test scenes
are drawn on a canvas of N x N pixels at the training scale (the shapes keep their pixel sizes;
more tokens), where ``--img-size N`` draws the same scenes scaled. The two are exclusive.

A size the test cannot fit in memory is an error before any test data are made (:func:`check_test_fits`): a batch of its images, or the attention of one image.

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
import copy
import json
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch
from _common import add_runner_arguments, build_runner, leave_process_group, load_config, parse_runner_arguments
from mmengine.config import Config
from mmengine.dist import all_gather_object, is_main_process
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmpretrain.models import BaseClassifier
from mmpretrain.registry import MODELS
from torch import nn

from posattn._memory import check_fits
from posattn.attention import LogitsProbe
from posattn_openmmlab.class_checks import ClassCountMismatch, TrainedClassesCheck, TrainedClassesMismatch
from posattn_openmmlab.data_checks import EmptyImageFiles
from posattn_openmmlab.relations_dataset import MIN_CANVAS

# Config keys that size a dataset's images, in the dataset and in its pipeline's transforms
SIZE_KEYS = ('img_size', 'scale', 'crop_size', 'size')
GENERATED = ('PositionalShapes', 'PositionalRelations')  # the embedded sets, generated at any img_size
TEST_DATASET = 'test_dataloader.dataset'
IMG_SIZE_HELP = (
    "evaluate at N x N (or H x W) pixels, without fine-tuning. The model is built as the config says (a "
    "learned position embedding keeps its trained grid and is resampled to the new one in the forward pass); "
    "the test data are rewritten: PositionalShapes is generated at N x N (the same scenes, shapes scaled "
    "with the image); a test pipeline with ResizeEdge then CenterCrop crops N and resizes the short edge to N "
    "times the config's resize / crop ratio (256 / 224: 384 gives 438 -> 384), bicubic; one whose only sizing "
    "transform is a Resize without keep_ratio or a RandomResizedCrop resizes to N x N. Other test data, "
    "detectors and segmentors: an error naming the --cfg-options to set by hand")
# Transforms that give images of one size, by type: (the key of that size, whether a pair in it is
# (height, width); mmcv's Resize takes (width, height), mmpretrain's RandomResizedCrop (height, width))
FIXED_SIZE_TRANSFORMS = {'Resize': ('scale', False), 'RandomResizedCrop': ('scale', True)}

Size = Tuple[int, int]  # (height, width) in pixels


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


def fixed_size_index(pipeline: Sequence[Mapping[str, Any]]) -> Optional[int]:
    """The index of ``pipeline``'s one transform that sizes its images, where that transform gives
    them all one size (:data:`FIXED_SIZE_TRANSFORMS`: a ``Resize`` to a ``scale`` without
    ``keep_ratio``, a ``RandomResizedCrop``); None for any other pipeline."""
    sizing = [i for i, transform in enumerate(pipeline) if any(key in transform for key in SIZE_KEYS)]
    if len(sizing) != 1:
        return None
    transform = pipeline[sizing[0]]
    kind = _transform_type(transform)
    if kind not in FIXED_SIZE_TRANSFORMS or FIXED_SIZE_TRANSFORMS[kind][0] not in transform:
        return None
    if kind == 'Resize' and transform.get('keep_ratio'):
        return None
    return sizing[0]


def _as_hw(value: Any, height_first: bool) -> Size:
    """A transform's size (a side, or a pair in its order) as (height, width)."""
    if isinstance(value, int):
        return (value, value)
    return (value[0], value[1]) if height_first else (value[1], value[0])


def _from_hw(size: Size, height_first: bool) -> Any:
    """(height, width) as a transform states it: a side where square, else a pair in its order."""
    height, width = size
    if height == width:
        return height
    return (height, width) if height_first else (width, height)


def _crop_hw(crop_size: Any) -> Size:
    """mmcv's ``crop_size`` (a side, or (width, height)) as (height, width)."""
    return _as_hw(crop_size, height_first=False)


def resized_pipeline(pipeline: Sequence[Mapping[str, Any]], size: Size) -> List[dict]:
    """A copy of an evaluation pipeline that gives ``size`` (height, width) images, the other
    transforms as they are. One that resizes the short edge and crops the centre
    (:func:`resize_crop_indices`): the crop is ``size``, the short edge floor(max(size) x the
    pipeline's resize / crop ratio), bicubic; 256 / 224 (DeiT's crop ratio 0.875) with 384 gives
    438 -> 384. One whose sizing transform gives a fixed size (:func:`fixed_size_index`): that
    transform gives ``size``."""
    pipeline = copy.deepcopy([dict(transform) for transform in pipeline])
    fixed = fixed_size_index(pipeline)
    if fixed is not None:
        key, height_first = FIXED_SIZE_TRANSFORMS[_transform_type(pipeline[fixed])]
        pipeline[fixed][key] = _from_hw(size, height_first)
        return pipeline
    indices = resize_crop_indices(pipeline)
    if indices is None:
        raise ValueError('the pipeline neither resizes the short edge (ResizeEdge) and then crops the centre '
                         '(CenterCrop) alone, nor sizes its images with one Resize (without keep_ratio) or '
                         'RandomResizedCrop')
    resize, crop = indices
    short_edge, longest_crop = pipeline[resize]['scale'], max(_crop_hw(pipeline[crop]['crop_size']))
    pipeline[resize].update(scale=max(size) * short_edge // longest_crop, interpolation='bicubic')
    pipeline[crop]['crop_size'] = _from_hw(size, height_first=False)
    return pipeline


def pipeline_size(pipeline: Sequence[Mapping[str, Any]]) -> Optional[Size]:
    """(height, width) of the images a pipeline gives, where :func:`resized_pipeline` can rewrite it;
    None otherwise."""
    fixed = fixed_size_index(pipeline)
    if fixed is not None:
        key, height_first = FIXED_SIZE_TRANSFORMS[_transform_type(pipeline[fixed])]
        return _as_hw(pipeline[fixed][key], height_first)
    indices = resize_crop_indices(pipeline)
    return None if indices is None else _crop_hw(pipeline[indices[1]]['crop_size'])


def config_test_size(cfg: Config) -> Optional[Size]:
    """(height, width) of the images the config's test split gives, where :func:`set_test_size`
    knows its data; None otherwise."""
    dataset = cfg.test_dataloader.dataset
    if _transform_type(dataset) in GENERATED:
        return (dataset.img_size,) * 2 if 'img_size' in dataset else None  # None: the dataset's default
    return pipeline_size(dataset.get('pipeline') or ())


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
    kind = _transform_type(dataset)
    if kind in GENERATED:
        if size[0] != size[1]:
            raise ValueError(f'{kind} draws square images: give one side, --img-size {size[0]}; got '
                             f'{_in_words(size)}')
        dataset.img_size = size[0]
        return (f'the {kind} test split generated at {_in_words(size)} pixels (the config\'s: {before}), '
                f'the same scenes')
    pipeline = dataset.get('pipeline') or ()
    fixed, indices = fixed_size_index(pipeline), resize_crop_indices(pipeline)
    if fixed is None and indices is None:
        raise ValueError(f'--img-size cannot rewrite this config\'s test data, a {dataset.get("type")} whose '
                         f'pipeline is [{", ".join(_transform_type(t) for t in pipeline)}]: it rewrites '
                         f'PositionalShapes (img_size), test pipelines that resize the short edge (ResizeEdge) '
                         f'and crop the centre (CenterCrop), and those whose one sizing transform is a Resize '
                         f'without keep_ratio or a RandomResizedCrop. Set the size by hand: {_by_hand(dataset)}')
    dataset.pipeline = resized_pipeline(pipeline, size)
    if fixed is not None:
        return (f'the test pipeline\'s {_transform_type(pipeline[fixed])} to {_in_words(size)} (the config\'s: '
                f'{before})')
    resize = indices[0]
    return (f'the test pipeline\'s ResizeEdge to a short edge of {dataset.pipeline[resize].scale} (the config\'s: '
            f'{pipeline[resize].scale}), bicubic, and its CenterCrop to {_in_words(size)} (the config\'s: {before})')


def set_test_extent(cfg: Config, side: int) -> str:
    """Rewrites ``cfg.test_dataloader`` (PositionalRelations) to draw its scenes on a ``side`` x
    ``side`` canvas at the training scale; returns what it changed, in words. A ValueError for any
    other test data."""
    _require_classifier(cfg)
    dataset = cfg.test_dataloader.dataset
    if _transform_type(dataset) != 'PositionalRelations':
        raise ValueError(f'--extent draws PositionalRelations scenes on a larger canvas; this config tests on '
                         f'{dataset.get("type")}: use --img-size, which scales the test images')
    if side < MIN_CANVAS:
        raise ValueError(f'--extent {side}: a canvas must be >= {MIN_CANVAS} pixels to hold three targets apart')
    before = _in_words(config_test_size(cfg))
    dataset.img_size = dataset.canvas = side
    return (f'the PositionalRelations test split drawn on a canvas of {side} x {side} pixels at the training scale '
            f'(the config\'s images: {before})')


def _in_words(size: Optional[Size]) -> str:
    return 'unknown' if size is None else f'{size[0]} x {size[1]}'


class _AttentionChecked(Exception):
    """Stops :func:`check_test_fits`'s probe at the first attention layer, once its memory check passed."""


def _stop_probe(module: nn.Module, args: Any, output: Any) -> None:
    raise _AttentionChecked


def check_test_fits(model: nn.Module, size: Size, batch_size: int, fp16: bool = False) -> None:
    """Raise a MemoryError naming what cannot fit where testing at ``size`` (height, width) needs more
    memory than the model's device has available, before any test data are made:

    * a test batch as the model takes it, ``batch_size`` x 3 x height x width in float32;
    * the attention of one image: posattn's attention layers check, before they compute them, the
      (heads, N, N) terms a call needs (the Φp's logits bias, the probabilities where they are
      formed; :class:`posattn.Attention`), and one image of zeros at ``size`` is passed through the
      model as far as its first attention layer's check (the stem, and that layer's Φp, are
      computed; no further). A model without posattn's attention is not probed.

    Terms below 1 GiB are not checked.
    """
    module = model.module if is_model_wrapper(model) else model
    device = next(module.parameters()).device
    height, width = size
    check_fits(batch_size * 3 * height * width * 4, device,
               f'a test batch of {batch_size} images at {height} x {width} pixels (float32)', 'test at a smaller size')
    probes = [m for m in module.modules() if isinstance(m, LogitsProbe)]
    if not probes:
        return
    hooks = [probe.register_forward_hook(_stop_probe) for probe in probes]
    training = module.training
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            module.eval().extract_feat(torch.zeros(1, 3, height, width, device=device))
    except _AttentionChecked:
        pass
    finally:
        for hook in hooks:
            hook.remove()
        module.train(training)


def build_config(args) -> Config:
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    cfg.resume = False
    # evaluation only: no training parts, so the runner neither locks nor writes the work_dir's files
    cfg.train_dataloader = cfg.train_cfg = cfg.optim_wrapper = cfg.param_scheduler = None
    if args.amp:
        cfg.test_cfg = dict(cfg.get('test_cfg') or {}, fp16=True)
    return cfg


class TestedImageSizes(Hook):
    """The (height, width) of every image tested, on every process, as the data loader gives them
    (before the data preprocessor, which may pad a batch)."""

    def __init__(self):
        self.sizes = set()

    def after_test_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.sizes.update(tuple(image.shape[-2:]) for image in (data_batch or {}).get('inputs', ()))

    def size(self) -> Optional[Size]:
        """The one size every process's images had; None where they differ (or none was seen)."""
        sizes = set().union(*all_gather_object(sorted(self.sizes)))
        return tuple(int(side) for side in sizes.pop()) if len(sizes) == 1 else None


def main(argv=None):
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as error:
        raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    config_size, change = config_test_size(cfg), None
    test_size = args.img_size if args.extent is None else (args.extent, args.extent)
    option = (f'--img-size {test_size[0]} {test_size[1]}' if args.extent is None else f'--extent {args.extent}') \
        if test_size is not None else None
    if test_size is not None:
        try:
            change = set_test_size(cfg, test_size) if args.extent is None else set_test_extent(cfg, args.extent)
        except ValueError as error:
            raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    runner = build_runner(cfg)
    if test_size is not None:
        try:
            check_test_fits(runner.model, test_size, cfg.test_dataloader.batch_size, fp16=args.amp)
        except MemoryError as error:
            raise SystemExit(f'tools/test.py {args.config}: {option} cannot be tested here: {error}. The config '
                             f'tests at {_in_words(config_size)}') from None
    if change:
        runner.logger.info(f'{option}: {change}; the model as the config builds it, without fine-tuning')
    runner.register_hook(TrainedClassesCheck())
    tested = TestedImageSizes()
    runner.register_hook(tested, priority='LOWEST')
    try:
        metrics = runner.test()
    except (ClassCountMismatch, TrainedClassesMismatch, EmptyImageFiles) as error:
        raise SystemExit(f'tools/test.py {args.config}: {error}') from None
    size = tested.size()
    if is_main_process():
        where = '' if size is None else f' at {_in_words(size)} pixels'
        if change:
            where += f', without fine-tuning (the config\'s test size: {_in_words(config_size)})'
        print(f'\nMetrics{where}: ' + ', '.join(f'{k}: {v:.4g}' for k, v in metrics.items()))
        if args.out:
            with open(args.out, 'w') as f:  # mmseg's metrics are numpy scalars
                json.dump({**{k: v.item() if hasattr(v, 'item') else v for k, v in metrics.items()},
                           'img_size': None if size is None else list(size), 'extent': args.extent}, f, indent=2)
    leave_process_group()
    return metrics


if __name__ == '__main__':
    main()
