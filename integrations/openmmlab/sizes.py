"""The size of a classifier's test images, read from its config and rewritten to another size.

:func:`config_test_size` reads the (height, width) a config's test split gives; :func:`set_test_size`
rewrites the test split to give another size, without touching the model (``tools/test.py
--img-size``), and :func:`set_test_extent` draws PositionalRelations scenes on a larger canvas at the
training scale (``--extent``). What each rewrites is in ``tools/test.py``'s docstring and
docs/your-data.md.
"""
from __future__ import annotations

import copy
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from mmengine.config import Config
from mmpretrain.models import BaseClassifier
from mmpretrain.registry import MODELS

from .linked_settings import LINKED_KEYS, resolved_key
from .relations_dataset import MIN_CANVAS

__all__ = ['Size', 'GENERATED', 'config_test_size', 'set_test_size', 'set_test_extent', 'in_words', 'size_keys',
           'resized_pipeline', 'pipeline_size']

# Config keys that size a dataset's images, in the dataset and in its pipeline's transforms
SIZE_KEYS = ('img_size', 'scale', 'crop_size', 'size')
GENERATED = ('PositionalShapes', 'PositionalRelations')  # the embedded sets, generated at any img_size
TEST_DATASET = 'test_dataloader.dataset'
# Transforms that give images of one size, by type: (the key of that size, whether a pair in it is
# (height, width); mmcv's Resize takes (width, height), mmpretrain's RandomResizedCrop (height, width))
FIXED_SIZE_TRANSFORMS = {'Resize': ('scale', False), 'RandomResizedCrop': ('scale', True)}

Size = Tuple[int, int]  # (height, width) in pixels


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
    dataset, before = cfg.test_dataloader.dataset, in_words(config_test_size(cfg))
    kind = _transform_type(dataset)
    if kind in GENERATED:
        if size[0] != size[1]:
            raise ValueError(f'{kind} draws square images: give one side, --img-size {size[0]}; got '
                             f'{in_words(size)}')
        dataset.img_size = size[0]
        return (f'the {kind} test split generated at {in_words(size)} pixels (the config\'s: {before}), '
                f'the same scenes')
    pipeline = dataset.get('pipeline') or ()
    fixed, indices = fixed_size_index(pipeline), resize_crop_indices(pipeline)
    if fixed is None and indices is None:
        return _set_linked_test_size(cfg, size)
    dataset.pipeline = resized_pipeline(pipeline, size)
    if fixed is not None:
        return (f'the test pipeline\'s {_transform_type(pipeline[fixed])} to {in_words(size)} (the config\'s: '
                f'{before})')
    resize = indices[0]
    return (f'the test pipeline\'s ResizeEdge to a short edge of {dataset.pipeline[resize].scale} (the config\'s: '
            f'{pipeline[resize].scale}), bicubic, and its CenterCrop to {in_words(size)} (the config\'s: {before})')


def _set_linked_test_size(cfg: Config, size: Size) -> str:
    """Sets the test split's sizing keys to ``size`` where the config links every one of them to its
    ``img_size``; else a ValueError naming the keys linked to nothing and how to link them."""
    dataset = cfg.test_dataloader.dataset
    sizing, linked = size_keys(dataset), _linked_test_keys(cfg)
    unlinked = [key for key in sizing if key not in linked]
    if sizing and not unlinked and size[0] == size[1]:
        cfg.merge_from_dict(dict.fromkeys(linked, size[0]))
        return (f'the test keys the config links to img_size ({", ".join(linked)}) to {size[0]} (the config\'s: '
                f'{cfg.get("img_size")})')
    if sizing and not unlinked:
        raise ValueError(f'the test keys the config links to img_size ({", ".join(linked)}) take one side: '
                         f'--img-size {max(size)}; got {in_words(size)}')
    pipeline = dataset.get('pipeline') or ()
    typed = [_typed_key(key, pipeline) for key in unlinked]
    raise ValueError(f'--img-size cannot rewrite this config\'s test data, a {dataset.get("type")} whose pipeline is '
                     f'[{", ".join(_transform_type(t) for t in pipeline)}]: it rewrites PositionalShapes (img_size), '
                     f'test pipelines that resize the short edge (ResizeEdge) and crop the centre (CenterCrop), '
                     f'those whose one sizing transform is a Resize without keep_ratio or a RandomResizedCrop, and '
                     f'those whose sizing keys the config links to img_size (square sizes). '
                     + (f'Link {", ".join(typed)} to img_size too (the config\'s linked_keys[\'img_size\']): then '
                        f'--img-size sets them' if unlinked and linked else
                        f'Set the size by hand: {_by_hand(dataset)}'))


def _typed_key(key: str, pipeline: Sequence[Mapping[str, Any]]) -> str:
    """``test_dataloader.dataset.pipeline.2.size`` as ``...pipeline.Pad.size``: its transform by its type."""
    head, index, name = key.rsplit('.', 2)
    return f'{head}.{_transform_type(pipeline[int(index)])}.{name}' if index.isdigit() else key


def _linked_test_keys(cfg: Config) -> List[str]:
    """The test split's keys the config links to its ``img_size`` (its ``linked_keys``), as
    ``--cfg-options`` writes them, where the config has them."""
    keys = [key for key in (cfg.get(LINKED_KEYS) or {}).get('img_size', ()) if key.startswith('test_dataloader.')]
    return [resolved for resolved in (resolved_key(cfg, key) for key in keys) if resolved is not None]


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
    before = in_words(config_test_size(cfg))
    dataset.img_size = dataset.canvas = side
    return (f'the PositionalRelations test split drawn on a canvas of {side} x {side} pixels at the training scale '
            f'(the config\'s images: {before})')


def in_words(size: Optional[Size]) -> str:
    return 'unknown' if size is None else f'{size[0]} x {size[1]}'
