"""``rpb``: a learned relative position bias table per head, as in Swin (Liu et al., ICCV 2021,
Sec. 3.2, "Relative position bias") and BEiT (Bao et al., ICLR 2022).

A grid pair (i, j) with offset (dy, dx) = p_i - p_j (query minus key, in rows and columns) reads

    b[h, i, j] = B[h, dy + H - 1, dx + W - 1]

from a table B of the (2H - 1) x (2W - 1) offsets of an H x W grid, one value per head. With
prefix (class) tokens, BEiT's three more entries per head: one for a prefix query and a grid key,
one for a grid query and a prefix key, one for two prefix tokens. The parameter is timm's
``relative_position_bias_table``, ((2H - 1)(2W - 1) [+ 3], heads), row (dy + H - 1)(2W - 1) +
dx + W - 1 then the three extra rows in that order, so a timm Swin or BEiT table copies as is.

The table is learned for one grid, ``table_size``; on a grid of another size it is resampled per
head to (2H - 1) x (2W - 1) offsets by bicubic interpolation (``align_corners=False``), what Swin's
release does to fine-tune at another window size (timm's ``resize_rel_pos_bias_table_simple``).
The resampling runs in the forward pass, so the learned table stays at its size and receives the
gradient of every grid; the extra entries are not resampled. The formulas, pair by pair:
:func:`posattn.reference.relative_position_bias` and :func:`posattn.reference.bicubic_resize`.

On a layout of images of different grids (:class:`~posattn.positions.TokenPositions`), bicubic
resampling being separable, every distinct grid's offset table is R_y T R_x^T with its 1D resampling
matrices (cached per layout), all in one batched product; each pair then reads its image's entry of
that flat table by a cached per-pair index, in one gather: (I, heads, M, M).

A model's own table becomes the Φp's as it is (:meth:`RelativePositionBias.of_table`, the same
Parameter): ``swap_attention(model, phi='own')`` converts timm's Swin and BEiT tables so.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._cache import grid_constant
from ..grid import TokenGrid
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from .base import PositionalModule
from .options import checked_count, checked_grid_prefix, checked_pair, checked_prefix_tokens
from .registry import register_phi
from .resampling import resampling_matrix

__all__ = ['RelativePositionBias', 'relative_position_index', 'num_offsets', 'checked_table_size']

NUM_PREFIX_ENTRIES = 3  # BEiT's prefix query -> grid key, grid query -> prefix key, prefix -> prefix


def num_offsets(height: int, width: int) -> int:
    """Relative offsets (dy, dx) between two tokens of an H x W grid: (2H - 1)(2W - 1)."""
    return (2 * height - 1) * (2 * width - 1)


@grid_constant(max_bytes=256 << 20)
def relative_position_index(height: int, width: int, num_prefix_tokens: int,
                            device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """Row of the flat table that every (query, key) pair reads: (N, N) int64, N = num_prefix_tokens
    + H * W, indexed [query, key]; cached.

    A grid pair reads (dy + H - 1)(2W - 1) + dx + W - 1. With D = (2H - 1)(2W - 1) offsets, a
    prefix query with a grid key reads D, a grid query with a prefix key D + 1, two prefix tokens
    D + 2 (BEiT's order). A pure function of its arguments, which are the cache key.
    """
    rows, cols = TokenGrid(height, width).positions(device)
    offset_rows = rows[:, None] - rows[None] + height - 1  # (HW, HW) query minus key, shifted to >= 0
    offset_cols = cols[:, None] - cols[None] + width - 1
    grid_ids = offset_rows * (2 * width - 1) + offset_cols
    prefix = num_prefix_tokens
    if prefix == 0:
        return grid_ids
    first = num_offsets(height, width)
    ids = torch.full((prefix + height * width,) * 2, first + 2, dtype=torch.long, device=device)
    ids[:prefix, prefix:] = first
    ids[prefix:, :prefix] = first + 1
    ids[prefix:, prefix:] = grid_ids
    return ids


def checked_table_size(table_size: Sequence[int], phi: str = 'rpb') -> Tuple[int, int]:
    """``table_size`` as an (H, W) pair of ints >= 1, or a ValueError saying what the Φp ``phi`` takes."""
    return checked_pair(table_size, phi, 'table_size', 'the grid it is learned for, e.g. (14, 14)')


@register_phi('rpb')
class RelativePositionBias(PositionalModule):
    """A learned bias per head and relative offset (module docstring); zero at init.

    The table starts at zero, as BEiT's does (Swin draws it from a normal of std 0.02, truncated):
    at init the layer is exactly the layer without the Φp, so swapping it into a trained model
    keeps the model's outputs.

    Args:
        num_heads: attention heads: one table column each.
        table_size: (H, W) of the grid the table is learned for: (2H - 1)(2W - 1) offsets. Another
            grid reads it resampled bicubically (module docstring). (14, 14) is a 224 px image in
            16 px patches.
        prefix_entries: with prefix tokens, BEiT's three learned entries per head for the pairs
            that involve one (the table then has 3 more rows); False gives those pairs no bias
            (0). Without prefix tokens there is nothing to learn for them, and the table has no
            extra rows (Swin's layout).
        num_prefix_tokens: extra tokens before the grid; the attention layer's own count.
    """

    def __init__(self, num_heads: int, table_size: Sequence[int] = (14, 14), prefix_entries: bool = True,
                 num_prefix_tokens: int = 0):
        num_prefix_tokens = checked_prefix_tokens(num_prefix_tokens, 'rpb')
        if not isinstance(prefix_entries, bool):
            raise ValueError(f'rpb prefix_entries must be True or False, got {prefix_entries!r}')
        # its prefix entries bias prefix pairs; without them prefix pairs get no bias
        super().__init__(hooks=('logits_bias',), reaches_prefix_queries=prefix_entries and num_prefix_tokens > 0)
        num_heads = checked_count(num_heads, 'rpb', 'num_heads')
        self.num_heads = int(num_heads)
        self.table_size = checked_table_size(table_size)
        self.prefix_entries = prefix_entries
        self.num_prefix_tokens = num_prefix_tokens
        self.num_extra_entries = NUM_PREFIX_ENTRIES if prefix_entries and num_prefix_tokens > 0 else 0
        rows = num_offsets(*self.table_size) + self.num_extra_entries
        self.relative_position_bias_table = nn.Parameter(torch.zeros(rows, self.num_heads))  # timm's layout

    @classmethod
    def of_table(cls, table: nn.Parameter, table_size: Sequence[int],
                 num_prefix_tokens: int = 0) -> 'RelativePositionBias':
        """The rpb whose table is ``table`` itself, a model's own (timm's Swin and BEiT
        ``relative_position_bias_table``: the same Parameter, so that a step of either trains it),
        learned for a ``table_size`` grid: one head a column, BEiT's three extra rows last where
        there are prefix tokens."""
        phi = cls(table.shape[-1], table_size, num_prefix_tokens=num_prefix_tokens)
        phi.set_table(table, table_size)
        return phi

    def set_table(self, table: nn.Parameter, table_size: Sequence[int]) -> None:
        """Read ``table``, learned for a ``table_size`` grid, as this module's own parameter from now on
        (a model's resize of its table, timm's ``set_window_size``, hands the new one over so)."""
        height, width = checked_table_size(table_size)
        rows = num_offsets(height, width) + self.num_extra_entries
        if not isinstance(table, nn.Parameter) or tuple(table.shape) != (rows, self.num_heads):
            raise ValueError(f'rpb with {self.num_heads} heads and {self.num_extra_entries} extra entries takes a '
                             f'table Parameter of shape ({rows}, {self.num_heads}) for a {height}x{width} grid, got '
                             f'{type(table).__name__} of shape {tuple(getattr(table, "shape", ()))}')
        self.table_size = (height, width)
        self.relative_position_bias_table = table

    def learned_table(self) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """The table, ((2H - 1)(2W - 1) [+ 3], heads), and the (H, W) it is learned for."""
        return self.relative_position_bias_table, self.table_size

    def offset_table(self, height: int, width: int) -> torch.Tensor:
        """The bias of every offset of an H x W grid, (heads, 2H - 1, 2W - 1), [h, dy + H - 1, dx + W - 1]:
        the table resampled bicubically, which gives the learned table itself on a grid of its size.

        The resampling runs whatever the size, and is exact there (every sample falls on a learned
        value): a test of the size would fix the grid of a graph traced by ``torch.export``.
        """
        table, (table_height, table_width) = self.learned_table()
        learned = table[:num_offsets(table_height, table_width)]
        canvas = rearrange(learned, '(y x) h -> h y x', y=2 * table_height - 1)  # (heads, 2H_t - 1, 2W_t - 1)
        return F.interpolate(canvas[None], size=(2 * height - 1, 2 * width - 1), mode='bicubic',
                             align_corners=False)[0]

    def _grid(self, grid: TokenGrid) -> TokenGrid:
        return checked_grid_prefix(grid, self.num_prefix_tokens, 'rpb')

    def position_bias(self, grid: TokenGrid, dtype: Optional[torch.dtype] = None,
                      device: Optional[torch.device] = None) -> torch.Tensor:
        """b[h, i, j] of the module docstring on ``grid``: (1, heads, N, N), in ``dtype`` (the table's by
        default); the logits bias (:meth:`logits_bias`, served by :func:`posattn.cache_positions`)."""
        grid = self._grid(grid)
        table = self.learned_table()[0]
        device = device or table.device
        per_offset = self.offset_table(grid.height, grid.width).flatten(1)  # (heads, (2H-1)(2W-1))
        if self.num_extra_entries:
            extra = table[-self.num_extra_entries:].t()  # (heads, 3)
            ids = relative_position_index(grid.height, grid.width, grid.num_prefix_tokens, device)
            bias = torch.cat([per_offset, extra], 1)[:, ids]  # (heads, N, N)
        else:
            bias = grid.pad_prefix(per_offset[:, relative_position_index(grid.height, grid.width, 0, device)])
        return bias.unsqueeze(0).to(dtype or bias.dtype)

    def logits_bias_at(self, q: torch.Tensor, k: torch.Tensor, positions: TokenPositions,
                       **given: Any) -> torch.Tensor:
        """b[h, i, j] of every pair of an image's tokens, on rows of images: (I, heads, M, M) in q's dtype.

        The offset tables of all the layout's distinct grids are made at once, R_y T R_x^T with the
        resampling matrices of their sizes (:mod:`posattn.phi.resampling`) in one batched product, and
        every pair reads its image's entry in one gather."""
        checked_grid_prefix(positions, self.num_prefix_tokens, 'rpb')
        table, (table_height, table_width) = self.learned_table()
        along_y, along_x, pair_entry = _layout_entries(positions.layout, positions.batch, (table_height, table_width),
                                                       self.num_extra_entries, table.dtype, q.device)
        learned = table[:num_offsets(table_height, table_width)]
        canvas = learned.unflatten(0, (2 * table_height - 1, -1))  # (Y_t, X_t, heads)
        rows = torch.einsum('gya,axh->gyxh', along_y, canvas)  # (G, Y, X_t, h)
        entries = torch.einsum('gyxh,gzx->gyzh', rows, along_x).flatten(0, 2)  # each distinct grid's table, (E, heads)
        flat = torch.cat([entries, table[table.shape[0] - self.num_extra_entries:], table.new_zeros(1, self.num_heads)])
        flat = flat.t().to(q.dtype)  # (heads, E + extra + 1): the small table cast, not the gathered bias
        bias = flat.index_select(1, pair_entry.flatten())  # (heads, I M M): one contiguous gather a head
        return bias.view(-1, *pair_entry.shape).transpose(0, 1)  # (I, heads, M, M)

    def settings(self) -> Dict[str, Any]:
        return {'num_heads': self.num_heads, 'table_size': self.table_size, 'prefix_entries': self.prefix_entries,
                'num_prefix_tokens': self.num_prefix_tokens}


@grid_constant(max_bytes=128 << 20)
def _layout_entries(layout: ImageLayout, batch: int, table_size: Tuple[int, int], num_extra_entries: int,
                    dtype: torch.dtype, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """What :meth:`RelativePositionBias.logits_bias_at` reads for a layout; cached.

    For each of the G distinct grids, the bicubic matrices from the table's 2H_t - 1 row offsets to
    its 2H - 1, zero-padded to the largest, (G, Y, 2H_t - 1), and likewise for columns (G, X, 2W_t - 1),
    so that R_y T R_x^T of every grid is one product, (G, Y, X, heads), E = G Y X entries; and for every
    pair of a row of images the entry it reads (I, M, M): a grid pair its offset's in its image's
    grid, a pair with a prefix token BEiT's extra entry E, E + 1 or E + 2 where there are extra entries,
    anything else the zero entry after them."""
    grids = tuple(layout.images_by_grid())
    longest_y = 2 * max(grid.height for grid in grids) - 1
    longest_x = 2 * max(grid.width for grid in grids) - 1
    along_y = torch.zeros(len(grids), longest_y, 2 * table_size[0] - 1, dtype=torch.float64)
    along_x = torch.zeros(len(grids), longest_x, 2 * table_size[1] - 1, dtype=torch.float64)
    for index, grid in enumerate(grids):
        along_y[index, :2 * grid.height - 1] = resampling_matrix(2 * table_size[0] - 1, 2 * grid.height - 1, 'bicubic')
        along_x[index, :2 * grid.width - 1] = resampling_matrix(2 * table_size[1] - 1, 2 * grid.width - 1, 'bicubic')
    positions = token_positions(layout, batch, torch.device('cpu'))
    dy, dx = positions.offsets()
    height, width = positions.height[:, :, None], positions.width[:, :, None]  # (I, M, 1): the image's grid
    image_grid = positions.grid_id[:, None, None]  # (I, 1, 1)
    grid_entry = (image_grid * longest_y + dy + height - 1) * longest_x + dx + width - 1
    first_extra = len(grids) * longest_y * longest_x
    query_grid, key_grid = positions.is_grid[:, :, None], positions.is_grid[:, None, :]
    query_prefix, key_prefix = positions.is_prefix[:, :, None], positions.is_prefix[:, None, :]
    zero_entry = torch.full_like(grid_entry, first_extra + num_extra_entries)
    entry = torch.where(query_grid & key_grid, grid_entry, zero_entry)
    if num_extra_entries:
        entry = torch.where(query_prefix & key_grid, first_extra, entry)
        entry = torch.where(query_grid & key_prefix, first_extra + 1, entry)
        entry = torch.where(query_prefix & key_prefix, first_extra + 2, entry)
    return along_y.to(device, dtype), along_x.to(device, dtype), entry.to(device)
