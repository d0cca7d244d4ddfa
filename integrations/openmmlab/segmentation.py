"""mmseg datasets: the embedded shapes set as PNG label maps, and ADE20K with a clear error when absent.

Import with ``custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.segmentation'])``;
both register in mmseg's ``DATASETS`` and evaluate with mmseg's ``IoUMetric``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

from mmseg.datasets import ADE20KDataset, BaseSegDataset
from mmseg.registry import DATASETS

from .data_checks import require_data
from .dense_shapes_dataset import ensure_dense_shapes
from .shapes_dataset import SHAPES

__all__ = ['ShapesSegDataset', 'CheckedADE20KDataset']

EMBEDDED_CONFIG = 'configs/upernet_pervit-t_shapes.py'
ADE_LAYOUT = """  data/ade/ADEChallengeData2016/images/training/*.jpg, images/validation/*.jpg
  data/ade/ADEChallengeData2016/annotations/training/*.png, annotations/validation/*.png"""


@DATASETS.register_module()
class ShapesSegDataset(BaseSegDataset):
    """Circles, squares and triangles as label maps (0 background, 1 circle, 2 square, 3 triangle;
    :mod:`.dense_shapes_dataset`), generated in ``data_root`` on first use.

    Args:
        data_root: folder of the set; generated there when absent.
        img_size: (height, width) of the images.
        sizes: images per split, e.g. ``dict(train=1000, val=200)``.
        seed: generator seed.
        **kwargs: mmseg ``BaseSegDataset`` options; ``data_prefix`` is
            ``dict(img_path='images/{split}', seg_map_path='masks/{split}')``.
    """

    METAINFO = dict(classes=('background',) + SHAPES,
                    palette=[(0, 0, 0), (220, 20, 60), (0, 130, 200), (60, 180, 75)])

    def __init__(self, data_root: str, img_size: Sequence[int] = (128, 192), sizes: Optional[Dict[str, int]] = None,
                 seed: int = 0, **kwargs: Any):
        ensure_dense_shapes(data_root, tuple(img_size), sizes, seed)
        super().__init__(data_root=data_root, img_suffix='.png', seg_map_suffix='.png', reduce_zero_label=False,
                         **kwargs)


@DATASETS.register_module()
class CheckedADE20KDataset(ADE20KDataset):
    """mmseg's :class:`~mmseg.datasets.ADE20KDataset`, stopping early with a useful message when
    the image or annotation folder is not where the config says."""

    def __init__(self, data_root: str = '', data_prefix: Optional[dict] = None, **kwargs: Any):
        data_prefix = dict(img_path='', seg_map_path='') if data_prefix is None else data_prefix
        for what, key in (('ADE20K images', 'img_path'), ('ADE20K annotations', 'seg_map_path')):
            require_data(os.path.join(data_root, data_prefix.get(key, '')), what, ADE_LAYOUT,
                         'train_dataloader.dataset.data_root=/path/ (and val_dataloader.dataset.data_root)',
                         EMBEDDED_CONFIG)
        super().__init__(data_root=data_root, data_prefix=data_prefix, **kwargs)
