"""A folder of class folders, one root for both splits: ``ImageFolderSplit``.

mmpretrain's ``CustomDataset`` reads ImageNet's layout, a folder per split each holding a folder per
class. Many data sets come as one root of class folders instead; ``ImageFolderSplit`` reads such a
root and holds out a fixed, seeded part of every class as the validation split, so the two splits
share their classes (the sorted folder names, as ``CustomDataset`` labels them) and no image.
Configs that use it import this module:
``custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.image_folder'])``.
"""
from __future__ import annotations

from typing import Any, List

import numpy as np
from mmpretrain.datasets import CustomDataset
from mmpretrain.registry import DATASETS

__all__ = ['ImageFolderSplit']


@DATASETS.register_module()
class ImageFolderSplit(CustomDataset):
    """``data_root/<class>/**/<image>``, split into a training and a validation part per class.

    Each class of n images gives round(``val_fraction`` x n) of them, at least one where n >= 2,
    to the validation split, drawn with ``seed``; the others are the training split. The same root,
    fraction and seed give the same split on every process and every run.

    Args:
        data_root: the folder holding one folder per class.
        split: 'train' or 'val'.
        val_fraction: the part of each class held out for validation, in (0, 1).
        seed: the draw.
        **kwargs: ``CustomDataset``'s other options (``pipeline``, ``extensions``, ``test_mode``, ...).
    """
    SPLITS = ('train', 'val')

    def __init__(self, data_root: str = '', split: str = 'train', val_fraction: float = 0.2, seed: int = 0,
                 **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f'split must be one of {self.SPLITS}, got {split!r}')
        if not 0 < val_fraction < 1:
            raise ValueError(f'val_fraction must be in (0, 1), the part of each class held out for validation; '
                             f'got {val_fraction}')
        self.split, self.val_fraction, self.seed = split, val_fraction, seed
        super().__init__(data_root=data_root, **kwargs)

    def load_data_list(self) -> List[dict]:
        data_list = super().load_data_list()
        labels = np.array([info['gt_label'] for info in data_list])
        generator = np.random.default_rng(self.seed)
        held_out = set()
        for label in np.unique(labels):  # in label order, so that each class's draw is the same every time
            members = np.flatnonzero(labels == label)
            count = 0 if len(members) < 2 else max(1, round(self.val_fraction * len(members)))
            held_out.update(generator.permutation(members)[:count].tolist())
        keep_held_out = self.split == 'val'
        return [info for index, info in enumerate(data_list) if (index in held_out) == keep_held_out]
