"""Scenes of shapes for detection and segmentation, written to disk once and reused.

Each image holds 2 to 5 non-overlapping shapes (circle, square, triangle; the shapes of
:mod:`.shapes_dataset`) of random sizes and colours on a noisy background. One deterministic generator
writes, for each split, the images and both label formats:

    {root}/images/{split}/{index:06d}.png           RGB image
    {root}/masks/{split}/{index:06d}.png            label map: 0 background, 1 circle, 2 square, 3 triangle
    {root}/annotations/instances_{split}.json       COCO instances: boxes and RLE masks, categories 1..3
    {root}/meta.json                                what generated it (the arguments below)

so mmdet reads the set as a COCO dataset and mmseg as PNG label maps, with the toolboxes' own
loaders and metrics. The same arguments give the same bytes on every machine; nothing is
downloaded. A folder generated with other arguments is never overwritten: building the set again
with a different ``img_size`` or size raises an error naming the folder.

Generating the set logs one line (mmengine's current logger) naming what is generated and where.
Generation stages the set in a hidden folder beside ``root`` (``.{name}-{pid}-{random}``), made with
the mode any new folder gets under the umask, and renames it into place when complete. A generation
that was killed leaves its staging folder behind; the next call for the same ``root`` deletes it
(:func:`remove_stale_staging`).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
from mmengine.logging import print_log
from PIL import Image
from pycocotools import mask as mask_utils

from .atomic import process_is_alive
from .shapes_dataset import SHAPES, shape_mask

__all__ = ['SPLITS', 'DEFAULT_SIZES', 'CATEGORIES', 'render_scene', 'ensure_dense_shapes', 'remove_stale_staging']

VERSION = 1
SPLITS = ('train', 'val')
DEFAULT_SIZES = dict(train=1000, val=200)
CATEGORIES = tuple(dict(id=i + 1, name=name) for i, name in enumerate(SHAPES))  # label map value = id
OBJECTS_RANGE = (2, 5)
RADIUS_RANGE = (0.1, 0.22)  # shape half-sides, as fractions of the image's shorter side
_GAP = 2  # pixels between two shapes' boxes
_PLACEMENT_TRIES = 100
_WRITER = '.writer.json'  # in a staging folder: the host and pid generating into it
# A staging folder whose writer cannot be checked (another host, or no writer file) is stale after
# this long. Generating the default set takes about 15 s on 2 CPU cores; at that rate a day would
# be some six million images, far beyond any set this generator is meant for.
STALE_STAGING_SECONDS = 24 * 3600


def render_scene(rng: np.random.Generator, height: int, width: int) -> Tuple[np.ndarray, List[Tuple[int, np.ndarray]]]:
    """One image (height, width, 3) uint8 and its objects as (shape index, boolean (H, W) mask)."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    image = rng.uniform(0, 90, size=3) + rng.normal(0, 12, size=(height, width, 3))
    boxes: List[Tuple[float, float, float, float]] = []  # y0, x0, y1, x1
    objects = []
    for _ in range(rng.integers(OBJECTS_RANGE[0], OBJECTS_RANGE[1] + 1)):
        for _ in range(_PLACEMENT_TRIES):
            radius = rng.uniform(*RADIUS_RANGE) * min(height, width)
            cy, cx = rng.uniform(radius, height - radius), rng.uniform(radius, width - radius)
            box = (cy - radius, cx - radius, cy + radius, cx + radius)
            if all(box[0] > b[2] + _GAP or box[2] < b[0] - _GAP or box[1] > b[3] + _GAP or box[3] < b[1] - _GAP
                   for b in boxes):
                break
        else:
            continue  # no room left for another shape
        shape = int(rng.integers(len(SHAPES)))
        mask = shape_mask(shape, cy, cx, radius, ys, xs)
        image[mask] = rng.uniform(130, 255, size=3)
        boxes.append(box)
        objects.append((shape, mask))
    return np.clip(image, 0, 255).astype(np.uint8), objects


def _coco_annotation(mask: np.ndarray, shape: int, image_id: int, annotation_id: int) -> dict:
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    x, y, w, h = (float(v) for v in mask_utils.toBbox(rle))
    return dict(id=annotation_id, image_id=image_id, category_id=CATEGORIES[shape]['id'], bbox=[x, y, w, h],
                area=float(mask_utils.area(rle)), iscrowd=0,
                segmentation=dict(size=list(rle['size']), counts=rle['counts'].decode('ascii')))


def _write_split(root: Path, split: str, num_images: int, height: int, width: int, seed: int) -> None:
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    (root / 'images' / split).mkdir(parents=True)
    (root / 'masks' / split).mkdir(parents=True)
    images, annotations = [], []
    for index in range(num_images):
        image, objects = render_scene(rng, height, width)
        labels = np.zeros((height, width), np.uint8)
        name = f'{index:06d}.png'
        image_id = index + 1
        for shape, mask in objects:
            labels[mask] = CATEGORIES[shape]['id']
            annotations.append(_coco_annotation(mask, shape, image_id, len(annotations) + 1))
        Image.fromarray(image).save(root / 'images' / split / name)
        Image.fromarray(labels).save(root / 'masks' / split / name)
        images.append(dict(id=image_id, file_name=name, height=height, width=width))
    coco = dict(images=images, annotations=annotations, categories=list(CATEGORIES))
    with open(root / 'annotations' / f'instances_{split}.json', 'w') as f:
        json.dump(coco, f)


def _staging_is_stale(staging: Path, now: float) -> bool:
    try:
        writer = json.loads((staging / _WRITER).read_text())
        if writer['host'] == socket.gethostname():
            return not process_is_alive(int(writer['pid']))
        started = float(writer['started'])
    except (OSError, ValueError, KeyError, TypeError):  # no writer file (yet): judge by age
        try:
            started = staging.stat().st_mtime
        except FileNotFoundError:  # removed meanwhile, by another process cleaning up
            return False
    return now - started > STALE_STAGING_SECONDS


def remove_stale_staging(root: Path) -> List[Path]:
    """Delete the staging folders of killed generations of ``root``: on this host, those whose
    generating process is gone; others after :data:`STALE_STAGING_SECONDS`. Returns them."""
    removed, now = [], time.time()
    for staging in root.parent.glob(f'.{root.name}-*'):
        if staging.is_dir() and _staging_is_stale(staging, now):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _new_staging(root: Path) -> Path:
    """An empty staging folder for ``root``, beside it. Made with ``mkdir``, so it has the mode of
    any new folder under the umask (``tempfile.mkdtemp`` makes 0700 ones), which the set keeps once
    renamed into place."""
    staging = root.parent / f'.{root.name}-{os.getpid()}-{secrets.token_hex(4)}'
    staging.mkdir()
    return staging


def ensure_dense_shapes(root: str, img_size: Tuple[int, int] = (128, 192), sizes: Dict[str, int] = None,
                        seed: int = 0) -> Path:
    """The set under ``root``, generated there first if the folder does not hold it yet.

    Args:
        root: folder of the set (created; its parent must be writable).
        img_size: (height, width) of every image.
        sizes: images per split, ``{'train': n, 'val': m}`` (default :data:`DEFAULT_SIZES`).
        seed: base seed; the splits draw from different streams, so they share no image.

    Returns the folder. The set is written to a temporary folder beside ``root`` and moved into
    place when complete, so an interrupted run leaves nothing half-written and concurrent ranks
    generating the same set agree; the temporary folders of killed runs are deleted here
    (:func:`remove_stale_staging`). Raises ``FileExistsError`` when ``root`` holds anything else.
    """
    sizes = dict(DEFAULT_SIZES if sizes is None else sizes)
    if set(sizes) != set(SPLITS) or any(int(n) < 1 for n in sizes.values()):
        raise ValueError(f'sizes needs a positive image count for each of {SPLITS}, got {sizes}')
    height, width = (int(s) for s in img_size)
    if min(height, width) < 32:
        raise ValueError(f'img_size must be at least 32 x 32, got {height} x {width}')
    meta = dict(generator='posattn dense shapes', version=VERSION, img_size=[height, width],
                sizes={split: int(sizes[split]) for split in SPLITS}, seed=int(seed))
    root_path = Path(root)
    if root_path.parent.is_dir():
        remove_stale_staging(root_path)
    if not root_path.exists():
        print_log(f'Generating the dense shapes set in {root_path}: {meta["sizes"]["train"]} train and '
                  f'{meta["sizes"]["val"]} val images of {height} x {width} (seed {seed}), with COCO boxes and '
                  f'masks and label maps; later runs reuse it', logger='current')
        root_path.parent.mkdir(parents=True, exist_ok=True)
        staging = _new_staging(root_path)
        try:
            (staging / _WRITER).write_text(json.dumps(dict(host=socket.gethostname(), pid=os.getpid(),
                                                           started=time.time())))
            (staging / 'annotations').mkdir()
            for split in SPLITS:
                _write_split(staging, split, meta['sizes'][split], height, width, seed)
            (staging / 'meta.json').write_text(json.dumps(meta, indent=1))
            (staging / _WRITER).unlink()
            try:
                os.rename(staging, root_path)  # atomic; fails if another process got there first
            except OSError:
                if not (root_path / 'meta.json').exists():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    found = None
    if (root_path / 'meta.json').is_file():
        found = json.loads((root_path / 'meta.json').read_text())
    if found != meta:
        raise FileExistsError(
            f'{root_path.resolve()} does not hold the shapes set this config asks for '
            f'({"it holds " + json.dumps(found) if found else "no meta.json: not a generated set"}; '
            f'asked for {json.dumps(meta)}). Nothing was changed there: delete or move that folder '
            f'to regenerate, or point data_root elsewhere.')
    return root_path
