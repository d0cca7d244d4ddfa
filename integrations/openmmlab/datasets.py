"""mmpretrain datasets: the embedded positional-shapes set, and ImageNet with a clear error when absent."""
from __future__ import annotations

import os
from typing import Any, List, Optional

from mmpretrain.datasets import BaseDataset, ImageNet
from mmpretrain.registry import DATASETS

from .data_checks import require_data
from .shapes import CLASSES, render_shapes

__all__ = ['PositionalShapes', 'CheckedImageNet']

EMBEDDED_CONFIG = 'configs/pervit_t_shapes.py'
IMAGENET_LAYOUT = """  {data_root}/train/<wnid>/*.JPEG  (e.g. train/n01440764/n01440764_10026.JPEG)
  {data_root}/val/<wnid>/*.JPEG, or val/*.JPEG with meta/val.txt (mmpretrain's layout)"""


@DATASETS.register_module()
class PositionalShapes(BaseDataset):
    """Two shapes per image, the class says which is left of which (see :mod:`.shapes`).

    Generated in memory when the dataset is built: deterministic, no files, no download. The
    train and val splits come from different seeds, so they share no image.

    Args:
        split: 'train' or 'val'.
        num_images: images in the split.
        img_size: image side in pixels.
        seed: base seed; each split offsets it.
        **kwargs: mmpretrain ``BaseDataset`` options (``pipeline``, ``test_mode``, ``indices``, ...).
    """

    METAINFO = dict(classes=CLASSES)
    SPLIT_SEEDS = dict(train=0, val=1)

    def __init__(self, split: str = 'train', num_images: int = 6000, img_size: int = 64, seed: int = 0,
                 **kwargs: Any):
        if split not in self.SPLIT_SEEDS:
            raise ValueError(f"split must be one of {sorted(self.SPLIT_SEEDS)}, got {split!r}")
        self.split = split
        self.num_images = num_images
        self.img_size = img_size
        self.seed = seed
        super().__init__(ann_file='', **kwargs)

    def load_data_list(self) -> List[dict]:
        images, labels = render_shapes(self.num_images, self.img_size,
                                       seed=1000 * self.seed + self.SPLIT_SEEDS[self.split])
        return [dict(img=image, img_shape=image.shape[:2], ori_shape=image.shape[:2], gt_label=int(label))
                for image, label in zip(images, labels)]


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
