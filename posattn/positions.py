"""Each token's image, row and column on the device: attention on a layout in one call.

A layer given an :class:`~posattn.layout.ImageLayout` gathers its images one a row, (I, M, C) with
M the most tokens of an image and each image's tokens first in its row, its prefix tokens then its
H_i x W_i grid in row-major order. :class:`TokenPositions` holds, for that arrangement, where each
token came from and where it lies in its image, as tensors on the model's device, made once per
layout, batch size and device (cached) and shared by every layer:

    index (I, M)            its place in the (B * L) flattened tokens of the layout
    valid (I, M)            a token of the image (False: padding after it)
    is_grid (I, M)          a grid token (False: a prefix token or padding)
    row, col (I, M)         its grid row and column (0 off the grid)
    height, width (I, M)    its image's grid H_i, W_i (1 at padding)
    grid_id (I,)            which of the layout's distinct grids the image has

A Φp whose terms are per token (RoPE's rotation) or per pair of tokens (a relative bias, a bucket
table) computes them from these; attention then runs once over the I rows with ``valid`` as its
key mask. One image a row makes the key mask the block-diagonal mask of the batch: tokens of
different images never see each other, and padding is never attended to. Nothing here reads a
tensor back to the host: building the tensors is host work once per layout, and the gathering and
putting back are index operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ._cache import grid_constant
from .grid import TokenGrid
from .layout import ImageLayout

__all__ = ['TokenPositions', 'token_positions']


@dataclass(frozen=True, eq=False)
class TokenPositions:
    """The positions of a layout's tokens, its images one a row (module docstring)."""
    layout: ImageLayout
    batch: int
    index: torch.Tensor
    valid: torch.Tensor
    is_grid: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    grid_id: torch.Tensor
    sources: torch.Tensor  # (T,) the valid tokens' places in the (I * M) flattened rows
    targets: torch.Tensor  # (T,) their places in the (B * L) flattened tokens
    padding: torch.Tensor  # (I * M - T,) the padding's places in the (I * M) flattened rows

    @property
    def num_prefix_tokens(self) -> int:
        return self.layout.num_prefix_tokens

    @property
    def num_images(self) -> int:
        return self.index.shape[0]

    @property
    def length(self) -> int:
        """M, the tokens of a row: the most of any image."""
        return self.index.shape[1]

    @property
    def distinct_grids(self) -> Tuple[TokenGrid, ...]:
        """The layout's distinct grids, in the order ``grid_id`` counts them."""
        return tuple(self.layout.images_by_grid())

    @property
    def is_prefix(self) -> torch.Tensor:
        """(I, M) bool: a prefix (class, register) token of its image."""
        return self.valid & ~self.is_grid

    def offsets(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The row and column offsets of every (query, key) pair of a row, query minus key: two (I, M, M)
        int64 (cached). Only pairs of grid tokens (:meth:`grid_pairs`) mean anything."""
        return _pair_offsets(self.layout, self.batch, self.index.device)

    def grid_pairs(self) -> torch.Tensor:
        """(I, M, M) bool: both the query and the key are grid tokens of the row's image."""
        return self.is_grid[:, :, None] & self.is_grid[:, None, :]

    @property
    def rows_are_images(self) -> bool:
        """Whether the layout is already one image a row, each from its first token, every row an
        image's and no longer than the longest image (a NaFlex batch): gathering then moves nothing."""
        layout = self.layout
        return (self.batch == self.num_images and layout.length == self.length
                and layout.rows == tuple(range(self.num_images)) and not any(layout.starts))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The layout's tokens (B, L, ...) as its images one a row, (I, M, ...). A padding token is zero
        where the rows are already the images, else it repeats the last token of its image: a finite
        value, never attended to, its output dropped."""
        if self.rows_are_images:
            return self._zero_padding(x)
        return x.flatten(0, 1)[self.index]

    def place(self, out: torch.Tensor) -> torch.Tensor:
        """Rows (I, M, C) put back in the layout, (B, L, C), zero at tokens of no image."""
        if self.rows_are_images:
            return self._zero_padding(out)
        channels = out.shape[-1]
        flat = out.new_zeros(self.batch * self.layout.length, channels)
        flat = flat.index_copy(0, self.targets, out.reshape(-1, channels).index_select(0, self.sources))
        return flat.view(self.batch, self.layout.length, channels)

    def _zero_padding(self, x: torch.Tensor) -> torch.Tensor:
        """(I, M, ...) with the padding set to zero: a fill of its few rows (a mask over every token
        costs three times as much)."""
        return x.flatten(0, 1).index_fill(0, self.padding, 0).view_as(x)

    def mask_padding_keys_(self, bias: torch.Tensor) -> torch.Tensor:
        """``bias`` (I, heads, M, M), a term of the logits, set to -inf in place at every padding key:
        the key mask folded into a bias of every image, where adding a (I, 1, 1, M) mask would write
        another tensor as large."""
        image, token = self.padding.div(self.length, rounding_mode='floor'), self.padding.remainder(self.length)
        bias.permute(0, 3, 1, 2).index_put_((image, token), bias.new_full((), float('-inf')))
        return bias

    def keeps_a_key(self, key_mask: torch.Tensor) -> bool:
        """Whether ``key_mask`` is :attr:`valid` itself, so that every row keeps a key (its image's
        tokens): attention then need not zero the output of rows with none."""
        return key_mask is self.valid

    def __str__(self) -> str:
        return str(self.layout)


def token_positions(layout: ImageLayout, batch: int, device: torch.device) -> TokenPositions:
    """The :class:`TokenPositions` of ``layout`` in a (``batch``, L, C) tensor on ``device`` (cached)."""
    if batch < layout.num_rows:
        raise ValueError(f'a {layout} needs at least {layout.num_rows} rows, got {batch}')
    return TokenPositions(layout, batch, *_coordinates(layout, batch, torch.device(device)))


@grid_constant(max_bytes=64 << 20)
def _coordinates(layout: ImageLayout, batch: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """index, valid, is_grid, row, col, height, width (I, M), grid_id (I,), sources and targets (T,),
    padding."""
    grid_ids = {grid: number for number, grid in enumerate(layout.images_by_grid())}
    counts = torch.tensor([grid.num_tokens for grid in layout.grids])  # (I,)
    heights = torch.tensor([grid.height for grid in layout.grids])
    widths = torch.tensor([grid.width for grid in layout.grids])
    firsts = torch.tensor([row * layout.length + start for row, start in zip(layout.rows, layout.starts)])
    prefix = layout.num_prefix_tokens
    token = torch.arange(int(counts.max()))[None]  # (1, M)
    valid = token < counts[:, None]  # (I, M)
    index = firsts[:, None] + torch.minimum(token, counts[:, None] - 1)
    is_grid = valid & (token >= prefix)
    cell = (token - prefix).clamp(min=0)
    row = torch.where(is_grid, cell // widths[:, None], 0)
    col = torch.where(is_grid, cell % widths[:, None], 0)
    height = torch.where(valid, heights[:, None], 1)
    width = torch.where(valid, widths[:, None], 1)
    grid_id = torch.tensor([grid_ids[grid] for grid in layout.grids])
    sources = torch.arange(valid.numel())[valid.flatten()]
    targets = index.flatten()[valid.flatten()]
    padding = torch.arange(valid.numel())[~valid.flatten()]
    return tuple(t.to(device) for t in (index, valid, is_grid, row, col, height, width, grid_id, sources, targets,
                                        padding))


@grid_constant(max_bytes=256 << 20)
def _pair_offsets(layout: ImageLayout, batch: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    positions = token_positions(layout, batch, device)
    return (positions.row[:, :, None] - positions.row[:, None, :],
            positions.col[:, :, None] - positions.col[:, None, :])
