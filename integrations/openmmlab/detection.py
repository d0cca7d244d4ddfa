"""mmdet datasets: the embedded shapes set as COCO instances, and COCO with a clear error when absent.

Import with ``custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.detection'])``;
both register in mmdet's ``DATASETS`` and evaluate with mmdet's ``CocoMetric``. mmcv's ops are left
as they are: ``PosattnRunner`` routes its NMS and RoIAlign on CUDA tensors to torchvision for
the duration of its runs when mmcv has no CUDA kernels (:mod:`.torchvision_ops`), so the
detection configs train on a GPU with a CPU-ops mmcv build.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

from mmdet.datasets import CocoDataset
from mmdet.registry import DATASETS

from .data_checks import require_data
from .dense_shapes_dataset import ensure_dense_shapes
from .shapes_dataset import SHAPES

__all__ = ['ShapesCocoDataset', 'CheckedCocoDataset']

EMBEDDED_CONFIG = 'configs/mask-rcnn_pervit-t_shapes.py'
COCO_LAYOUT = """  data/coco/annotations/instances_train2017.json, instances_val2017.json
  data/coco/train2017/*.jpg
  data/coco/val2017/*.jpg"""


@DATASETS.register_module()
class ShapesCocoDataset(CocoDataset):
    """Circles, squares and triangles with boxes and masks (:mod:`.dense_shapes_dataset`), generated in
    ``data_root`` on first use and read as COCO.

    Args:
        data_root: folder of the set; generated there when absent.
        img_size: (height, width) of the images.
        sizes: images per split, e.g. ``dict(train=1000, val=200)``.
        seed: generator seed.
        **kwargs: mmdet ``CocoDataset`` options; ``ann_file`` is
            ``annotations/instances_{split}.json`` and ``data_prefix`` ``dict(img='images/{split}/')``.
    """

    METAINFO = dict(classes=SHAPES, palette=[(220, 20, 60), (0, 130, 200), (60, 180, 75)])

    def __init__(self, data_root: str, img_size: Sequence[int] = (128, 192), sizes: Optional[Dict[str, int]] = None,
                 seed: int = 0, **kwargs: Any):
        ensure_dense_shapes(data_root, tuple(img_size), sizes, seed)
        super().__init__(data_root=data_root, **kwargs)


@DATASETS.register_module()
class CheckedCocoDataset(CocoDataset):
    """mmdet's :class:`~mmdet.datasets.CocoDataset`, stopping early with a useful message when the
    annotation file or image folder is not where the config says."""

    def __init__(self, data_root: str = '', ann_file: str = '', data_prefix: Optional[dict] = None, **kwargs: Any):
        data_prefix = dict(img='') if data_prefix is None else data_prefix
        for what, path in (('COCO annotations', ann_file), ('COCO images', data_prefix.get('img', ''))):
            require_data(os.path.join(data_root, path), what, COCO_LAYOUT,
                         'train_dataloader.dataset.data_root=/path/ (and val_dataloader.dataset.data_root, '
                         'val_evaluator.ann_file)', EMBEDDED_CONFIG)
        super().__init__(data_root=data_root, ann_file=ann_file, data_prefix=data_prefix, **kwargs)
