"""The scalars mmengine logs in a work dir, as the tools and the studies read them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

__all__ = ['logged_scalars', 'is_validation']


def logged_scalars(work_dir) -> List[dict]:
    """The rows mmengine logged in ``work_dir`` (``<timestamp>/vis_data/scalars.json``), every run's in
    the order the runs started: a training resumed has a folder per start."""
    rows = []
    for log in sorted(Path(work_dir).glob('*/vis_data/scalars.json')):
        rows += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return rows


def is_validation(row: dict) -> bool:
    """Whether a logged row holds a validation's metrics (training rows hold the loss and the lr)."""
    return 'loss' not in row and 'lr' not in row
