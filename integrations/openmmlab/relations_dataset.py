"""A harder image set where position decides the class: which shape is leftmost, which is topmost.

Every image holds the three target shapes (a filled circle, square and triangle, each once) and up
to :data:`DISTRACTORS` outlined shapes of the same kinds, which do not count, at random positions,
sizes and colours on a noisy background (a distractor drawn over a target's box is left out: at
the training canvas 62% of the images show one or two, on a 128-pixel canvas 98%). The class is
the pair (leftmost target, topmost target), e.g. "square leftmost, circle topmost": 9 classes,
chance 1/9. Every image shows the same three targets, so which shapes are present says nothing:
only where the targets sit relative to each other, along both axes, decides, and a target is never
in the same place relative to the image.

Sizes are in pixels of the scene's frame: targets of half-side :data:`TARGET_RADIUS`, distractors
of :data:`DISTRACTOR_RADIUS`, about a 16-pixel patch across, so that a token mostly shows one shape;
sizes, distractors and noise are set so that the study budget separates the rows (docs/results.md).
Images are drawn with numpy from a seeded generator: the same arguments give the same bytes on
every machine, nothing is downloaded. Neither flip preserves the classes.

Two ways to test at another size, each a question of its own:

* **scale** (``img_size`` other than ``canvas``): the same scenes drawn larger or smaller, shapes
  scaling with the image (what ``tools/test.py --img-size`` does to PositionalShapes);
* **extent** (``canvas`` = ``img_size``, larger than the training canvas): scenes drawn on a larger
  frame at the training scale, shapes of the same pixel sizes: more tokens, the same pixels per
  shape; the positions a model must compare span more of the grid.
"""
from __future__ import annotations

import itertools
from typing import List, NamedTuple, Tuple

import numpy as np

from .shapes_dataset import SHAPES, pixel_centres, shape_mask

__all__ = ['CLASSES', 'TRAIN_CANVAS', 'MIN_CANVAS', 'DISTRACTORS', 'Shape', 'Scene', 'draw_scenes',
           'render_relations']

PAIRS: List[Tuple[int, int]] = list(itertools.product(range(len(SHAPES)), repeat=2))  # (leftmost, topmost)
CLASSES = tuple(f'{SHAPES[left]} leftmost, {SHAPES[top]} topmost' for left, top in PAIRS)
TRAIN_CANVAS = 64  # the side of the frame training scenes are drawn in, in its pixels
TARGET_RADIUS = (6.0, 9.0)  # targets' half-sides, frame pixels
DISTRACTOR_RADIUS = (4.0, 8.0)
DISTRACTORS = 2  # outlined shapes per image
_OUTLINE = 1.5  # frame pixels of a distractor's outline
_MARGIN = 4.0  # frame pixels by which the leftmost (topmost) target's centre leads the others'
_NOISE_STD = 12.0
MIN_CANVAS = int(2 * TARGET_RADIUS[1]) + 8  # the smallest canvas that holds three targets apart
_TRIES = 1000  # draws of a scene's layout before giving up (a canvas too small for it)


def _outline_mask(shape: int, cy: float, cx: float, radius: float, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    return shape_mask(shape, cy, cx, radius, ys, xs) & ~shape_mask(shape, cy, cx, radius - _OUTLINE, ys, xs)


def _apart(boxes: List[Tuple[float, float, float]], cy: float, cx: float, radius: float) -> bool:
    """Whether a shape at (cy, cx) of half-side ``radius`` keeps a 1-pixel gap from every box."""
    return all(max(abs(cy - y), abs(cx - x)) >= r + radius + 1 for y, x, r in boxes)


def _layout(rng: np.random.Generator, canvas: int, same: bool) -> Tuple[List[Tuple[float, float, float]], int, int]:
    """Three target boxes (cy, cx, radius) a pixel apart, and the indices of the leftmost and the
    topmost, each leading the others' centres by :data:`_MARGIN`; ``same``: one box is both."""
    for _ in range(_TRIES):
        boxes: List[Tuple[float, float, float]] = []
        for radius in rng.uniform(*TARGET_RADIUS, size=3):
            cy, cx = rng.uniform(radius, canvas - radius, size=2)
            if not _apart(boxes, cy, cx, radius):
                break
            boxes.append((cy, cx, radius))
        else:
            ys, xs = sorted(box[0] for box in boxes), sorted(box[1] for box in boxes)
            left = min(range(3), key=lambda i: boxes[i][1])
            top = min(range(3), key=lambda i: boxes[i][0])
            if xs[1] - xs[0] >= _MARGIN and ys[1] - ys[0] >= _MARGIN and (left == top) == same:
                return boxes, left, top
    raise ValueError(f'a canvas of {canvas} pixels is too small to place the three targets apart')


class Shape(NamedTuple):
    """One shape of a scene, in frame pixels: its kind (an index of ``SHAPES``), centre, half-side,
    colour (RGB), and whether it is an outlined distractor rather than a filled target."""
    kind: int
    cy: float
    cx: float
    radius: float
    colour: Tuple[float, float, float]
    outline: bool


class Scene(NamedTuple):
    """A scene before rendering: its class, background colour, and shapes (the three targets first)."""
    label: int
    background: Tuple[float, float, float]
    shapes: List[Shape]


def draw_scenes(num_images: int, seed: int = 0, canvas: int = TRAIN_CANVAS) -> List[Scene]:
    """``num_images`` scenes on a ``canvas``-pixel frame, their labels balanced (every class the same
    count to within one) in shuffled order; they depend on ``seed`` and ``canvas`` alone."""
    if canvas < MIN_CANVAS:
        raise ValueError(f'a canvas of {canvas} pixels cannot hold three targets apart: use >= {MIN_CANVAS}')
    rng = np.random.default_rng([seed, canvas])
    labels = np.arange(num_images, dtype=np.int64) % len(CLASSES)
    rng.shuffle(labels)
    scenes = []
    for label in labels:
        left, top = PAIRS[label]
        boxes, leftmost, topmost = _layout(rng, canvas, same=left == top)
        kinds = [-1] * 3
        kinds[leftmost], kinds[topmost] = left, top
        others = [box for box in range(3) if kinds[box] < 0]
        for box, kind in zip(others, rng.permutation([k for k in range(len(SHAPES)) if k not in (left, top)])):
            kinds[box] = int(kind)
        background = tuple(rng.uniform(0, 90, size=3))
        shapes = [Shape(kind, cy, cx, radius, tuple(rng.uniform(130, 255, size=3)), False)
                  for kind, (cy, cx, radius) in zip(kinds, boxes)]
        for _ in range(DISTRACTORS):
            radius = rng.uniform(*DISTRACTOR_RADIUS)
            cy, cx = rng.uniform(radius, canvas - radius, size=2)
            kind, colour = int(rng.integers(len(SHAPES))), tuple(rng.uniform(130, 255, size=3))
            if _apart(boxes, cy, cx, radius):  # never over a target
                shapes.append(Shape(kind, cy, cx, radius, colour, True))
        scenes.append(Scene(int(label), background, shapes))
    return scenes


def render_relations(num_images: int, img_size: int = TRAIN_CANVAS, seed: int = 0,
                     canvas: int = TRAIN_CANVAS) -> Tuple[np.ndarray, np.ndarray]:
    """``num_images`` images (N, img_size, img_size, 3) uint8 and their labels (N,) int64.

    The scenes of :func:`draw_scenes` (``seed``, ``canvas``), rendered at ``img_size`` (each pixel
    takes the colour at its centre): ``img_size`` = ``canvas`` at the training scale, another
    ``img_size`` the same scenes scaled. The pixel noise is drawn per pixel at ``img_size``.
    """
    if img_size < 8:
        raise ValueError(f'img_size {img_size}: the images must be >= 8 pixels')
    scenes = draw_scenes(num_images, seed, canvas)
    noise_rng = np.random.default_rng([seed, canvas, img_size])
    centres = pixel_centres(img_size, canvas)
    ys, xs = np.meshgrid(centres, centres, indexing='ij')
    images = np.empty((num_images, img_size, img_size, 3), np.uint8)
    for index, scene in enumerate(scenes):
        image = np.asarray(scene.background) + noise_rng.normal(0, _NOISE_STD, size=(img_size, img_size, 3))
        for shape in scene.shapes:
            draw = _outline_mask if shape.outline else shape_mask
            image[draw(shape.kind, shape.cy, shape.cx, shape.radius, ys, xs)] = shape.colour
        images[index] = np.clip(image, 0, 255).astype(np.uint8)
    return images, np.array([scene.label for scene in scenes], dtype=np.int64)


def sample_figure(num_images: int = 6, seed: int = 1, scale: int = 2):
    """A matplotlib figure of ``num_images`` validation scenes, as trained (top row), drawn ``scale``
    times larger (the scale test, middle) and on a canvas ``scale`` times wider at the training scale
    (the extent test, bottom; other scenes), each titled with its class."""
    import matplotlib.pyplot as plt
    rows = [('training: 64 px', render_relations(num_images, TRAIN_CANVAS, seed)),
            (f'scale test: the same scenes at {TRAIN_CANVAS * scale} px',
             render_relations(num_images, TRAIN_CANVAS * scale, seed)),
            (f'extent test: a {TRAIN_CANVAS * scale} px canvas',
             render_relations(num_images, TRAIN_CANVAS * scale, seed, canvas=TRAIN_CANVAS * scale))]
    fig, axes = plt.subplots(len(rows), num_images, figsize=(2.1 * num_images, 2.5 * len(rows)))
    for (title, (images, labels)), line in zip(rows, axes):
        for axis, image, label in zip(line, images, labels):
            axis.imshow(image, interpolation='nearest')
            axis.set_title(CLASSES[label].replace(', ', ',\n'), fontsize=8)
            axis.set_xticks([])
            axis.set_yticks([])
        line[0].set_ylabel(title, fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == '__main__':  # python -m posattn_openmmlab.relations_dataset docs/figures/relations_samples.jpg
    import sys
    sample_figure(num_images=5).savefig(sys.argv[1] if len(sys.argv) > 1 else 'relations_samples.jpg', dpi=70)
