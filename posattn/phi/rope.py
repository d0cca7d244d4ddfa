"""``rope``: rotary position embedding on the image grid: RoPE (Su et al. 2021, RoFormer) in the 2D
forms of EVA-02 (Fang et al. 2024) and RoPE-ViT (Heo et al., ECCV 2024, "Rotary Position Embedding
for Vision Transformer").

The query and the key of every grid token are rotated, one pair of channels (u, v) of a head at a
time, by an angle φ that depends on the token's position:

    u' = u cos φ - v sin φ,    v' = v cos φ + u sin φ.

The angle is linear in the position, so R(φ_i)^T R(φ_j) = R(φ_j - φ_i) and the logit q_i . k_j
depends on the positions p_i, p_j through their offset p_i - p_j alone. Prefix (class, register)
tokens are not rotated. A head of d channels (d a multiple of 4) holds d / 2 pairs: channels (2p,
2p + 1) (``pairing='interleaved'``: RoFormer's, EVA-02's, RoPE-ViT's) or (p, p + d / 2)
(``'halves'``: timm's ``rotate_half``).

The position (row y, column x) of a token of an H x W grid is read as the coordinates

    y' = (y + o) s_y,    x' = (x + o) s_x,

with the offset o = ``position_offset`` and the scales s = 1, or, with a ``reference_grid`` (h, w),
s_y = h / H and s_x = w / W: every grid spans the grid it was trained on (EVA-02). ``axis_order``
names the first axis (a) and the second (b): 'yx' (rows first, EVA-02) or 'xy' (columns first,
RoPE-ViT). Pair p turns by

* ``frequencies='axial'`` (EVA-02, RoPE-ViT's RoPE-Axial): φ_p = a ω_p for p < F and b ω_(p - F)
  for the other F pairs, with F = d / 4 frequencies ω_f = θ^(-f / F) and θ = ``temperature``: the
  first half of the pairs encodes the first axis, the second half the other, one frequency band
  each. The same angles in every head.
* ``frequencies='mixed'`` (RoPE-ViT's RoPE-Mixed): φ_(h, p) = a f1[h, p] + b f2[h, p], learned
  frequency vectors per head and pair (``freqs``, (2, heads, d / 2)), so that a pair may encode
  any direction of the plane. RoPE-ViT's initialisation: f1[h] = (m cos α_h, m cos(α_h + π/2)),
  f2[h] = (m sin α_h, m sin(α_h + π/2)) with magnitudes m_f = θ^(-f / F) and one angle α_h per
  head drawn uniformly in [0, 2π).

The parameters, the channel layout and the angles (computed with timm's operations in timm's order)
are timm's (``RotaryEmbeddingCat`` with ``apply_rot_embed_cat``, ``RotaryEmbeddingMixed``), so that
``swap_attention(model, phi='own')`` computes what a timm ``Eva`` computes. The rotation, pair by
pair: :func:`posattn.reference.rope_rotate`.

On a layout of images of different grids, one a row (:class:`~posattn.positions.TokenPositions`), each
token reads its coordinates (a, b), or its axial cos and sin, from the table of its image's grid, the
very values a run of that image alone computes, gathered once per layout into (I, M, ...) tensors;
prefix tokens and padding read the angle 0 (cos 1, sin 0), which leaves them as they are.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from .._cache import grid_constant
from ..grid import TokenGrid, is_integer
from ..layout import ImageLayout
from ..positions import TokenPositions, token_positions
from .base import PositionalModule
from .options import checked_count, checked_pair
from .registry import register_phi

__all__ = ['RotaryPositionEmbedding', 'axial_frequencies', 'mixed_frequencies_init', 'grid_coordinates',
           'axial_rotation', 'rotate_pairs']

FREQUENCIES = ('axial', 'mixed')
AXIS_ORDERS = ('yx', 'xy')
PAIRINGS = ('interleaved', 'halves')
DEFAULT_TEMPERATURE = {'axial': 10000.0, 'mixed': 10.0}  # RoFormer's and EVA-02's; RoPE-ViT's for RoPE-Mixed


def axial_frequencies(head_dim: int, temperature: float, dtype: torch.dtype = torch.float32,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    """ω_f = θ^(-f / F), f = 0 .. F - 1, F = head_dim / 4: (F,) in ``dtype``, as timm's ``freq_bands``."""
    count = head_dim // 4
    exponents = torch.arange(count, device=device).to(dtype) / count
    return 1.0 / (temperature ** exponents)


def mixed_frequencies_init(head_dim: int, num_heads: int, temperature: float) -> torch.Tensor:
    """RoPE-ViT's initial RoPE-Mixed frequencies (2, heads, head_dim / 2): per head, magnitudes
    θ^(-f / F) along a random direction α_h and the direction at right angles to it."""
    magnitudes = axial_frequencies(head_dim, temperature)  # (F,)
    angles = torch.rand(num_heads, 1) * 2 * torch.pi  # (heads, 1)
    first = torch.cat([magnitudes * torch.cos(angles), magnitudes * torch.cos(angles + torch.pi / 2)], dim=-1)
    second = torch.cat([magnitudes * torch.sin(angles), magnitudes * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([first, second])


@grid_constant(max_bytes=64 << 20)
def grid_coordinates(height: int, width: int, position_offset: float, reference_grid: Optional[Tuple[int, int]],
                     axis_order: str, dtype: torch.dtype = torch.float32,
                     device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """The coordinates (a, b) of every token of an H x W grid (module docstring): (H W, 2) in
    ``dtype``, row-major; cached. A pure function of its arguments, which are the cache key."""
    rows = torch.arange(height, device=device).to(dtype) + position_offset
    cols = torch.arange(width, device=device).to(dtype) + position_offset
    if reference_grid is not None:  # the order of timm's operations, for the same rounding
        rows = rows / height * reference_grid[0]
        cols = cols / width * reference_grid[1]
    rows, cols = torch.meshgrid(rows, cols, indexing='ij')  # (H, W) each
    first, second = (rows, cols) if axis_order == 'yx' else (cols, rows)
    return torch.stack([first.flatten(), second.flatten()], dim=-1)


def _cos_sin(angles: torch.Tensor) -> torch.Tensor:
    """cos and sin of the angles (..., d / 2), stacked: (2, ..., d / 2)."""
    return torch.stack([angles.cos(), angles.sin()])


@grid_constant(max_bytes=64 << 20)
def axial_rotation(height: int, width: int, head_dim: int, temperature: float, position_offset: float,
                   reference_grid: Optional[Tuple[int, int]], axis_order: str, dtype: torch.dtype = torch.float32,
                   device: torch.device = torch.device('cpu')) -> torch.Tensor:
    """cos and sin of the axial angles of every grid token, (2, H W, head_dim / 2) in ``dtype``, one
    column per pair; cached. A pure function of its arguments, which are the cache key."""
    coordinates = grid_coordinates(height, width, position_offset, reference_grid, axis_order, dtype, device)
    bands = axial_frequencies(head_dim, temperature, dtype, device)
    angles = (coordinates[:, :, None] * bands).flatten(1)  # (HW, 2, F) -> (HW, d / 2): a's bands, then b's
    return _cos_sin(angles)


def _mixed_angles(coordinates: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """φ = a f1 + b f2 of every token and head: coordinates (..., N, 2) (a, b), freqs (2, heads, d / 2)
    -> (..., heads, N, d / 2)."""
    first, second = coordinates[..., None, :, 0, None], coordinates[..., None, :, 1, None]  # (..., 1, N, 1)
    return first * freqs[0][:, None] + second * freqs[1][:, None]


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """x (..., d) as the complex numbers u + iv of its channel pairs (2p, 2p + 1), (..., d / 2): a
    view of x where its strides allow one, else of a contiguous copy."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.view_as_complex(pairs if _viewable_as_complex(pairs) else pairs.contiguous())


def _viewable_as_complex(pairs: torch.Tensor) -> bool:
    """Whether ``torch.view_as_complex`` takes ``pairs`` (..., 2) as it is: adjacent pair members,
    every other stride and the storage offset even."""
    return (pairs.stride(-1) == 1 and pairs.storage_offset() % 2 == 0
            and all(stride % 2 == 0 for stride in pairs.stride()[:-1]))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: str) -> torch.Tensor:
    """x (..., d) with each pair (u, v) of channels turned by its angle φ: (u cos φ - v sin φ, v cos φ +
    u sin φ); cos and sin (..., d / 2) broadcast against x's pairs, in x's dtype (float32 or float64).

    Eagerly, interleaved pairs are complex numbers u + iv multiplied by e^(iφ) (RoPE-ViT's
    ``freqs_cis``): one vectorised product on a view of x, where the real form reads and writes
    every other channel, several times slower. A compiler (``torch.compile``, ``torch.export``)
    gets the real form, which it fuses into one kernel and which exports to formats without
    complex numbers (ONNX); it cannot generate code for complex products.
    """
    if pairing == 'halves':
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    if torch.compiler.is_compiling():
        u, v = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack([u * cos - v * sin, v * cos + u * sin], dim=-1).flatten(-2)
    return torch.view_as_real(_as_complex(x) * torch.complex(cos, sin)).flatten(-2)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _reference_grid(reference_grid: Optional[Sequence[int]]) -> Optional[Tuple[int, int]]:
    """``reference_grid`` as an (h, w) pair of ints >= 1 or None, or a ValueError saying what it takes."""
    if reference_grid is None:
        return None
    return checked_pair(reference_grid, 'rope', 'reference_grid',
                        'the grid every input grid is scaled to (EVA-02: (16, 16)), or None')


@register_phi('rope')
class RotaryPositionEmbedding(PositionalModule):
    """2D rotary position embedding of the queries and keys (module docstring); no logits bias.

    Axial frequencies are fixed (no parameters); their sine and cosine per grid are constants of
    the grid, cached (:func:`axial_rotation`), and so are those of a layout's tokens. Mixed
    frequencies are learned, the layer's own ``freqs`` Parameter; their rotation is computed at every
    call, or on one grid served by :func:`posattn.cache_positions` while the frequencies are
    unchanged. Angles and their sine and cosine are computed in float32 at least (float64 for
    float64 queries), as timm does, and the rotated queries and keys keep their dtype.

    Args:
        head_dim: channels per head d; a multiple of 4 (two axes, pairs of channels).
        num_heads: attention heads (the mixed frequencies are per head).
        frequencies: 'axial' (fixed bands, one axis per half of the pairs: EVA-02, RoPE-Axial) or
            'mixed' (learned per head: RoPE-Mixed).
        temperature: θ of the bands ω_f = θ^(-f / F) (axial) or of the initial magnitudes (mixed);
            None: 10000 for axial (RoFormer, EVA-02), 10 for mixed (RoPE-ViT). RoPE-ViT's axial
            models use 100.
        position_offset: o, added to the row and column indices (timm's ``grid_offset``; 1 in the
            Perception Encoder models).
        reference_grid: (h, w): every H x W grid is read as spanning it, coordinates scaled by
            h / H and w / W (EVA-02's ``ref_feat_shape``, its pre-training grid, (16, 16)); None
            reads indices as they are.
        axis_order: 'yx': the first axis is the row (EVA-02; timm's ``grid_indexing='ij'``), or
            'xy': the column (RoPE-ViT, Perception Encoder; timm's ``'xy'``).
        pairing: 'interleaved': channels (2p, 2p + 1) form pair p, or 'halves': (p, p + d / 2)
            (timm's ``rotate_half``).
    """

    def __init__(self, head_dim: int, num_heads: int, frequencies: str = 'axial', temperature: Optional[float] = None,
                 position_offset: float = 0.0, reference_grid: Optional[Sequence[int]] = None,
                 axis_order: str = 'yx', pairing: str = 'interleaved'):
        super().__init__(hooks=('queries_keys',))
        if not is_integer(head_dim) or head_dim < 4 or head_dim % 4:
            raise ValueError(f'rope needs head_dim, the channels per head, to be a multiple of 4 (pairs of channels '
                             f'for two axes); got {head_dim!r}: pick num_heads so that dim / num_heads is a '
                             'multiple of 4')
        num_heads = checked_count(num_heads, 'rope', 'num_heads')
        if frequencies not in FREQUENCIES:
            raise ValueError(f"rope frequencies must be 'axial' (fixed, EVA-02) or 'mixed' (learned, RoPE-Mixed); "
                             f'got {frequencies!r}')
        temperature = DEFAULT_TEMPERATURE[frequencies] if temperature is None else temperature
        if not _real(temperature) or not temperature > 0:
            raise ValueError(f'rope temperature must be a number > 0, got {temperature!r}')
        if not _real(position_offset):
            raise ValueError(f'rope position_offset must be a number, got {position_offset!r}')
        if axis_order not in AXIS_ORDERS:
            raise ValueError(f"rope axis_order must be 'yx' (rows first) or 'xy' (columns first), got {axis_order!r}")
        if pairing not in PAIRINGS:
            raise ValueError(f"rope pairing must be 'interleaved' (channels 2p, 2p + 1) or 'halves' (channels p, "
                             f'p + head_dim / 2), got {pairing!r}')
        self.head_dim, self.num_heads = int(head_dim), int(num_heads)
        self.frequencies = frequencies
        self.temperature, self.position_offset = float(temperature), float(position_offset)
        self.reference_grid = _reference_grid(reference_grid)
        self.axis_order, self.pairing = axis_order, pairing
        owned = frequencies == 'mixed'
        self.register_parameter('freqs', nn.Parameter(mixed_frequencies_init(
            self.head_dim, self.num_heads, self.temperature)) if owned else None)

    @property
    def learned_frequencies(self) -> Optional[torch.Tensor]:
        """This layer's mixed frequencies (f1, f2), (2, heads, d / 2), its ``freqs``; None for axial."""
        return self.freqs

    def _check_heads(self, q: torch.Tensor) -> None:
        if q.shape[1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(f'rope built for {self.num_heads} heads of {self.head_dim} channels got queries of shape '
                             f'{tuple(q.shape)} (B, heads, N, head_dim)')

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> Tuple[torch.Tensor, torch.Tensor]:
        """q, k (B, heads, N, d) with their grid tokens rotated; prefix tokens as they were."""
        self._check_heads(q)
        cos, sin = self.rotation(grid, q.dtype, q.device)
        prefix = grid.num_prefix_tokens
        return self._rotate(q, cos, sin, prefix), self._rotate(k, cos, sin, prefix)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefix: int) -> torch.Tensor:
        tokens = x[:, :, prefix:].to(cos.dtype)
        rotated = rotate_pairs(tokens, cos, sin, self.pairing).to(x.dtype)
        return torch.cat([x[:, :, :prefix], rotated], dim=2) if prefix else rotated

    def rotation(self, grid: TokenGrid, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> torch.Tensor:
        """cos and sin of every grid token's angles, (2, H W, d / 2) (axial) or (2, heads, H W, d / 2)
        (mixed), one column per pair; in float32 at least (float64 for float64)."""
        precision = torch.promote_types(dtype, torch.float32)
        if self.frequencies == 'axial':
            return axial_rotation(grid.height, grid.width, self.head_dim, self.temperature, self.position_offset,
                                  self.reference_grid, self.axis_order, precision,
                                  device or torch.device('cpu'))
        device = device or self.learned_frequencies.device
        return self.cached(('rotation', grid, precision, device),
                           lambda: self._mixed_rotation(grid, precision, device))

    def _mixed_rotation(self, grid: TokenGrid, precision: torch.dtype, device: torch.device) -> torch.Tensor:
        coordinates = grid_coordinates(grid.height, grid.width, self.position_offset, self.reference_grid,
                                       self.axis_order, precision, device)  # (HW, 2)
        freqs = self.learned_frequencies.to(device, precision)  # (2, heads, d / 2)
        return _cos_sin(_mixed_angles(coordinates, freqs))  # angles (heads, HW, d / 2)

    def queries_keys_at(self, q: torch.Tensor, k: torch.Tensor, positions: TokenPositions,
                        **given: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """q, k (I, heads, M, d) on rows of images, each grid token rotated by its own row and column
        on its image's grid; prefix tokens and padding turn by the angle 0, which leaves them as they are."""
        self._check_heads(q)
        precision = torch.promote_types(q.dtype, torch.float32)
        if self.frequencies == 'axial':
            cos, sin = layout_axial_rotation(positions.layout, positions.batch, self.head_dim, self.temperature,
                                             self.position_offset, self.reference_grid, self.axis_order, precision,
                                             q.device)[:, :, None]  # (2, I, 1, M, d / 2): the same in every head
        else:
            coordinates = layout_coordinates(positions.layout, positions.batch, self.position_offset,
                                             self.reference_grid, self.axis_order, precision, q.device)  # (I, M, 2)
            freqs = self.learned_frequencies.to(q.device, precision)  # (2, heads, d / 2)
            cos, sin = _cos_sin(_mixed_angles(coordinates, freqs))  # (2, I, heads, M, d / 2)
        return (rotate_pairs(q.to(cos.dtype), cos, sin, self.pairing).to(q.dtype),
                rotate_pairs(k.to(cos.dtype), cos, sin, self.pairing).to(k.dtype))

    def settings(self) -> Dict[str, Any]:
        settings = {'head_dim': self.head_dim, 'num_heads': self.num_heads, 'frequencies': self.frequencies}
        if self.frequencies == 'axial':  # learned frequencies take the temperature as their initialisation only
            settings['temperature'] = self.temperature
        return {**settings, 'position_offset': self.position_offset, 'reference_grid': self.reference_grid,
                'axis_order': self.axis_order, 'pairing': self.pairing}


@grid_constant(max_bytes=64 << 20)
def _table_rows(layout: ImageLayout, batch: int, device: torch.device) -> torch.Tensor:
    """Where each token's values lie in per-grid tables stacked in the order ``grid_id`` counts the
    distinct grids (H W rows each, row-major), followed by one row for tokens off the grid (prefix
    tokens, padding): (I, M) int64; cached."""
    positions = token_positions(layout, batch, device)
    sizes = torch.tensor([0] + [grid.height * grid.width for grid in positions.distinct_grids])
    firsts = sizes.cumsum(0).to(device)  # (grids + 1,): where each table starts, then the extra row
    cells = firsts[positions.grid_id][:, None] + positions.row * positions.width + positions.col
    return torch.where(positions.is_grid, cells, firsts[-1])


@grid_constant(max_bytes=64 << 20)
def layout_coordinates(layout: ImageLayout, batch: int, position_offset: float,
                       reference_grid: Optional[Tuple[int, int]], axis_order: str, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """The coordinates (a, b) of every token of a layout's images, one a row, gathered from the
    :func:`grid_coordinates` of its image's grid, so that they are those of the image alone to the bit
    on any device: (I, M, 2) in ``dtype``; 0 at prefix tokens and padding; cached."""
    tables = [grid_coordinates(grid.height, grid.width, position_offset, reference_grid, axis_order, dtype, device)
              for grid in layout.images_by_grid()]
    off_grid = torch.zeros(1, 2, dtype=dtype, device=device)
    return torch.cat([*tables, off_grid])[_table_rows(layout, batch, device)]


@grid_constant(max_bytes=64 << 20)
def layout_axial_rotation(layout: ImageLayout, batch: int, head_dim: int, temperature: float, position_offset: float,
                          reference_grid: Optional[Tuple[int, int]], axis_order: str, dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
    """cos and sin of the axial angles of every token of a layout's images, one a row, gathered from the
    :func:`axial_rotation` of its image's grid: (2, I, M, d / 2) in ``dtype``; cos 1 and sin 0 at prefix
    tokens and padding; cached."""
    tables = [axial_rotation(grid.height, grid.width, head_dim, temperature, position_offset, reference_grid,
                             axis_order, dtype, device) for grid in layout.images_by_grid()]  # (2, HW, d / 2) each
    off_grid = _cos_sin(torch.zeros(1, head_dim // 2, dtype=dtype, device=device))  # (2, 1, d / 2)
    return torch.cat([*tables, off_grid], dim=1)[:, _table_rows(layout, batch, device)]
