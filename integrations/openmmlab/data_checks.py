"""One error for every toolbox's real data set when it is not where the config says."""
from __future__ import annotations

import os

__all__ = ['require_data']


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
