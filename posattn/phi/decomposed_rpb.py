"""``decomposed_rpb``: decomposed relative position embeddings, a relative position bias read by the
query, one table per axis, as in MViTv2 (Li et al., CVPR 2022, Sec. 4.1) and the image encoder of
Segment Anything (Kirillov et al., ICCV 2023; ViTDet's backbone, Li et al., ECCV 2022):

    b[h, i, j] = q_h,i · R_h[dy + H - 1] + q_h,i · R_w[dx + W - 1]

with (dy, dx) = p_i - p_j the offset of query i from key j in rows and columns of an H x W grid,
q_h,i the query of head h (after the layer's q norm, unscaled: the bias is added to
q k^T / sqrt(d) as it is, as MViTv2's and SAM's code add it), and R_h (2H - 1, d), R_w (2W - 1, d)
learned embeddings of the row and column offsets, shared by the heads (SAM's ``rel_pos_h`` and
``rel_pos_w``). The bias depends on the query, so it has a batch dimension and is never cached.

The embeddings are learned for one grid, ``table_size``; on a grid of another size each is
resampled along its offsets to 2H - 1 (2W - 1) rows by linear interpolation
(``align_corners=False``), what SAM's ``get_rel_pos`` does for an input of another size. The
resampling runs in the forward pass (exact on the table's grid), so the learned embeddings keep
their size and receive the gradient of every grid. Pairs that involve a prefix (class) token get no
bias, as in MViTv2. The formulas, pair by pair: :func:`posattn.reference.decomposed_relative_position_bias`
and :func:`posattn.reference.linear_resize`.

On a layout of images of different grids (:class:`~posattn.positions.TokenPositions`), the embeddings are
resampled to every distinct axis length at once by stacked 1D resampling matrices (cached per layout);
each query is dotted with its image's offsets of each axis and read at its offset from every coordinate
of the axis, and the bias is that times each key's coordinates one-hot: one product, (I, heads, M, M),
with no per-pair index (whose gathers, and their scatters in the backward, cost more than the product).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._cache import grid_constant
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from ..grid import TokenGrid
from .base import PositionalModule
from .registry import register_phi
from .resampling import distinct, stacked_resampling
from .options import checked_count, checked_grid_prefix, checked_prefix_tokens
from .rpb import checked_table_size

__all__ = ['DecomposedRelativePositionBias', 'axis_offset_index', 'resampled_offsets']


@grid_constant(max_bytes=16 << 20)
def axis_offset_index(length: int, device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """Row of an axis's embeddings that every (query, key) pair along an axis of ``length`` positions
    reads: query minus key plus length - 1, (length, length) int64, [query, key]; cached."""
    positions = torch.arange(length, device=device)
    return positions[:, None] - positions[None] + length - 1


def resampled_offsets(embeddings: torch.Tensor, num_offsets: int) -> torch.Tensor:
    """Offset embeddings (L, d) resampled along L to (num_offsets, d) by linear interpolation,
    ``align_corners=False`` (SAM's ``get_rel_pos``); the embeddings themselves where L = num_offsets."""
    return F.interpolate(embeddings.t()[None], size=num_offsets, mode='linear', align_corners=False)[0].t()


@register_phi('decomposed_rpb')
class DecomposedRelativePositionBias(PositionalModule):
    """Decomposed relative position embeddings (module docstring); zero at init, as SAM's are, so
    that swapping them into a trained model keeps its outputs.

    Args:
        head_dim: channels d of a head's query: the width of each embedding.
        table_size: (H, W) of the grid the embeddings are learned for: 2H - 1 row offsets and 2W - 1
            column offsets. Another grid reads them resampled linearly (module docstring). (14, 14)
            is a 224 px image in 16 px patches, and SAM's 14 x 14 windows.
        num_prefix_tokens: extra tokens before the grid; the attention layer's own count.
    """

    def __init__(self, head_dim: int, table_size: Sequence[int] = (14, 14), num_prefix_tokens: int = 0):
        super().__init__(hooks=('logits_bias',), bias_per_image=True,  # the bias reads the queries
                         reaches_prefix_queries=False)  # pairs that involve a prefix token get no bias
        head_dim = checked_count(head_dim, 'decomposed_rpb', 'head_dim')
        num_prefix_tokens = checked_prefix_tokens(num_prefix_tokens, 'decomposed_rpb')
        height, width = checked_table_size(table_size, 'decomposed_rpb')
        self.num_prefix_tokens = num_prefix_tokens
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * height - 1, int(head_dim)))  # SAM's names and layout
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * width - 1, int(head_dim)))

    @classmethod
    def of_tables(cls, rel_pos_h: nn.Parameter, rel_pos_w: nn.Parameter) -> 'DecomposedRelativePositionBias':
        """The Φp whose embeddings are ``rel_pos_h`` and ``rel_pos_w`` themselves, a model's own (timm's
        SAM ``Attention``'s: the same Parameters, so that a step of either trains them), learned for
        the grid their numbers of offsets give, for attention without prefix tokens (SAM's)."""
        for name, table in (('rel_pos_h', rel_pos_h), ('rel_pos_w', rel_pos_w)):
            if not isinstance(table, nn.Parameter) or table.dim() != 2 or table.shape[0] % 2 == 0:
                raise ValueError(f'decomposed_rpb takes {name} as a Parameter (2 L - 1, head_dim), an odd number of '
                                 f'offsets of an axis of L positions; got {type(table).__name__} of shape '
                                 f'{tuple(getattr(table, "shape", ()))}')
        if rel_pos_h.shape[1] != rel_pos_w.shape[1]:
            raise ValueError(f'decomposed_rpb takes rel_pos_h and rel_pos_w of the same head_dim, got '
                             f'{rel_pos_h.shape[1]} and {rel_pos_w.shape[1]}')
        table_size = ((rel_pos_h.shape[0] + 1) // 2, (rel_pos_w.shape[0] + 1) // 2)
        phi = cls(rel_pos_h.shape[1], table_size)
        phi.rel_pos_h, phi.rel_pos_w = rel_pos_h, rel_pos_w
        return phi

    @property
    def table_size(self) -> Tuple[int, int]:
        """(H, W) of the grid the embeddings are learned for."""
        return (self.rel_pos_h.shape[0] + 1) // 2, (self.rel_pos_w.shape[0] + 1) // 2

    @property
    def head_dim(self) -> int:
        """Channels of each embedding: the width of a head's query."""
        return self.rel_pos_h.shape[1]

    def offset_embeddings(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """R_h (2H - 1, d) and R_w (2W - 1, d) of an H x W grid, [dy + H - 1] and [dx + W - 1]: the
        learned ones, resampled linearly, which gives them as they are on the table's grid.

        The resampling runs whatever the size, and is exact there (every sample falls on a learned
        value): a test of the size would fix the grid of a graph traced by ``torch.export``.
        """
        return resampled_offsets(self.rel_pos_h, 2 * height - 1), resampled_offsets(self.rel_pos_w, 2 * width - 1)

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """b[h, i, j] of the module docstring from the queries q (B, heads, N, d): (B, heads, N, N) in
        q's dtype, zero wherever a prefix token is."""
        grid = checked_grid_prefix(grid, self.num_prefix_tokens, 'decomposed_rpb')
        if q.shape[-1] != self.head_dim:
            raise ValueError(f'decomposed_rpb built with head_dim={self.head_dim} got queries of {q.shape[-1]} '
                             f'channels a head: build it with head_dim={q.shape[-1]}')
        height, width = grid.height, grid.width
        along_rows, along_cols = self.offset_embeddings(height, width)
        queries = q[:, :, grid.num_prefix_tokens:].unflatten(2, (height, width))  # (B, heads, H, W, d)
        batch, heads = q.shape[:2]
        # each query against every offset, then the offsets from its row (column) to each key row (column)
        row_ids = axis_offset_index(height, q.device)[:, None].expand(batch, heads, height, width, height)
        col_ids = axis_offset_index(width, q.device).expand(batch, heads, height, width, width)
        row_terms = (queries @ along_rows.t().to(q.dtype)).gather(-1, row_ids)  # (B, heads, H, W, H): key row
        col_terms = (queries @ along_cols.t().to(q.dtype)).gather(-1, col_ids)  # (B, heads, H, W, W): key column
        bias = (row_terms[..., :, None] + col_terms[..., None, :]).flatten(4).flatten(2, 3)  # (B, heads, HW, HW)
        return grid.pad_prefix(bias).to(q.dtype)

    def logits_bias_at(self, q: torch.Tensor, k: torch.Tensor, positions: TokenPositions,
                       **given: Any) -> torch.Tensor:
        """b[h, i, j] on rows of images, from the queries q (I, heads, M, d): (I, heads, M, M) in q's dtype,
        the row term plus the column term (:meth:`_axis_factors`), zero wherever a prefix token or padding is."""
        checked_grid_prefix(positions, self.num_prefix_tokens, 'decomposed_rpb')
        if q.shape[-1] != self.head_dim:
            raise ValueError(f'decomposed_rpb built with head_dim={self.head_dim} got queries of {q.shape[-1]} '
                             f'channels a head: build it with head_dim={q.shape[-1]}')
        reads_h, keys_h = self._axis_factors(q, positions, 0)
        reads_w, keys_w = self._axis_factors(q, positions, 1)
        keys = torch.cat([keys_h, keys_w], -1).to(q.dtype)  # (I, M, L_max + W_max)
        return torch.cat([reads_h, reads_w], -1) @ keys[:, None].transpose(-2, -1)  # (I, heads, M, M)

    def _axis_factors(self, q: torch.Tensor, positions: TokenPositions, axis: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The term of ``axis`` (0: rows, R_h; 1: columns, R_w) of every pair of a row of images as a product,
        q_h,i · R[c_i - c_j + L - 1] = sum_r A[h, i, r] K[j, r]: A (I, heads, M, L_max), each query dotted with
        its image's offsets (the embeddings resampled to every distinct length of the layout in one product,
        then a zero row) and read at its offset from each coordinate r of the axis; K (I, M, L_max), each key's
        coordinate one-hot. A prefix query reads the zero row, a prefix or padding key is a zero row of K:
        one (M x L_max) (L_max x M) product a pair of axes, no (I, heads, M, M) gather."""
        embeddings = self.rel_pos_h if axis == 0 else self.rel_pos_w
        resampling, offset_rows, query_reads, key_coordinates = _layout_axis(
            positions.layout, positions.batch, axis, embeddings.shape[0], embeddings.dtype, q.device)
        per_image = (resampling @ embeddings)[offset_rows].to(q.dtype)  # (I, 2 L_max, d): its offsets, a zero row
        lookup = q @ per_image[:, None].transpose(-2, -1)  # (I, heads, M, 2 L_max)
        return lookup.gather(-1, query_reads[:, None].expand(*q.shape[:3], -1)), key_coordinates

    def settings(self) -> Dict[str, Any]:
        return {'head_dim': self.head_dim, 'table_size': self.table_size, 'num_prefix_tokens': self.num_prefix_tokens}


@grid_constant(max_bytes=64 << 20)
def _layout_axis(layout: ImageLayout, batch: int, axis: int, num_offsets: int, dtype: torch.dtype,
                 device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :meth:`DecomposedRelativePositionBias._axis_factors` reads along ``axis`` (0: rows, 1:
    columns) of a layout's images, one a row; cached:

    * the linear resampling from ``num_offsets`` learned offsets to each distinct 2L - 1 of the layout,
      stacked, then a zero row: (S + 1, num_offsets), S the sum of the distinct 2L - 1;
    * for each image the rows of its 2L - 1 offsets (padded with its last), then the zero row: (I, 2 L_max);
    * for each query and each coordinate r of the axis, the offset it reads, its coordinate minus r
      plus L - 1 (the zero row's 2 L_max - 1 for a prefix or padding query, or r >= L): (I, M, L_max);
    * each key's coordinate one-hot, zero for a prefix or padding key: (I, M, L_max), in ``dtype``.
    """
    lengths = [grid.height if axis == 0 else grid.width for grid in layout.grids]
    sizes = distinct(2 * length - 1 for length in lengths)
    resampling, starts = stacked_resampling(num_offsets, sizes, 'linear', dtype, torch.device('cpu'))
    resampling = torch.cat([resampling, resampling.new_zeros(1, num_offsets)])
    zero_row = resampling.shape[0] - 1
    longest = max(sizes)
    offsets = torch.arange(longest)
    offset_rows = torch.stack([torch.cat([starts[sizes.index(2 * length - 1)] + offsets.clamp(max=2 * length - 2),
                                          torch.tensor([zero_row])]) for length in lengths])
    positions = token_positions(layout, batch, torch.device('cpu'))
    coordinate = positions.row if axis == 0 else positions.col  # (I, M)
    length = (positions.height if axis == 0 else positions.width)[:, :, None]  # (I, M, 1)
    axis_values = torch.arange(max(lengths))  # r, (L_max,)
    reads = torch.where(positions.is_grid[:, :, None] & (axis_values < length),
                        coordinate[:, :, None] - axis_values + length - 1, longest)
    one_hot = (coordinate[:, :, None] == axis_values) & positions.is_grid[:, :, None]
    return resampling.to(device), offset_rows.to(device), reads.to(device), one_hot.to(device, dtype)
