"""mmpretrain datasets: the embedded positional-shapes and positional-relations sets, ImageNet with
a clear error when absent, iNaturalist 2019 in its published layout, and a class-balanced subsample
of any classification dataset."""
from __future__ import annotations

import json
import os
from typing import Any, List, Mapping, Optional, Tuple, Union

import numpy as np
from mmengine.logging import print_log
from mmpretrain.datasets import BaseDataset, ImageNet
from mmpretrain.registry import DATASETS

from ._compat import set_default_classes
from .data_checks import require_data
from .relations_dataset import CLASSES as RELATIONS_CLASSES
from .relations_dataset import TRAIN_CANVAS, render_relations
from .shapes_dataset import CLASSES as SHAPES_CLASSES
from .shapes_dataset import render_shapes

__all__ = ['PositionalShapes', 'PositionalRelations', 'CheckedImageNet', 'INaturalist2019', 'SubsampledDataset']

EMBEDDED_CONFIG = 'configs/pervit_t_shapes.py'
IMAGENET_LAYOUT = """  {data_root}/train/<wnid>/*.JPEG  (e.g. train/n01440764/n01440764_10026.JPEG)
  {data_root}/val/<wnid>/*.JPEG, or val/*.JPEG with meta/val.txt (mmpretrain's layout)"""
INATURALIST_LAYOUT = """  {data_root}/train2019.json, {data_root}/val2019.json  (images, annotations, categories)
  {data_root}/train_val2019/<supercategory>/<category id>/*.jpg  (the file_name of each image)"""


class _GeneratedScenes(BaseDataset):
    """An embedded set generated in memory when the dataset is built, which logs one line
    (mmengine's current logger): deterministic, no files, no download. The train and val splits
    come from different seeds, so they share no image.

    Args:
        split: 'train' or 'val'.
        num_images: images in the split.
        img_size: image side in pixels.
        seed: base seed; each split offsets it.
        **kwargs: mmpretrain ``BaseDataset`` options (``pipeline``, ``test_mode``, ``indices``, ...).
    """

    SPLIT_SEEDS = dict(train=0, val=1)
    DESCRIPTION = ''  # what the log line calls the set

    def __init__(self, split: str = 'train', num_images: int = 6000, img_size: int = 64, seed: int = 0,
                 **kwargs: Any):
        if split not in self.SPLIT_SEEDS:
            raise ValueError(f"split must be one of {sorted(self.SPLIT_SEEDS)}, got {split!r}")
        self.split = split
        self.num_images = num_images
        self.img_size = img_size
        self.seed = seed
        super().__init__(ann_file='', **kwargs)

    def render(self, seed: int) -> Tuple[np.ndarray, np.ndarray]:
        """The split's images (N, H, W, 3) uint8 and labels (N,)."""
        raise NotImplementedError

    def load_data_list(self) -> List[dict]:
        seed = 1000 * self.seed + self.SPLIT_SEEDS[self.split]
        print_log(f'Generating the {self.DESCRIPTION} {self.split} split in memory: {self.num_images} images of '
                  f'{self.img_size} x {self.img_size} (seed {seed})', logger='current')
        images, labels = self.render(seed)
        return [dict(img=image, img_shape=image.shape[:2], ori_shape=image.shape[:2], gt_label=int(label))
                for image, label in zip(images, labels)]


@DATASETS.register_module()
class PositionalShapes(_GeneratedScenes):
    """Two shapes per image, the class says which is left of which (see :mod:`.shapes_dataset`);
    the arguments of :class:`_GeneratedScenes`."""

    METAINFO = dict(classes=SHAPES_CLASSES)
    DESCRIPTION = 'positional shapes'

    def render(self, seed: int) -> Tuple[np.ndarray, np.ndarray]:
        return render_shapes(self.num_images, self.img_size, seed=seed)


@DATASETS.register_module()
class PositionalRelations(_GeneratedScenes):
    """Three target shapes among outlined distractors; the class says which target is leftmost and
    which topmost (9 classes; see :mod:`.relations_dataset`).

    Args:
        canvas: the side, in pixels, of the frame the scenes are drawn in, at the training scale
            (shapes keep their pixel sizes): ``img_size`` = ``canvas`` draws them as trained, a
            larger pair more of the same scene kind on a larger image (the extent test), another
            ``img_size`` alone the same scenes scaled (the scale test). None: ``img_size``'s default
            training canvas, :data:`~.relations_dataset.TRAIN_CANVAS`.
        **kwargs: those of :class:`_GeneratedScenes`.
    """

    METAINFO = dict(classes=RELATIONS_CLASSES)
    DESCRIPTION = 'positional relations'

    def __init__(self, *args: Any, canvas: Optional[int] = None, **kwargs: Any):
        self.canvas = TRAIN_CANVAS if canvas is None else canvas
        super().__init__(*args, **kwargs)

    def render(self, seed: int) -> Tuple[np.ndarray, np.ndarray]:
        return render_relations(self.num_images, self.img_size, seed=seed, canvas=self.canvas)

    def load_data_list(self) -> List[dict]:
        if self.canvas != TRAIN_CANVAS:
            print_log(f'Positional relations drawn on a canvas of {self.canvas} pixels (training: {TRAIN_CANVAS}), '
                      f'rendered at {self.img_size}', logger='current')
        return super().load_data_list()


@DATASETS.register_module()
class CheckedImageNet(ImageNet):
    """mmpretrain's :class:`~mmpretrain.datasets.ImageNet`, failing early with a useful message when
    the data is not where the config says.

    Expected layout: :data:`IMAGENET_LAYOUT` (mmpretrain's), optionally with ``meta/train.txt``
    and ``meta/val.txt``.
    """

    def __init__(self, data_root: str = '', split: str = '', data_prefix: Optional[str] = None, **kwargs: Any):
        folder = os.path.join(data_root, data_prefix if data_prefix is not None else split)
        require_data(folder, f'ImageNet {split or "images"}', IMAGENET_LAYOUT.format(data_root=data_root or '.'),
                     'train_dataloader.dataset.data_root=/path/ (and val_dataloader.dataset.data_root)',
                     EMBEDDED_CONFIG)
        kwargs.update(data_root=data_root, split=split)
        if data_prefix is not None:
            kwargs['data_prefix'] = data_prefix
        super().__init__(**kwargs)


@DATASETS.register_module()
class INaturalist2019(BaseDataset):
    """iNaturalist 2019 (the FGVC6 species challenge, 1,010 classes) as it is published: one JSON
    per split in COCO's style, whose ``images`` name their files relative to the data root, whose
    ``annotations`` give each image one ``category_id``, and whose ``categories`` name the species.
    Labels are the category ids in sorted order (0..1009 as published); ``classes`` their names.
    Layout: :data:`INATURALIST_LAYOUT`. The transfer study of PerViT (supplement Tab. A4) fine-tunes
    on it.

    Args:
        data_root: the folder holding the JSON files and the image folder.
        split: 'train' or 'val' (the published test split has no labels).
    """
    SPLITS = ('train', 'val')

    def __init__(self, data_root: str = '', split: str = 'train', **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f'iNaturalist 2019 split must be one of {self.SPLITS} (the test split has no '
                             f'labels), got {split!r}')
        ann_file = f'{split}2019.json'
        require_data(os.path.join(data_root, ann_file), f'iNaturalist 2019 {split} annotations',
                     INATURALIST_LAYOUT.format(data_root=data_root or '.'),
                     'train_dataloader.dataset.data_root=/path/ (and val_dataloader.dataset.data_root)',
                     EMBEDDED_CONFIG)
        super().__init__(ann_file=ann_file, data_root=data_root, **kwargs)

    def load_data_list(self) -> List[dict]:
        with open(self.ann_file) as f:
            record = json.load(f)
        categories = sorted(record['categories'], key=lambda category: category['id'])
        label_of = {category['id']: label for label, category in enumerate(categories)}
        set_default_classes(self, tuple(category['name'] for category in categories))
        files = {image['id']: image['file_name'] for image in record['images']}
        labels = {}
        for annotation in record['annotations']:
            if annotation['image_id'] in labels:
                raise ValueError(f'{self.ann_file}: image {annotation["image_id"]} has more than one annotation')
            if annotation['category_id'] not in label_of:
                raise ValueError(f'{self.ann_file}: image {annotation["image_id"]} has category '
                                 f'{annotation["category_id"]}, which is not among its categories')
            labels[annotation['image_id']] = label_of[annotation['category_id']]
        unlabelled = [image_id for image_id in files if image_id not in labels]
        if unlabelled:
            raise ValueError(f'{self.ann_file}: {len(unlabelled)} images have no annotation (e.g. image '
                             f'{unlabelled[0]}); the test split has no labels to train or evaluate on')
        return [dict(img_path=os.path.join(self.data_root, files[image_id]), gt_label=label)
                for image_id, label in labels.items()]


@DATASETS.register_module()
class SubsampledDataset:
    """A fixed random ``fraction`` of every class of a classification dataset: the training sets of
    PerViT's data-efficiency study (ImageNet at 50% and 25%, its Table 4).

    Each class keeps round(fraction x its images), at least one, drawn with ``seed``, so the class
    balance of the full set is kept and the same seed gives the same subset on every process. The
    paper presents the same number of images in all: scale the epochs by 1 / fraction in the config.

    Args:
        dataset: the dataset, or its config.
        fraction: the part of each class kept, in (0, 1].
        seed: the draw.
    """

    def __init__(self, dataset: Union[BaseDataset, Mapping[str, Any]], fraction: float, seed: int = 0):
        if not 0 < fraction <= 1:
            raise ValueError(f'fraction must be in (0, 1], got {fraction}')
        self.dataset = DATASETS.build(dataset) if isinstance(dataset, Mapping) else dataset
        self.fraction, self.seed = fraction, seed
        labels = np.asarray(self.dataset.get_gt_labels())
        generator = np.random.default_rng(seed)
        kept = [generator.permutation(np.flatnonzero(labels == label))[:max(1, round(fraction * count))]
                for label, count in zip(*np.unique(labels, return_counts=True))]
        self.indices = np.sort(np.concatenate(kept))
        self._labels = labels[self.indices]

    @property
    def metainfo(self) -> dict:
        return self.dataset.metainfo

    def get_gt_labels(self) -> np.ndarray:
        return self._labels

    def get_cat_ids(self, index: int) -> List[int]:
        return [int(self._labels[index])]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return self.dataset[int(self.indices[index])]

    def __repr__(self) -> str:
        return (f'SubsampledDataset(fraction={self.fraction}, seed={self.seed}: {len(self)} of '
                f'{len(self.dataset)} images, from {type(self.dataset).__name__})')
