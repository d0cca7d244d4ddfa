"""``irpe``: image relative position encoding (Wu et al., ICCV 2021, "Rethinking and Improving
Relative Position Encoding for Vision Transformer"), as the authors' release computes it.

Every (query, key) pair of the grid falls in a bucket by its 2D offset (Sec. 3.2-3.3: the
piecewise index g and the methods euc, quant, cross, product), pairs with a prefix token in one
more, and a learned table per bucket adds to the logits (bias mode, or contextual: dotted with the
query or key) or to the output (contextual, on v), Eq. 11-13. The formulas, written out pair by
pair, are :func:`posattn.reference.irpe_bucket_ids` and :func:`posattn.reference.irpe_attention`
(and ``docs/phi.md``). Here the id table is computed once per grid on the offset canvas, and the
contextual terms never build an (N, N, d) tensor: q_s @ T_k gives (B, heads, N, buckets), gathered
by the (N, N) id table; on v, the probabilities are summed into (B, heads, N, buckets) by bucket
and multiplied by T_v. On a layout's images one a row, a bucket depending on the offset alone, each
pair reads its id from the offset canvas of the layout's largest grid, so that it gets its image's id;
in bias mode the tables' terms are summed on that canvas and each pair reads the sum in one gather.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .._cache import grid_constant
from ..grid import GridLike, TokenGrid
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from .base import PositionalModule
from .options import checked_grid_prefix, checked_prefix_tokens
from .registry import register_phi

__all__ = ['IRPE', 'bucket_ids', 'num_buckets', 'piecewise_index']

METHODS = ('euc', 'quant', 'cross', 'product')
MODES = ('bias', 'ctx')
ON = ('q', 'k', 'v', 'qk', 'kv', 'qkv')
_CROSS_AXES = ('rp_rows', 'rp_cols')  # the release's names of cross's two tables


def piecewise_index(offsets: torch.Tensor, ratio: float) -> torch.Tensor:
    """g(x) of iRPE Eq. 18 with alpha = ratio, beta = 2 ratio, gamma = 8 ratio, as int64.

    Offsets within alpha stay exact; farther ones are compressed logarithmically up to beta,
    then truncated toward zero (the range is [-int(beta), int(beta)]).
    """
    alpha, beta, gamma = ratio, 2.0 * ratio, 8.0 * ratio
    x = offsets.to(torch.float64)
    far = x.abs() > alpha
    compressed = alpha + torch.log(x.abs().clamp(min=alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far_values = torch.sign(x) * compressed.round().clamp(max=beta)
    return torch.where(far, far_values, x).long()  # .long() truncates toward zero


def _axis_buckets(ratio: float) -> int:
    return 2 * int(2.0 * ratio) + 1


def num_buckets(method: str, ratio: float, num_prefix_tokens: int) -> int:
    """Buckets of one table: 2b + 1 ((2b + 1)^2 for product), plus one shared by the extra tokens."""
    per_axis = _axis_buckets(ratio)
    return (per_axis ** 2 if method == 'product' else per_axis) + (1 if num_prefix_tokens > 0 else 0)


def offset_buckets(height: int, width: int, method: str, ratio: float) -> torch.Tensor:
    """The bucket of every offset (dr, dc) of an H x W grid, (tables, 2H - 1, 2W - 1) int64,
    [table, dr + H - 1, dc + W - 1]: one table for euc, quant and product, two (rows, columns) for cross.
    A bucket depends on the offset alone, not on the grid's size."""
    dr, dc = torch.meshgrid(torch.arange(1 - height, height), torch.arange(1 - width, width), indexing='ij')
    b = int(2.0 * ratio)
    if method == 'euc':
        per_offset = [piecewise_index(torch.sqrt((dr ** 2 + dc ** 2).double()).round(), ratio) + b]
    elif method == 'quant':
        per_offset = [piecewise_index(dr ** 2 + dc ** 2, ratio) + b]
    elif method == 'cross':
        per_offset = [piecewise_index(dr, ratio) + b, piecewise_index(dc, ratio) + b]
    elif method == 'product':
        per_offset = [(piecewise_index(dr, ratio) + b) * (2 * b + 1) + piecewise_index(dc, ratio) + b]
    else:
        raise ValueError(f'unknown iRPE method {method!r}; choose one of {", ".join(METHODS)}')
    return torch.stack(per_offset)


@grid_constant(max_bytes=256 << 20)
def bucket_ids(height: int, width: int, num_prefix_tokens: int, method: str, ratio: float,
               device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """Bucket ids (tables, L, L), L = num_prefix_tokens + H * W, indexed [table, query, key]; cached.

    One table for euc, quant and product, two (rows, columns) for cross. Pairs involving an extra
    token get the last bucket. A pure function of its arguments, which are the cache key.
    """
    # g is evaluated once per distinct offset, on the (2H-1, 2W-1) offset canvas, then read per pair.
    per_offset = offset_buckets(height, width, method, ratio)
    rows, cols = TokenGrid(height, width).positions()
    offset_rows = rows[:, None] - rows[None] + height - 1  # (HW, HW) query minus key, shifted to >= 0
    offset_cols = cols[:, None] - cols[None] + width - 1
    grid_ids = per_offset[:, offset_rows, offset_cols]
    tokens = num_prefix_tokens + height * width
    shared_bucket = num_buckets(method, ratio, num_prefix_tokens) - 1
    ids = torch.full((len(grid_ids), tokens, tokens), shared_bucket, dtype=torch.long)
    ids[:, num_prefix_tokens:, num_prefix_tokens:] = grid_ids
    return ids.to(device)


@grid_constant(max_bytes=128 << 20)
def layout_offset_entries(layout: ImageLayout, batch: int, device: torch.device) -> torch.Tensor:
    """Each pair's entry on the offset canvas of a layout's images, one a row: (I, M, M) int32,
    (dy + H - 1)(2W - 1) + dx + W - 1 for a pair of grid tokens of offset (dy, dx), H and W the most rows
    and columns of the layout's grids, and (2H - 1)(2W - 1), the entry after the canvas, for every
    other pair (a prefix token, padding); cached."""
    height, width = _largest_extent(layout)
    positions = token_positions(layout, batch, device)
    dy, dx = positions.offsets()
    entries = (dy + height - 1) * (2 * width - 1) + dx + width - 1
    return torch.where(positions.grid_pairs(), entries, (2 * height - 1) * (2 * width - 1)).to(torch.int32)


@grid_constant(max_bytes=16 << 20)
def layout_canvas_ids(layout: ImageLayout, method: str, ratio: float,
                      device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The bucket of every entry of a layout's offset canvas (:func:`layout_offset_entries`), (tables, E + 1)
    int64 with E = (2H - 1)(2W - 1): each offset's (:func:`offset_buckets`), then the shared last bucket;
    and the same read at the opposite offset, key minus query (the id T_q is read at); cached."""
    height, width = _largest_extent(layout)
    per_offset = offset_buckets(height, width, method, ratio).flatten(1)  # (tables, E), row-major offsets
    shared = torch.full((len(per_offset), 1), num_buckets(method, ratio, layout.num_prefix_tokens) - 1)
    # row-major, the opposite offset (-dy, -dx) of entry e is entry E - 1 - e
    return (torch.cat([per_offset, shared], 1).to(device), torch.cat([per_offset.flip(1), shared], 1).to(device))


@grid_constant(max_bytes=256 << 20)
def layout_bucket_ids(layout: ImageLayout, batch: int, method: str, ratio: float,
                      device: torch.device) -> torch.Tensor:
    """Bucket ids of every pair of a layout's images, one a row: (tables, I, M, M) int64, [table, image,
    query, key], each grid pair's as on its image's grid alone (:func:`bucket_ids`: a bucket depends on
    the offset alone), every other pair (a prefix token, padding) the shared last bucket; cached."""
    entries = layout_offset_entries(layout, batch, device)  # (I, M, M)
    canvas_ids, _ = layout_canvas_ids(layout, method, ratio, device)  # (tables, E + 1)
    return canvas_ids.index_select(1, entries.flatten()).view(-1, *entries.shape)


def _largest_extent(layout: ImageLayout) -> Tuple[int, int]:
    """The most rows and the most columns of a layout's grids."""
    grids = layout.images_by_grid()
    return max(grid.height for grid in grids), max(grid.width for grid in grids)


class LookupTable(nn.Module):
    """One learned table of iRPE, in the release's parameter layout, initialised to zero.

    bias mode: ``lookup_table_bias`` (heads, buckets); ctx mode on q or k: ``lookup_table_weight``
    (heads, head_dim, buckets); ctx mode on v: ``lookup_table_weight`` (heads, buckets, head_dim).
    ``heads`` is 1 when the table is shared by the heads.
    """

    def __init__(self, shape: Tuple[int, ...], mode: str):
        super().__init__()
        self.param_name = 'lookup_table_bias' if mode == 'bias' else 'lookup_table_weight'
        self.register_parameter(self.param_name, nn.Parameter(torch.zeros(shape)))

    @property
    def table(self) -> torch.Tensor:
        return getattr(self, self.param_name)

    def forward(self) -> torch.Tensor:
        """The table; the Φp reads it by calling the module, so that its hooks run."""
        return self.table


@register_phi('irpe')
class IRPE(PositionalModule):
    """iRPE on q, k and/or v of one attention layer; at init it contributes exactly zero.

    Defaults are those of the published DeiT-iRPE-K models: contextual product method on k,
    ratio 1.9, one table shared by the heads, with ``num_prefix_tokens=1`` for the class token.

    Args:
        num_heads: attention heads.
        head_dim: channels per head (the width of the contextual tables).
        method: 'euc', 'quant', 'cross' or 'product' (bucketing of the 2D offset).
        mode: 'bias' (a learned scalar per bucket) or 'ctx' (contextual: a learned vector per
            bucket, dotted with the query, key, or summed into the output).
        on: which of q, k, v get a table: 'q', 'k', 'v', 'qk', 'kv' or 'qkv'; v needs ctx mode.
        shared_head: one table for all heads (True) or one per head.
        ratio: alpha of the piecewise index; ratio 1.9 gives 7 buckets per axis.
        num_prefix_tokens: extra tokens before the grid (the release's ``skip``); the attention
            layer's own count.
    """

    def __init__(self, num_heads: int, head_dim: int, method: str = 'product', mode: str = 'ctx',
                 on: str = 'k', shared_head: bool = True, ratio: float = 1.9, num_prefix_tokens: int = 0):
        # a table on q or k gives a logits bias (read by the tokens in ctx mode), one on v a value term
        on_logits = isinstance(on, str) and ('q' in on or 'k' in on)
        super().__init__(hooks=['logits_bias'] * on_logits + ['value_term'] * (isinstance(on, str) and 'v' in on),
                         bias_per_image=mode == 'ctx' and on_logits,
                         # on k alone, a prefix query's bias is one bucket's along its row: the softmax cancels it
                         reaches_prefix_queries=isinstance(on, str) and ('q' in on or 'v' in on))
        if method not in METHODS:
            raise ValueError(f'unknown iRPE method {method!r}; choose one of {", ".join(METHODS)}')
        if mode not in MODES:
            raise ValueError(f'unknown iRPE mode {mode!r}; choose one of {", ".join(MODES)}')
        if on not in ON:
            raise ValueError(f'unknown iRPE on={on!r}; choose one of {", ".join(ON)}')
        if mode == 'bias' and 'v' in on:
            raise ValueError(f"iRPE has no bias mode on v (on={on!r}): use mode='ctx', "
                             f"or on={on.replace('v', '') or 'k'!r}")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
            raise ValueError(f'iRPE ratio must be a number > 0, got {ratio!r}')
        num_prefix_tokens = checked_prefix_tokens(num_prefix_tokens, 'iRPE')
        self.num_heads, self.head_dim = num_heads, head_dim
        self.method, self.mode, self.on = method, mode, on
        self.shared_head, self.ratio, self.num_prefix_tokens = shared_head, float(ratio), num_prefix_tokens
        self.num_buckets = num_buckets(method, self.ratio, num_prefix_tokens)
        for target in on:
            if method == 'cross':
                tables = nn.ModuleDict({axis: LookupTable(self.table_shape(target), mode) for axis in _CROSS_AXES})
            else:
                tables = LookupTable(self.table_shape(target), mode)
            self.add_module(f'rpe_{target}', tables)

    def table_shape(self, target: str) -> Tuple[int, ...]:
        """The release's shape of a table on ``target`` ('q', 'k' or 'v')."""
        heads = 1 if self.shared_head else self.num_heads
        if self.mode == 'bias':
            return (heads, self.num_buckets)
        if target == 'v':
            return (heads, self.num_buckets, self.head_dim)
        return (heads, self.head_dim, self.num_buckets)

    def _tables(self, target: str) -> List[torch.Tensor]:
        if target not in self.on:
            raise ValueError(f'this iRPE has tables on {self.on!r}, not on {target!r}')
        tables = getattr(self, f'rpe_{target}')
        if isinstance(tables, nn.ModuleDict):
            return [tables[axis]() for axis in _CROSS_AXES]
        return [tables()]

    def _grid(self, hw: GridLike) -> TokenGrid:
        if isinstance(hw, TokenGrid):
            return checked_grid_prefix(hw, self.num_prefix_tokens, 'iRPE')
        return TokenGrid.of(hw, self.num_prefix_tokens)

    def term(self, on: str, x: torch.Tensor, hw: GridLike) -> torch.Tensor:
        """The iRPE term on one of q, k, v (module docstring).

        Args:
            on: 'k' with x = scaled queries (B, heads, L, d) -> logits bias (B or 1, heads, L, L);
                'q' with x = scaled keys -> logits bias, indexed [b, h, query, key];
                'v' with x = attention probabilities (B, heads, L, L) -> (B, heads, L, d),
                added to the attention output.
            x: see ``on``.
            hw: (H, W) of the grid (``num_prefix_tokens`` extra tokens come first), or a TokenGrid.
        """
        tables = self._tables(on)
        if x.dim() != 4 or x.shape[1] != self.num_heads:
            raise ValueError(f'iRPE term on {on!r} expects (B, {self.num_heads} heads, L, ...), '
                             f'got shape {tuple(x.shape)}')
        if on != 'v' and self.mode == 'ctx' and x.shape[-1] != self.head_dim:
            raise ValueError(f'iRPE term on {on!r} expects head_dim {self.head_dim}, got shape {tuple(x.shape)}')
        if isinstance(hw, TokenPositions):
            checked_grid_prefix(hw, self.num_prefix_tokens, 'iRPE')
            ids = layout_bucket_ids(hw.layout, hw.batch, self.method, self.ratio, x.device)  # (tables, I, M, M)
        else:
            grid = self._grid(hw)
            grid.check_num_tokens(x.shape[-2])
            if on == 'v':
                grid.check_num_tokens(x.shape[-1])
            ids = bucket_ids(grid.height, grid.width, self.num_prefix_tokens, self.method, self.ratio, x.device)
        terms = [self._table_term(on, x, table.to(x.dtype), table_ids) for table, table_ids in zip(tables, ids)]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    def _table_term(self, on: str, x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One table's term; ids (L, L) indexed [query, key], or (I, L, L) one image a row."""
        ids = ids if ids.dim() == 3 else ids[None]  # (I or 1, L, L)
        if self.mode == 'bias':  # T_q is read at the mirrored offset id(j, i)
            pair_ids = ids.transpose(-2, -1) if on == 'q' else ids
            bias = table.index_select(1, pair_ids.flatten())  # (heads or 1, I L L): one contiguous gather a head
            return bias.view(-1, *pair_ids.shape).transpose(0, 1)  # (I or 1, heads or 1, L, L)
        batch, heads, tokens, _ = x.shape
        pair_ids = ids[:, None].expand(batch, heads, tokens, tokens)
        if on == 'v':
            per_bucket = x.new_zeros(batch, heads, tokens, self.num_buckets)
            per_bucket = per_bucket.scatter_add(-1, pair_ids, x)
            return per_bucket @ table  # (B, heads, L, buckets) @ (heads or 1, buckets, d)
        lookup = x @ table  # (B, heads, L, d) @ (heads or 1, d, buckets) -> (B, heads, L, buckets)
        # [b, h, r, c] = x_r . T[id(r, c)]: query-major on k; on q, r is the key j and c the query i
        gathered = lookup.gather(-1, pair_ids)
        return gathered.transpose(-2, -1) if on == 'q' else gathered

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """The terms on k and q (module docstring): (1, heads or 1, N, N) in bias mode, a function of the
        grid and the tables alone (served by :func:`posattn.cache_positions`), (B, heads, N, N) in ctx mode."""
        if self.mode == 'bias':
            return self.cached(('logits_bias', grid, q.dtype, q.device), lambda: self._logits_bias(q, k, grid))
        return self._logits_bias(q, k, grid)

    def _logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        scale = q.shape[-1] ** -0.5
        bias = None
        if 'k' in self.on:
            bias = self.term('k', q * scale, grid)
        if 'q' in self.on:
            bias_q = self.term('q', k * scale, grid)
            bias = bias_q if bias is None else bias + bias_q
        return bias

    def value_term(self, attn: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        return self.term('v', attn, grid) if 'v' in self.on else None

    def logits_bias_at(self, q: torch.Tensor, k: torch.Tensor, positions: TokenPositions,
                       **given: Any) -> Optional[torch.Tensor]:
        """The terms on k and q on rows of images, by each pair's bucket on its image's grid:
        (I, heads or 1, M, M) in bias mode, (I, heads, M, M) in ctx mode, in q's dtype."""
        if self.mode == 'bias':
            return self._bias_at(q, positions)
        return self._logits_bias(q, k, positions)

    def _bias_at(self, q: torch.Tensor, positions: TokenPositions) -> torch.Tensor:
        """Bias mode on rows of images. A bucket depends on the offset alone, so the sum of every table's
        term is a function of the offset: summed on the offset canvas of the layout's largest grid,
        (heads or 1, E + 1), in the order of :meth:`logits_bias`, then read by each pair in one gather."""
        checked_grid_prefix(positions, self.num_prefix_tokens, 'iRPE')
        layout = positions.layout
        entries = layout_offset_entries(layout, positions.batch, q.device)  # (I, M, M)
        query_minus_key, key_minus_query = layout_canvas_ids(layout, self.method, self.ratio, q.device)
        canvas_ids = {'k': query_minus_key, 'q': key_minus_query}  # (tables, E + 1) each
        canvas = None
        for target in (target for target in 'kq' if target in self.on):
            terms = [table.to(q.dtype).index_select(1, ids)  # (heads or 1, E + 1)
                     for table, ids in zip(self._tables(target), canvas_ids[target])]
            term = terms[0] if len(terms) == 1 else terms[0] + terms[1]
            canvas = term if canvas is None else canvas + term
        bias = canvas.index_select(1, entries.flatten())  # (heads or 1, I M M): one contiguous gather a head
        return bias.view(-1, *entries.shape).transpose(0, 1)  # (I, heads or 1, M, M)

    def value_term_at(self, attn: torch.Tensor, positions: TokenPositions, **given: Any) -> Optional[torch.Tensor]:
        return self.term('v', attn, positions) if 'v' in self.on else None

    @torch.no_grad()
    def load_release_tables(self, tables: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Copy the tables of the release's iRPE modules (``rpe_q``, ``rpe_k``, ``rpe_v``).

        Args:
            tables: {'q' | 'k' | 'v': {name: tensor}}, one entry per target in ``on``, each the
                state_dict of the release module: ``lookup_table_weight`` (ctx) or
                ``lookup_table_bias`` (bias); for cross, the same under ``rp_rows.`` and ``rp_cols.``.
        """
        if set(tables) != set(self.on):
            raise ValueError(f'iRPE on {self.on!r} needs tables for {sorted(self.on)}, got {sorted(tables)}')
        for target, named in tables.items():
            module = getattr(self, f'rpe_{target}')
            expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
            if set(named) != set(expected):
                raise ValueError(f'iRPE tables on {target!r}: expected the names {sorted(expected)}, '
                                 f'got {sorted(named)}')
            for name, tensor in named.items():
                if tuple(tensor.shape) != expected[name]:
                    raise ValueError(
                        f'iRPE table {target}.{name} has shape {tuple(tensor.shape)}; expected '
                        f'{expected[name]} for method={self.method!r}, mode={self.mode!r}, ratio={self.ratio}, '
                        f'num_prefix_tokens={self.num_prefix_tokens}, shared_head={self.shared_head} '
                        f'({self.num_buckets} buckets)')
            for name, param in module.named_parameters():
                param.copy_(named[name])

    def settings(self) -> Dict[str, Any]:
        return {'num_heads': self.num_heads, 'head_dim': self.head_dim, 'method': self.method, 'mode': self.mode,
                'on': self.on, 'shared_head': self.shared_head,
                'ratio': self.ratio, 'num_prefix_tokens': self.num_prefix_tokens}
