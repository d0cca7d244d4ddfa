"""Per-image token layouts: a batch whose images each have their own grid (native resolution).

A :class:`~posattn.grid.TokenGrid` describes every sequence of a batch alike. Models that keep each
image at its own resolution and aspect ratio hold images of different grids in one tensor
(B, L, C), in one of two forms:

- **padded** (timm's NaFlexViT, SigLIP 2's NaFlex): one image a row, its tokens first, padding
  after, L = the longest image's token count;
- **packed** (NaViT's Patch n' Pack, the vision towers of Pixtral and Qwen2-VL): several images one
  after another in a row, attention within each image only.

:class:`ImageLayout` places image i, of grid g_i, at row r_i and tokens s_i .. s_i + N_i - 1; both
forms, and rows that pack several images beside rows of one, are such placements. A layer given a
layout attends within each image as it would on that image alone, in one of two ways:

- where its Φp computes every term from per-token positions (none, rope, alibi, rpb,
  decomposed_rpb, irpe, gpsa and stacks of them), the images are gathered one a row and attention
  runs once over them with each row's padding masked (:mod:`posattn.positions`);
- where its Φp needs each image's grid as a 2D canvas (peg, peripheral), the images of each grid are
  gathered into one batch, the layer runs its single-grid path on it, and the outputs are put back
  (:meth:`ImageLayout.per_grid`).

No token outside an image (padding, another image) is attended to or changed: the layer's output
there is zero.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._cache import grid_constant
from .grid import GridLike, TokenGrid, is_integer

__all__ = ['ImageLayout', 'GridGroup', 'run_by_size']


class GridGroup(NamedTuple):
    """The images of one grid in a layout: the grid, their indices in the layout's order, and
    ``index`` (images, N) of their tokens in the layout's (B * L) flattened rows."""
    grid: TokenGrid
    images: Tuple[int, ...]
    index: torch.Tensor


@dataclass(frozen=True)
class ImageLayout:
    """Where each image of a batch lies in a (B, L, C) token tensor, and its grid.

    Args:
        grids: each image's :class:`TokenGrid` (its prefix tokens, then its H x W grid, row-major).
        rows: the batch row each image lies in.
        starts: the position in its row of each image's first token.
        length: L, the tokens of a row (padding included).

    Build one with :meth:`padded` or :meth:`packed`; images must not overlap.
    """
    grids: Tuple[TokenGrid, ...]
    rows: Tuple[int, ...]
    starts: Tuple[int, ...]
    length: int

    def __post_init__(self):
        object.__setattr__(self, 'grids', tuple(self.grids))
        object.__setattr__(self, 'rows', tuple(self.rows))
        object.__setattr__(self, 'starts', tuple(self.starts))
        if not self.grids:
            raise ValueError('a layout needs at least one image')
        if not all(isinstance(grid, TokenGrid) for grid in self.grids):
            raise TypeError('ImageLayout.grids must be TokenGrids; build a layout with ImageLayout.padded '
                            'or ImageLayout.packed from (height, width) pairs')
        if not len(self.grids) == len(self.rows) == len(self.starts):
            raise ValueError(f'{len(self.grids)} grids, {len(self.rows)} rows and {len(self.starts)} starts: '
                             'one each per image')
        if not all(is_integer(value) and value >= 0 for value in (*self.rows, *self.starts, self.length)):
            raise ValueError('rows, starts and length must be integers >= 0')
        placed: Dict[int, List[Tuple[int, int, int]]] = {}
        for image, (grid, row, start) in enumerate(zip(self.grids, self.rows, self.starts)):
            if start + grid.num_tokens > self.length:
                raise ValueError(f'image {image} ({grid}) at tokens {start}..{start + grid.num_tokens - 1} '
                                 f'does not fit a row of {self.length} tokens')
            placed.setdefault(row, []).append((start, start + grid.num_tokens, image))
        for row, spans in placed.items():
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
                if start < end:
                    raise ValueError(f'images {first} and {second} overlap in row {row}')

    @classmethod
    def padded(cls, grids: Sequence[GridLike], num_prefix_tokens: int = 0,
               length: Optional[int] = None) -> 'ImageLayout':
        """One image a row, from its first token; rows padded to ``length`` (default: the longest)."""
        grids = _token_grids(grids, num_prefix_tokens)
        length = max(grid.num_tokens for grid in grids) if length is None else length
        return cls(grids, tuple(range(len(grids))), (0,) * len(grids), length)

    @classmethod
    def packed(cls, grids: Sequence[GridLike], num_prefix_tokens: int = 0,
               length: Optional[int] = None) -> 'ImageLayout':
        """Every image in one row, one after another; padded to ``length`` (default: their sum)."""
        grids = _token_grids(grids, num_prefix_tokens)
        ends = list(itertools.accumulate(grid.num_tokens for grid in grids))
        length = ends[-1] if length is None else length
        return cls(grids, (0,) * len(grids), tuple([0] + ends[:-1]), length)

    @classmethod
    def from_patch_coords(cls, patch_coord: torch.Tensor, patch_valid: Optional[torch.Tensor] = None,
                          num_prefix_tokens: int = 0) -> 'ImageLayout':
        """The padded layout of a NaFlex batch (timm's NaFlexViT, SigLIP 2): ``patch_coord`` (B, N, 2)
        the (row, column) of each patch, ``patch_valid`` (B, N) False at padding (None: no padding),
        each row's patches preceded by ``num_prefix_tokens`` prefix tokens. Each image's valid
        patches must come first and cover its grid, (max row + 1) x (max column + 1), in row-major
        order; a ValueError names the first image that does not."""
        if patch_coord.dim() != 3 or patch_coord.shape[-1] != 2:
            raise ValueError(f'patch_coord must be (B, N, 2), got shape {tuple(patch_coord.shape)}')
        coords = patch_coord.detach().to('cpu', torch.long)
        valid = (torch.ones(coords.shape[:2], dtype=torch.bool) if patch_valid is None
                 else patch_valid.detach().to('cpu', torch.bool))
        if valid.shape != coords.shape[:2]:
            raise ValueError(f'patch_valid {tuple(valid.shape)} does not match patch_coord {tuple(coords.shape)}')
        grids = []
        for image, (image_coords, image_valid) in enumerate(zip(coords, valid)):
            count = int(image_valid.sum())
            if count == 0 or not image_valid[:count].all():
                raise ValueError(f'image {image} of the NaFlex batch has its valid patches '
                                 f'{"nowhere" if count == 0 else "after padding"}: they must come first')
            height, width = (int(v) + 1 for v in image_coords[:count].amax(0))
            grid = TokenGrid(height, width, num_prefix_tokens)
            rows, cols = grid.positions()
            if count != grid.num_grid_tokens or not torch.equal(image_coords[:count], torch.stack([rows, cols], -1)):
                raise ValueError(f'the {count} valid patches of image {image} of the NaFlex batch are not its '
                                 f'{height}x{width} grid in row-major order')
            grids.append(grid)
        return cls.padded(grids, num_prefix_tokens, length=num_prefix_tokens + coords.shape[1])

    @property
    def num_images(self) -> int:
        return len(self.grids)

    @property
    def num_rows(self) -> int:
        """The rows the layout needs: B of the (B, L, C) tensor is at least this."""
        return max(self.rows) + 1

    @property
    def num_prefix_tokens(self) -> int:
        """The images' prefix count, which a layer's own must equal (all images share it)."""
        counts = {grid.num_prefix_tokens for grid in self.grids}
        if len(counts) > 1:
            raise ValueError(f'the images of a layout have different prefix token counts {sorted(counts)}')
        return counts.pop()

    def check_tokens(self, x: torch.Tensor) -> None:
        """Raise a ValueError unless ``x`` is (B, L, ...) with B >= :attr:`num_rows` and L the layout's."""
        if x.dim() < 2 or x.shape[0] < self.num_rows or x.shape[1] != self.length:
            raise ValueError(f'a layout of {self.num_images} images in {self.num_rows} rows of {self.length} '
                             f'tokens does not fit tokens of shape {tuple(x.shape)}')

    def images_by_grid(self) -> Dict[TokenGrid, Tuple[int, ...]]:
        """The images of each distinct grid, in the order their grids first appear."""
        by_grid: Dict[TokenGrid, List[int]] = {}
        for image, grid in enumerate(self.grids):
            by_grid.setdefault(grid, []).append(image)
        return {grid: tuple(images) for grid, images in by_grid.items()}

    def groups(self, device: Optional[torch.device] = None) -> Iterator[GridGroup]:
        """The images of each distinct grid with their token positions on ``device`` (made on the
        CPU once per layout and device, :func:`_token_indices`)."""
        indices = _token_indices(self, torch.device('cpu') if device is None else torch.device(device))
        for (grid, images), index in zip(self.images_by_grid().items(), indices):
            yield GridGroup(grid, images, index)

    def per_grid(self, tensors: Sequence[Optional[torch.Tensor]], compute: Callable[..., torch.Tensor],
                 channels: int) -> torch.Tensor:
        """``compute(group, *parts)`` -> (images, N, channels) for the images of each distinct grid, with
        ``parts`` each tensor's tokens of those images (images, N, ...) (None for None), put in place:
        (B, L, channels) like ``tensors[0]`` (B, L, ...), zero at tokens of no image. Each tensor is
        gathered once and the outputs put back once, so the gradient of a layout of G grids costs one
        gather and one scatter, not G."""
        x = tensors[0]
        groups = list(self.groups(x.device))
        index = torch.cat([group.index.flatten() for group in groups])  # every image's tokens, grid by grid
        sizes = [group.index.numel() for group in groups]
        parts = [None if tensor is None else tensor.flatten(0, 1)[index].split(sizes) for tensor in tensors]
        outputs = [compute(group, *(None if split is None else split[number].unflatten(0, group.index.shape)
                                    for split in parts))
                   for number, group in enumerate(groups)]
        out = x.new_zeros(x.shape[0] * x.shape[1], channels)
        out = out.index_copy(0, index, torch.cat([output.flatten(0, 1) for output in outputs]))
        return out.view(x.shape[0], x.shape[1], channels)

    def valid(self, batch: Optional[int] = None, device: Optional[torch.device] = None) -> torch.Tensor:
        """(B, L) bool, True at every token of an image (B: ``batch``, default :attr:`num_rows`)."""
        batch = self.num_rows if batch is None else batch
        mask = torch.zeros(batch * self.length, dtype=torch.bool, device=device)
        for group in self.groups(device):
            mask[group.index.flatten()] = True
        return mask.view(batch, self.length)

    def images(self, x: torch.Tensor) -> List[torch.Tensor]:
        """Each image's tokens (N_i, ...), in the layout's order."""
        self.check_tokens(x)
        flat = x.flatten(0, 1)
        return [flat[row * self.length + start:row * self.length + start + grid.num_tokens]
                for grid, row, start in zip(self.grids, self.rows, self.starts)]

    def __str__(self) -> str:
        kinds = ', '.join(dict.fromkeys(f'{grid.height}x{grid.width}' for grid in self.grids))
        return f'layout of {self.num_images} images ({kinds}) in {self.num_rows} rows of {self.length} tokens'


@grid_constant(max_bytes=16 << 20)
def _token_indices(layout: ImageLayout, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """For each distinct grid of ``layout`` (:meth:`ImageLayout.images_by_grid`), the positions of its
    images' tokens in the (B * L) flattened rows, (images, N) int64 on ``device``."""
    indices = []
    for grid, images in layout.images_by_grid().items():
        firsts = torch.tensor([layout.rows[i] * layout.length + layout.starts[i] for i in images])
        indices.append((firsts[:, None] + torch.arange(grid.num_tokens)).to(device))
    return tuple(indices)


def run_by_size(function: Callable[[torch.Tensor], torch.Tensor], images: Sequence[torch.Tensor]) -> torch.Tensor:
    """``function`` of a batch, on images of different sizes: ``images`` (C, H_i, W_i) are batched by
    size, ``function`` maps each batch (B_s, C, H, W) to (B_s, ...), and the results are returned in
    the images' order, (len(images), ...). Each image's result is that of the image alone."""
    if isinstance(images, torch.Tensor) or not len(images):
        raise TypeError('expected a list of images (C, H, W), one per image, of any sizes')
    if not all(isinstance(image, torch.Tensor) and image.dim() == 3 for image in images):
        shapes = [tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__ for image in images]
        raise ValueError(f'each image of a list must be a tensor (C, H, W), got {shapes}')
    by_size: Dict[torch.Size, List[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault(image.shape, []).append(index)
    results = [function(torch.stack([images[i] for i in indices])) for indices in by_size.values()]
    order = torch.tensor([i for indices in by_size.values() for i in indices], device=results[0].device)
    return torch.cat(results).index_select(0, torch.argsort(order))


def _token_grids(grids: Sequence[GridLike], num_prefix_tokens: int) -> Tuple[TokenGrid, ...]:
    if isinstance(grids, (TokenGrid, str, bytes)) or not len(grids) or all(map(is_integer, grids)):
        raise TypeError(f'expected a sequence of (height, width) pairs or TokenGrids, one per image, got {grids!r}')
    return tuple(TokenGrid.of(grid, num_prefix_tokens) for grid in grids)
