"""``gpsa``: gated positional self-attention, ConViT's (d'Ascoli et al., ICML 2021, Eq. 9-10), as
timm's ``convit.GPSA`` computes it. Head h attends with a mixture of the layer's content attention
and a positional attention that depends on the offset between query and key alone:

    A_h = (1 - σ(λ_h)) softmax(q k^T / sqrt(d)) + σ(λ_h) softmax(v_h · r_ij + c_h),

whose rows sum to 1 as both terms' do (timm divides by the row sum, which changes only the
rounding; posattn renormalises only where a key mask leaves a grid query no grid key). r_ij = (dx, dy, dx² + dy²)
is the offset of key j from query i, key minus query in grid units, dx along the columns and dy
along the rows (timm's ``rel_indices`` channels, in that order); v_h and c_h are the weight row
and bias of head h of ``pos_proj``, a Linear(3, heads); λ_h is ``gating_param[h]``, 1 at init
(σ(1) = 0.73 of positional attention). This Φp mixes the layer's probabilities (the content
softmax, with whatever logits bias the layer adds: a swapped model's own) and adds no logits bias.

Prefix tokens: ConViT's GPSA layers see the patch grid alone. With prefix (class) tokens, the
positional attention runs over the grid: a grid query mixes its content attention (over all keys)
with a positional attention over the grid keys (a prefix key gets none of it); a prefix query,
which has no grid position, keeps its content attention. Key mask: masked keys get no weight in
either term (the positional softmax leaves them out); a query with no grid key left keeps its
content attention, one with no key at all gets a zero row.

On a layout of images of different grids (:class:`~posattn.positions.TokenPositions`), the logits
v_h · r + c_h are computed for the K offsets of the layout's largest height and width, and each
pair of a row of images reads its offset's entry by a cached per-pair index in one gather,
(I, heads, M, M); the softmax then runs over the grid keys of the query's own image that the key
mask keeps, and a query whose image has no such key gets gate 0, so no row needs renormalising.

Where nothing else reads the probabilities, the layer mixes on its outputs (:meth:`mix_outputs`):
(1 - σ(λ_h)) A_c v + σ(λ_h) P v, the content part from the fused kernel. P is separable over a whole
grid, exp(v_h · r + c_h) being a product of a function of dx and one of dy:

    P[(y, x), (y', x')] = P^y[y, y'] P^x[x, x'],   P^x[x, x'] = softmax_x'(v_h0 (x' - x) + v_h2 (x' - x)²)

and P^y likewise with v_h1 (c_h cancels in the softmax), so P v is two 1D attentions, along the
columns then the rows: O(HW (H + W)) instead of O((HW)²), and no (heads, HW, HW) term. On a layout,
each image lies on a canvas of the layout's longest short side by its longest long side (an image
taller than wide transposed), the keys beyond its sides out of both softmaxes. A key mask that cuts
a grid takes the dense positional attention instead.

Local init (``local_init``, timm's ``GPSA.local_init``): with k = floor(sqrt(heads)) and c = (k - 1) / 2,
head h1 + k h2 (h1, h2 in 0 .. k - 1) gets v_h = α (2 (h2 - c), 2 (h1 - c), -1), α =
``locality_strength``, so that its positional logit is -α ||(dx, dy) - Δ_h||² + const: a Gaussian
around the offset Δ_h = (h2 - c, h1 - c), the k² heads tiling a k x k neighbourhood like the taps of
a convolution, sharper with α. The other weights are drawn from a normal of std 0.02 truncated at
±2, the biases are zero (timm's ConViT initialisation). timm's local init also sets the layer's
value projection to the identity: that is the layer's weight, not this module's, and a posattn
layer keeps its own initialisation of it. The formula, pair by pair:
:func:`posattn.reference.gpsa_position_attention` and :func:`posattn.reference.gpsa_attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .._cache import grid_constant
from ..grid import TokenGrid
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from .base import PositionalModule
from .options import checked_count, checked_grid_prefix, checked_prefix_tokens
from .registry import register_phi

__all__ = ['GatedPositionalAttention', 'relative_offsets', 'local_offsets']


@grid_constant(max_bytes=256 << 20)
def relative_offsets(height: int, width: int, dtype: torch.dtype = torch.float32,
                     device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """r_ij = (dx, dy, dx² + dy²), key j minus query i, of an H x W grid: (3, HW, HW) in ``dtype``,
    [channel, query, key], the channels in the order of timm's ``rel_indices``; cached. A pure
    function of its arguments."""
    rows, cols = TokenGrid(height, width).positions(device)
    dx = cols[None] - cols[:, None]  # (HW, HW), exact in int64
    dy = rows[None] - rows[:, None]
    return torch.stack([dx, dy, dx * dx + dy * dy]).to(dtype)


def local_offsets(num_heads: int) -> Tuple[Tuple[float, float], ...]:
    """Δ_h = (dx, dy) that the local init centres each of the first k² heads on (module docstring),
    k = floor(sqrt(heads)); the other heads have none."""
    kernel_size = math.isqrt(num_heads)
    center = (kernel_size - 1) / 2
    offsets = [None] * kernel_size ** 2
    for h1 in range(kernel_size):
        for h2 in range(kernel_size):
            offsets[h1 + kernel_size * h2] = (h2 - center, h1 - center)
    return tuple(offsets)


@register_phi('gpsa')
class GatedPositionalAttention(PositionalModule):
    """ConViT's gated positional self-attention (module docstring): the layer's content attention
    mixed, per head, with a learned positional attention by a learned gate.

    Args:
        num_heads: attention heads: one positional attention and one gate each.
        locality_strength: α of the local init, how sharply each head's positional attention
            peaks around its offset (ConViT's default 1); used by ``local_init`` only.
        local_init: ConViT's local init of ``pos_proj`` (module docstring); False leaves every
            weight drawn (std 0.02) and the positional attention nearly uniform.
        num_prefix_tokens: extra tokens before the grid; the attention layer's own count.
    """

    def __init__(self, num_heads: int, locality_strength: float = 1.0, local_init: bool = True,
                 num_prefix_tokens: int = 0):
        super().__init__(hooks=('mix_probabilities',), reaches_prefix_queries=False)  # a prefix query attends by content
        num_heads = checked_count(num_heads, 'gpsa', 'num_heads')
        if isinstance(locality_strength, bool) or not isinstance(locality_strength, (int, float)) or not (
                math.isfinite(locality_strength) and locality_strength > 0):
            raise ValueError(f'gpsa locality_strength must be a finite number > 0, got {locality_strength!r}')
        if not isinstance(local_init, bool):
            raise ValueError(f'gpsa local_init must be True or False, got {local_init!r}')
        num_prefix_tokens = checked_prefix_tokens(num_prefix_tokens, 'gpsa')
        self.num_heads = int(num_heads)
        self.locality_strength = float(locality_strength)
        self.local_init = local_init
        self.num_prefix_tokens = num_prefix_tokens
        self.pos_proj = nn.Linear(3, self.num_heads)  # timm's names
        self.gating_param = nn.Parameter(torch.ones(self.num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm's ConViT initialisation: ``pos_proj`` drawn (std 0.02) with zero bias, then the local
        init if asked for; every gate 1."""
        with torch.no_grad():
            nn.init.trunc_normal_(self.pos_proj.weight, std=0.02)
            nn.init.zeros_(self.pos_proj.bias)
            nn.init.ones_(self.gating_param)
            if self.local_init:
                for head, (dx, dy) in enumerate(local_offsets(self.num_heads)):
                    self.pos_proj.weight[head] = torch.tensor([2 * dx, 2 * dy, -1.0])
                self.pos_proj.weight.mul_(self.locality_strength)  # all heads, as timm's local_init

    @property
    def gate(self) -> torch.Tensor:
        """σ(λ_h), the share of positional attention of every head, (heads,)."""
        return torch.sigmoid(self.gating_param)

    def _grid(self, grid: TokenGrid) -> TokenGrid:
        return checked_grid_prefix(grid, self.num_prefix_tokens, 'gpsa')

    def position_logits(self, height: int, width: int) -> torch.Tensor:
        """v_h · r_ij + c_h over the grid pairs: (heads, HW, HW) in ``pos_proj``'s dtype, [head, query, key]."""
        weight = self.pos_proj.weight
        return self._offset_logits(*relative_offsets(height, width, weight.dtype, weight.device))

    def _offset_logits(self, dx: torch.Tensor, dy: torch.Tensor, squared: torch.Tensor) -> torch.Tensor:
        """v_h · r + c_h of offsets r = (dx, dy, dx² + dy²), each of shape S in ``pos_proj``'s dtype:
        (heads, *S). Written out channel by channel, so that autocast leaves it in that dtype (its value
        may be cached, and does not depend on whether the call runs under autocast)."""
        weight, bias = self.pos_proj.weight, self.pos_proj.bias
        per_channel = weight.view(*weight.shape, *(1,) * dx.dim())  # (heads, 3, 1, ...)
        logits = per_channel[:, 0] * dx + per_channel[:, 1] * dy + per_channel[:, 2] * squared
        return logits if bias is None else logits + bias.view(-1, *(1,) * dx.dim())

    def position_attention(self, height: int, width: int) -> torch.Tensor:
        """The positional attention softmax_j(v_h · r_ij + c_h) over the grid pairs: (heads, HW, HW),
        rows summing to 1, [head, query, key]; served by :func:`posattn.cache_positions` inside its block."""
        weight = self.pos_proj.weight
        return self.cached(('position_attention', height, width, weight.dtype, weight.device),
                           lambda: self.position_logits(height, width).softmax(-1))

    def mixture_parts(self, grid: TokenGrid) -> Tuple[torch.Tensor, torch.Tensor]:
        """The positional attention over the grid pairs (heads, HW, HW) and the gates σ(λ_h) (heads,)."""
        return self.position_attention(grid.height, grid.width), self.gate

    def _masked_position_attention(self, grid: TokenGrid, key_mask: torch.Tensor) -> torch.Tensor:
        """The positional attention over the grid keys ``key_mask`` (B, N) keeps: (B, heads, HW, HW);
        zero for a sequence with no grid key left."""
        grid_keys = key_mask[:, grid.num_prefix_tokens:].to(self.pos_proj.weight.device)  # (B, HW)
        has_grid_key = grid_keys.any(-1, keepdim=True)  # (B, 1)
        kept = grid_keys | ~has_grid_key  # such a sequence keeps all, so its softmax stays finite
        logits = self.position_logits(grid.height, grid.width)[None]  # (1, heads, HW, HW)
        logits = logits.masked_fill(~kept[:, None, None, :], float('-inf'))
        return logits.softmax(-1).masked_fill(~has_grid_key[:, :, None, None], 0.0)

    def _query_gates(self, grid: TokenGrid) -> torch.Tensor:
        """σ(λ_h) for every grid query, 0 for a prefix query: (1, heads, N, 1)."""
        gates = self.gate[None, :, None, None].expand(1, -1, grid.num_grid_tokens, 1)
        return F.pad(gates, (0, 0, grid.num_prefix_tokens, 0)) if grid.num_prefix_tokens else gates

    def mix_probabilities(self, attn: torch.Tensor, grid: TokenGrid,
                          key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A of the module docstring from the content probabilities ``attn`` (B, heads, N, N): (B, heads,
        N, N) in ``attn``'s dtype, rows summing to 1 (0 for a query with no key left)."""
        grid = self._grid(grid)
        if key_mask is None:
            position = self.position_attention(grid.height, grid.width)[None]  # (1, heads, HW, HW)
        else:
            position = self._masked_position_attention(grid, key_mask)  # (B, heads, HW, HW)
        gates = self._query_gates(grid).to(attn.dtype)
        mixed = torch.lerp(attn, grid.pad_prefix(position.to(attn.dtype)), gates)  # (1 - g) A_c + g A_p, one pass
        if key_mask is None:  # both terms' rows sum to 1 already: timm's renormalisation changes rounding only
            return mixed
        total = mixed.sum(-1, keepdim=True)  # < 1 where masking left a grid query no grid key
        return mixed / total.masked_fill(total == 0, 1.0)

    def mix_outputs(self, out: torch.Tensor, v: torch.Tensor, grid: TokenGrid,
                    key_mask: Optional[torch.Tensor] = None, **given: Any) -> torch.Tensor:
        """:meth:`mix_probabilities` on the outputs: (1 - σ(λ_h)) ``out`` + σ(λ_h) P v for every grid
        query (a prefix query, and the grid queries of a sequence with no grid key left, keep ``out``),
        ``out`` = A_c v and ``v`` (B, heads, N, d); P v as two 1D attentions (module docstring) unless
        ``key_mask`` (B, N) is given. (B, heads, N, d) in ``out``'s dtype."""
        grid = self._grid(grid)
        values = v[:, :, grid.num_prefix_tokens:]  # (B, heads, HW, d)
        gates = self._query_gates(grid)  # (1, heads, N, 1)
        if key_mask is None:
            along_rows, along_cols = (factor.to(v.dtype) for factor in self.axis_attentions(grid.height, grid.width))
            canvas = rearrange(values, 'b h (y x) d -> b h y x d', y=grid.height)
            canvas = along_cols[:, None] @ canvas  # P^x along each row: (B, heads, H, W, d)
            canvas = along_rows @ canvas.flatten(-2)  # then P^y along each column: (B, heads, H, W d)
            position_out = canvas.view_as(values)
        else:
            position = self._masked_position_attention(grid, key_mask)  # (B, heads, HW, HW), 0 with no grid key
            position_out = position.to(v.dtype) @ values
            has_grid_key = key_mask[:, grid.num_prefix_tokens:].any(-1).to(gates.device)  # (B,)
            gates = gates * has_grid_key[:, None, None, None]
        position_out = F.pad(position_out, (0, 0, grid.num_prefix_tokens, 0))  # a prefix query: gate 0
        return torch.lerp(out, position_out, gates.to(out.dtype))  # (1 - g) A_c v + g P v

    def axis_attentions(self, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The 1D factors of the positional attention over an H x W grid (module docstring): P^y
        (heads, H, H) and P^x (heads, W, W), [head, query, key], rows summing to 1, in ``pos_proj``'s
        dtype. c_h, constant along the keys, is kept in P^y's logits: its gradient is that of the 2D
        softmax, zero."""
        weight, bias = self.pos_proj.weight, self.pos_proj.bias
        rows = _axis_logits(weight[:, 1], weight[:, 2], _axis_offsets(height, weight.dtype, weight.device))
        cols = _axis_logits(weight[:, 0], weight[:, 2], _axis_offsets(width, weight.dtype, weight.device))
        if bias is not None:
            rows = rows + bias[:, None, None]
        return rows.softmax(-1), cols.softmax(-1)

    def mix_probabilities_at(self, attn: torch.Tensor, positions: TokenPositions, key_mask: torch.Tensor,
                             **given: Any) -> torch.Tensor:
        """A of the module docstring on rows of images, ``attn`` (I, heads, M, M): each grid query's
        positional attention over the grid keys of its own image that ``key_mask`` (I, M) keeps, by
        the offsets r_ij there; a prefix query, and a grid query of an image with no grid key left,
        keeps its content attention (its gate is 0). Rows sum to 1 as both terms' do (0 for a query
        with no key left); (I, heads, M, M) in ``attn``'s dtype."""
        position, gates = self._layout_position_attention(positions, key_mask)
        return torch.lerp(attn, position.to(attn.dtype), gates.to(attn.dtype))  # (1 - g) A_c + g A_p, one pass

    def mix_outputs_at(self, out: torch.Tensor, v: torch.Tensor, positions: TokenPositions, key_mask: torch.Tensor,
                       **given: Any) -> torch.Tensor:
        """:meth:`mix_probabilities_at` on the outputs, ``out`` = A_c v and ``v`` (I, heads, M, d): P v
        as two 1D attentions on a canvas (module docstring) where ``key_mask`` is the layout's padding
        mask, else by the dense positional attention. (I, heads, M, d) in ``out``'s dtype."""
        if positions.keeps_a_key(key_mask):  # every image's grid whole
            checked_grid_prefix(positions, self.num_prefix_tokens, 'gpsa')
            position_out = self._canvas_outputs(v, positions)
            gates = self.gate[None, :, None, None] * positions.is_grid[:, None, :, None]  # (I, heads, M, 1)
        else:
            position, gates = self._layout_position_attention(positions, key_mask)
            position_out = position.to(v.dtype) @ v
        return torch.lerp(out, position_out, gates.to(out.dtype))

    def _canvas_outputs(self, v: torch.Tensor, positions: TokenPositions) -> torch.Tensor:
        """P v of every token of rows of whole images, ``v`` (I, heads, M, d): the values on each image's
        canvas, (I, heads, L, S, d) with S and L the layout's longest short and long sides, P's long-side
        factor along each canvas row, then its short-side factor along each column; (I, heads, M, d),
        any finite value at a prefix or padding token. A cell off the image holds some token's value,
        which both factors weigh by exactly 0."""
        weight, bias = self.pos_proj.weight, self.pos_proj.bias
        canvas = _layout_canvas(positions.layout, positions.batch, v.device)
        short = _axis_offsets(canvas.short, weight.dtype, weight.device)  # (S, S)
        long = _axis_offsets(canvas.long, weight.dtype, weight.device)  # (L, L)
        transposed = canvas.transposed  # (I, 1): an image taller than wide lies transposed
        along_short = _axis_logits(torch.where(transposed, weight[:, 0], weight[:, 1]), weight[:, 2], short)
        along_long = _axis_logits(torch.where(transposed, weight[:, 1], weight[:, 0]), weight[:, 2], long)
        if bias is not None:
            along_short = along_short + bias[:, None, None]
        along_short = along_short.masked_fill(~canvas.short_keys[:, None, None, :], float('-inf')).softmax(-1)
        along_long = along_long.masked_fill(~canvas.long_keys[:, None, None, :], float('-inf')).softmax(-1)
        images, heads, _, channels = v.shape
        cells = v.gather(2, canvas.cell_token[:, None, :, None].expand(-1, heads, -1, channels))  # (I, heads, L S, d)
        cells = along_long.to(v.dtype) @ cells.view(images, heads, canvas.long, -1)  # along each canvas row
        cells = along_short.to(v.dtype)[:, :, None] @ cells.view(images, heads, canvas.long, canvas.short, channels)
        cells = cells.view(images, heads, -1, channels)  # then along each column: (I, heads, L S, d)
        return cells.gather(2, canvas.token_cell[:, None, :, None].expand(-1, heads, -1, channels))

    def _layout_position_attention(self, positions: TokenPositions,
                                   key_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each grid query's positional attention over the grid keys of its own image that ``key_mask``
        (I, M) keeps, (I, heads, M, M), and each query's gate (I, heads, M, 1): σ(λ_h) for a grid query of
        an image with a grid key left, 0 otherwise."""
        checked_grid_prefix(positions, self.num_prefix_tokens, 'gpsa')
        grid_keys = key_mask & positions.is_grid  # (I, M)
        has_grid_key = grid_keys.any(-1, keepdim=True)  # (I, 1)
        kept = grid_keys | ~has_grid_key  # an image with no grid key keeps all, so its softmax stays finite
        logits = self._layout_position_logits(positions)  # (I, heads, M, M)
        position = logits.masked_fill_(~kept[:, None, None, :], float('-inf')).softmax(-1)
        mixing = positions.is_grid & has_grid_key  # (I, M): the queries that mix in a positional attention
        return position, self.gate[None, :, None, None] * mixing[:, None, :, None]

    def _layout_position_logits(self, positions: TokenPositions) -> torch.Tensor:
        """v_h · r_ij + c_h of every pair of a row of images: (I, heads, M, M) in ``pos_proj``'s dtype, a
        view of one gather from the logits of the K offsets of the layout's largest height and width,
        (heads, K); a pair with a prefix token or padding reads some finite entry."""
        weight, grids = self.pos_proj.weight, positions.distinct_grids
        height, width = max(grid.height for grid in grids), max(grid.width for grid in grids)
        table = self._offset_logits(*_offset_table(height, width, weight.dtype, weight.device))  # (heads, K)
        pair_entry = _pair_entries(positions.layout, positions.batch, height, width, weight.device)  # (I, M, M)
        logits = table.index_select(1, pair_entry.flatten())  # (heads, I M M): one contiguous gather a head
        return logits.view(-1, *pair_entry.shape).transpose(0, 1)

    def settings(self) -> Dict[str, Any]:
        # locality_strength and local_init only initialise pos_proj
        return {'num_heads': self.num_heads, 'num_prefix_tokens': self.num_prefix_tokens}


def _axis_logits(slope: torch.Tensor, curvature: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """slope · δ + curvature · δ² of the offsets δ (L, L), key minus query along one axis, with
    ``slope`` (heads,) or (I, heads) and ``curvature`` (heads,): (heads, L, L) or (I, heads, L, L)."""
    return slope[..., None, None] * offsets + curvature[:, None, None] * offsets.square()


def _axis_offsets(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """δ = key minus query along an axis of ``length`` cells: (L, L) in ``dtype``, [query, key]."""
    cells = torch.arange(length, device=device)
    return (cells[None] - cells[:, None]).to(dtype)


@dataclass(frozen=True)
class _Canvas:
    """Where the tokens of a layout's images (one a row) lie on a canvas of S x L cells, S and L the
    longest short and long sides of its grids: cell (a, b) of an image is its grid cell (row a, column
    b), or (row b, column a) for an image taller than wide."""
    transposed: torch.Tensor  # (I, 1) bool: the image lies transposed
    short_keys: torch.Tensor  # (I, S) bool: a canvas row of the image
    long_keys: torch.Tensor  # (I, L) bool: a canvas column of the image
    cell_token: torch.Tensor  # (I, L S) int64: the token at cell (a, b), at b S + a; any token where none lies
    token_cell: torch.Tensor  # (I, M) int64: b S + a of each grid token's cell, 0 for a prefix or padding token

    @property
    def short(self) -> int:
        return self.short_keys.shape[1]

    @property
    def long(self) -> int:
        return self.long_keys.shape[1]


def _layout_canvas(layout: ImageLayout, batch: int, device: torch.device) -> _Canvas:
    """The :class:`_Canvas` of ``layout``'s images in a (``batch``, L, C) tensor, on ``device``; cached."""
    return _Canvas(*_canvas_tensors(layout, batch, device))


@grid_constant(max_bytes=64 << 20)
def _canvas_tensors(layout: ImageLayout, batch: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """The tensors of :class:`_Canvas`, in its order; a pure function of its arguments."""
    positions = token_positions(layout, batch, torch.device('cpu'))
    heights = torch.tensor([grid.height for grid in layout.grids])[:, None]  # (I, 1)
    widths = torch.tensor([grid.width for grid in layout.grids])[:, None]
    transposed = heights > widths
    short_sides, long_sides = torch.minimum(heights, widths), torch.maximum(heights, widths)
    short, long = int(short_sides.max()), int(long_sides.max())
    b, a = (index.flatten()[None] for index in torch.meshgrid(torch.arange(long), torch.arange(short), indexing='ij'))
    row, col = torch.where(transposed, b, a), torch.where(transposed, a, b)  # (I, L S): the grid cell of each
    inside = (row < heights) & (col < widths)
    cell_token = torch.where(inside, layout.num_prefix_tokens + row * widths + col, 0)
    canvas_row = torch.where(transposed, positions.col, positions.row)  # (I, M)
    canvas_col = torch.where(transposed, positions.row, positions.col)
    token_cell = torch.where(positions.is_grid, canvas_col * short + canvas_row, 0)
    return tuple(t.to(device) for t in (transposed, torch.arange(short)[None] < short_sides,
                                        torch.arange(long)[None] < long_sides, cell_token, token_cell))


@grid_constant(max_bytes=64 << 20)
def _offset_table(height: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """r = (dx, dy, dx² + dy²) of every offset of an H x W grid, dx in -(W - 1) .. W - 1 and dy in
    -(H - 1) .. H - 1: (3, K) in ``dtype``, K = (2H - 1)(2W - 1), entry (dy + H - 1)(2W - 1) + dx + W - 1;
    cached. A pure function of its arguments."""
    dy, dx = torch.meshgrid(torch.arange(1 - height, height), torch.arange(1 - width, width), indexing='ij')
    dx, dy = dx.flatten(), dy.flatten()  # (K,), exact in int64
    return torch.stack([dx, dy, dx * dx + dy * dy]).to(device, dtype)


@grid_constant(max_bytes=256 << 20)
def _pair_entries(layout: ImageLayout, batch: int, height: int, width: int, device: torch.device) -> torch.Tensor:
    """The entry of :func:`_offset_table` (``height`` x ``width``, at least each image's grid) that every
    pair of a row of a layout's images reads, its offset key minus query: (I, M, M) int64; cached. Only
    pairs of one image's grid tokens mean anything (a prefix or padding token counts as row 0, column 0)."""
    query_minus_key = token_positions(layout, batch, torch.device('cpu')).offsets()
    dy, dx = (-offset for offset in query_minus_key)
    return ((dy + height - 1) * (2 * width - 1) + dx + width - 1).to(device)
