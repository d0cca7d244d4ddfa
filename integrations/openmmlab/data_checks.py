"""Checks of a data set's files before a run reads them: one error for every toolbox's real data set
when it is not where the config says (:func:`require_data`), and one for image files of zero bytes
(:class:`EmptyImageCheckHook`), which OpenCV refuses without naming the file in the middle of a run."""
from __future__ import annotations

import os
from typing import Dict, Iterator, List

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

__all__ = ['require_data', 'describe_dataset', 'empty_image_files', 'EmptyImageFiles', 'EmptyImageCheckHook']

LISTED_FILES = 8  # the most empty files a message names; it counts the others


def require_data(path: str, what: str, layout: str, data_root_option: str, embedded_config: str) -> None:
    """Raise ``FileNotFoundError`` unless ``path`` exists, saying where the data goes and what runs without it.

    Args:
        path: the file or folder the dataset is about to read.
        what: the data's name, e.g. 'COCO train2017 annotations'.
        layout: the expected layout, one entry per line.
        data_root_option: the ``--cfg-options`` key(s) that move the data root.
        embedded_config: the config that trains on the embedded, generated set instead.
    """
    if os.path.exists(path):
        return
    raise FileNotFoundError(
        f'{what} not found at {os.path.abspath(path)}. Expected layout:\n{layout}\n'
        f'Put the data there, or point the config elsewhere with --cfg-options {data_root_option}. '
        f'To try the pipeline without it, train on the embedded set: python tools/train.py {embedded_config}')


def describe_dataset(dataset) -> str:
    """A dataset's type and where it reads from, for messages: ``CustomDataset at data/mydata/train``."""
    where = getattr(dataset, 'img_prefix', None) or getattr(dataset, 'data_root', None)
    return type(dataset).__name__ + (f' at {where}' if where else '')


def _image_paths(dataset) -> Iterator[str]:
    """The local image files a dataset reads (its data infos' ``img_path``); a wrapper without
    ``get_data_info`` (``SubsampledDataset``) through the dataset it wraps."""
    while not hasattr(dataset, 'get_data_info') and hasattr(dataset, 'dataset'):
        dataset = dataset.dataset
    if not hasattr(dataset, 'get_data_info'):
        return
    for index in range(len(dataset)):
        path = dataset.get_data_info(index).get('img_path')
        if isinstance(path, str) and '://' not in path:  # remote storage is not looked at
            yield path


def empty_image_files(dataset) -> List[str]:
    """The image files of ``dataset`` that hold zero bytes (an interrupted copy or download): no
    decoder reads them, and OpenCV's error names no file. Files that do not exist are left to the
    loader, whose error names them."""
    empty = []
    for path in _image_paths(dataset):
        try:
            if os.path.getsize(path) == 0:
                empty.append(path)
        except OSError:
            continue
    return empty


class EmptyImageFiles(ValueError):
    """A dataset lists image files of zero bytes (:class:`EmptyImageCheckHook`)."""


@HOOKS.register_module()
class EmptyImageCheckHook(Hook):
    """Raises :class:`EmptyImageFiles`, naming every empty image file (:func:`empty_image_files`),
    before the first training step (``before_train``: the training and validation data) and before
    the first test batch (``before_test``). One ``os.stat`` per image: the configs for your own images
    (``configs/_base_/image_folder.py``) register it with ``custom_hooks``.
    """
    priority = 'VERY_HIGH'

    def _check(self, loops: Dict[str, object]) -> None:
        problems = []
        for name, loop in loops.items():
            if loop is None:
                continue
            dataset = loop.dataloader.dataset
            empty = empty_image_files(dataset)
            if empty:
                listed = '\n    '.join(empty[:LISTED_FILES]) + (
                    f'\n    ... ({len(empty)} in all)' if len(empty) > LISTED_FILES else '')
                problems.append(f'{name}\'s dataset ({describe_dataset(dataset)}) lists {len(empty)} '
                                f'file{"s" if len(empty) > 1 else ""} of 0 bytes:\n    {listed}')
        if problems:
            raise EmptyImageFiles('empty image files, which no decoder can read:\n  ' + '\n  '.join(problems)
                                  + '\n  delete them, or copy those images again')

    def before_train(self, runner) -> None:
        self._check({'train_dataloader': runner.train_loop, 'val_dataloader': runner.val_loop})

    def before_test(self, runner) -> None:
        self._check({'test_dataloader': runner.test_loop})
