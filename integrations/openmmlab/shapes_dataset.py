"""A small image set where position decides the class: which of two shapes is on the left.

Every image holds two different shapes out of circle, square and triangle, at random positions,
sizes and colours on a noisy background; the class is the ordered pair (left shape, right
shape), e.g. "circle left of square" vs "square left of circle". Knowing which shapes are in an
image narrows six classes to two; only where they sit relative to each other tells those two
apart, so a bag-of-features model is capped at 50% and chance is 1/6.

Images are drawn with numpy from a seeded generator: the same arguments give the same bytes on
every machine, nothing is downloaded, and 6,000 images of 64 x 64 take about 2 seconds. The
classes are symmetric under vertical flips (a label-preserving augmentation); horizontal flips
swap them.

A scene (the shapes, their places, sizes and colours, the background colour) is drawn in a frame
of :data:`SCENE_SIZE` pixels and rendered at ``img_size``: a seed gives the same scenes at every
size, shapes scaling with the image, as a larger crop of a photograph shows the same objects at
more pixels. Only the pixel noise is drawn afresh for each size (per pixel, the same spread).
"""
from __future__ import annotations

import itertools
from typing import List, Tuple

import numpy as np

__all__ = ['SHAPES', 'CLASSES', 'SCENE_SIZE', 'shape_mask', 'pixel_centres', 'render_shapes']

SHAPES = ('circle', 'square', 'triangle')
PAIRS: List[Tuple[int, int]] = list(itertools.permutations(range(len(SHAPES)), 2))
CLASSES = tuple(f'{SHAPES[left]} left of {SHAPES[right]}' for left, right in PAIRS)
RADIUS_RANGE = (0.15, 0.24)  # shape half-sides, as fractions of the image side
SCENE_SIZE = 64  # side of the frame scenes are drawn in, in its pixels
_MIN_GAP = 2  # frame pixels between the two shapes' bounding boxes, so "left of" is never ambiguous
_NOISE_STD = 12.0  # of the background's pixel noise


def shape_mask(shape: int, cy: float, cx: float, radius: float, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Boolean (H, W) mask of a circle, square or upward triangle inscribed in the box of half-side ``radius``."""
    dy, dx = ys - cy, xs - cx
    if SHAPES[shape] == 'circle':
        return dy ** 2 + dx ** 2 <= radius ** 2
    if SHAPES[shape] == 'square':
        return (np.abs(dy) <= 0.85 * radius) & (np.abs(dx) <= 0.85 * radius)
    # triangle: apex at the top, base at the bottom, half-width growing linearly downwards
    depth = (dy + radius) / (2 * radius)
    return (depth >= 0) & (depth <= 1) & (np.abs(dx) <= depth * radius)


def pixel_centres(img_size: int, frame: int = SCENE_SIZE) -> np.ndarray:
    """Centres of the pixels of an ``img_size`` side, in the coordinates of a ``frame``-pixel frame
    (pixel i of the frame is at i), (img_size,) float32; at ``frame`` exactly 0, 1, ..., frame - 1."""
    return ((np.arange(img_size) + 0.5) * (frame / img_size) - 0.5).astype(np.float32)


def render_shapes(num_images: int, img_size: int = SCENE_SIZE, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """``num_images`` images (N, img_size, img_size, 3) uint8 and their labels (N,) int64.

    Labels index :data:`CLASSES` and are balanced (every class the same count to within one), in
    shuffled order. Shape half-sides are drawn from :data:`RADIUS_RANGE`. The scenes depend on
    ``seed`` alone, drawn in the :data:`SCENE_SIZE` frame and rendered at ``img_size`` (each pixel
    takes the colour at its centre); the pixel noise is drawn at ``img_size``.
    """
    smallest = -(-SCENE_SIZE // _MIN_GAP)  # the gap between the shapes keeps at least one pixel
    if img_size < smallest:
        raise ValueError(f'img_size {img_size} is too small to place two shapes side by side; use >= {smallest}')
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng([seed, img_size])  # the noise of sizes other than SCENE_SIZE
    centres = pixel_centres(img_size)
    ys, xs = np.meshgrid(centres, centres, indexing='ij')
    images = np.empty((num_images, img_size, img_size, 3), np.uint8)
    labels = np.arange(num_images, dtype=np.int64) % len(CLASSES)
    rng.shuffle(labels)
    for index, label in enumerate(labels):
        radii = rng.uniform(*RADIUS_RANGE, size=2) * SCENE_SIZE
        # left shape first, leaving room for the gap and the right one; then the right shape
        left_cx = rng.uniform(radii[0], SCENE_SIZE - radii[0] - _MIN_GAP - 2 * radii[1])
        right_cx = rng.uniform(left_cx + radii[0] + _MIN_GAP + radii[1], SCENE_SIZE - radii[1])
        cx = (left_cx, right_cx)
        cy = rng.uniform(radii, SCENE_SIZE - radii)
        background = rng.uniform(0, 90, size=3)
        noise = rng.normal(0, _NOISE_STD, size=(SCENE_SIZE, SCENE_SIZE, 3))
        if img_size != SCENE_SIZE:  # the frame's noise is drawn all the same, so that the next scenes are too
            noise = noise_rng.normal(0, _NOISE_STD, size=(img_size, img_size, 3))
        image = background + noise
        for shape, y, x, radius in zip(PAIRS[label], cy, cx, radii):
            colour = rng.uniform(130, 255, size=3)
            image[shape_mask(shape, y, x, radius, ys, xs)] = colour
        images[index] = np.clip(image, 0, 255).astype(np.uint8)
    return images, labels
