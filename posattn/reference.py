"""Plain statements of posattn's formulas: slow and literal, for reading and for checking.

Each function computes what a fast path of posattn computes, the straightforward way the papers'
released code does, without posattn's shortcuts. The tests run them in float64 as the oracle of
the fast paths; the benchmarks time them as the baseline that the shortcuts are measured against.
Parameters come in posattn's layout (:mod:`posattn.convert` maps the releases' names); the
peripheral Φp's as a :class:`~posattn.phi.peripheral.PeripheralWeights`.

    from posattn import reference
    slow = reference.peripheral_position_attention(14, 14, phi.weights())     # (heads, 196, 196)
"""
from __future__ import annotations

import math
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .phi.peripheral import PeripheralWeights

__all__ = ['padded_coordinates', 'peripheral_position_attention', 'peripheral_attention',
           'softmax_attention', 'irpe_bucket_ids', 'irpe_attention', 'bicubic_resize', 'relative_position_bias',
           'alibi_bias', 'gpsa_position_attention', 'gpsa_attention', 'rope_rotate', 'linear_resize',
           'decomposed_relative_position_bias', 'decomposed_attention']

PADDING = 2  # PerViT pads the key grid by two rows and columns on every side
NORM_EPS = 1e-5


def padded_coordinates(length: int, dtype: torch.dtype = torch.float64,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """``linspace(-1, 1, n)`` extended by two real steps on each side: (n + 4,).

    A single row or column has no step; it takes 2, the extent of [-1, 1].
    """
    core = torch.linspace(-1, 1, length, dtype=dtype, device=device)
    step = 2.0 / (length - 1) if length > 1 else 2.0
    outward = step * torch.arange(1, PADDING + 1, dtype=dtype, device=device)
    return torch.cat([(core[0] - outward).flip(0), core, core[-1] + outward])


def _instance_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each (query, channel) map of x (queries, C, h, w) normalised over its h x w cells, then scaled
    and shifted per channel: the release's ``nn.GroupNorm(C, C)``, written out (a 1 x 1 map gives 0)."""
    mean = x.mean((2, 3), keepdim=True)
    var = (x - mean).square().mean((2, 3), keepdim=True)
    return (x - mean) / torch.sqrt(var + NORM_EPS) * weight[:, None, None] + bias[:, None, None]


def peripheral_position_attention(height: int, width: int, weights: PeripheralWeights) -> torch.Tensor:
    """PerViT's Φp (Eq. 6-8) as the release computes it: (heads, H*W, H*W), [head, query, key].

    R[q, k, r] = w_r ||c_k - c_q|| + b_r over every pair of the 2-padded grid (all 4 * heads
    channels), cropped to the inner H x W queries; then, with each query a batch item over its
    (H+4) x (W+4) keys: 3x3 valid conv, instance norm, ReLU, 3x3 valid conv, instance norm,
    sigmoid.
    """
    w = weights
    dtype, device = w.distance_weight.dtype, w.distance_weight.device
    ys, xs = padded_coordinates(height, dtype, device), padded_coordinates(width, dtype, device)
    coords = torch.stack(torch.meshgrid(ys, xs, indexing='ij'), dim=-1).reshape(-1, 2)
    distances = (coords[None, :, :] - coords[:, None, :]).square().sum(-1).sqrt()  # [q, k] = ||c_k - c_q||
    embedded = F.linear(distances[..., None], w.distance_weight, w.distance_bias)  # (N', N', D_r)
    rows, cols = height + 2 * PADDING, width + 2 * PADDING
    inner = embedded.reshape(rows, cols, rows * cols, -1)[PADDING:-PADDING, PADDING:-PADDING]
    x = inner.reshape(height * width, rows, cols, -1).permute(0, 3, 1, 2)  # (queries, D_r, H+4, W+4)
    x = _instance_norm(F.conv2d(x, w.proj1_weight, w.proj1_bias), w.norm1_weight, w.norm1_bias)
    x = _instance_norm(F.conv2d(F.relu(x), w.proj2_weight, w.proj2_bias), w.norm2_weight, w.norm2_bias)
    # x: (queries, heads, H, W)
    return torch.sigmoid(x).reshape(height * width, -1, height * width).permute(1, 0, 2)


def _split_heads(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor], num_heads: int):
    batch, tokens, dim = x.shape
    qkv = F.linear(x, qkv_weight, qkv_bias).reshape(batch, tokens, 3, num_heads, dim // num_heads)
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # q, k, v: (B, heads, N, d)


def _merge_heads(out: torch.Tensor) -> torch.Tensor:
    batch, heads, tokens, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


def _over_all_pairs(grid_term: torch.Tensor, num_prefix_tokens: int, fill: float) -> torch.Tensor:
    """A (heads, P, P) term over the grid pairs as (heads, N, N), ``fill`` wherever a prefix token is."""
    heads, positions, _ = grid_term.shape
    tokens = num_prefix_tokens + positions
    full = grid_term.new_full((heads, tokens, tokens), fill)
    full[:, num_prefix_tokens:, num_prefix_tokens:] = grid_term
    return full


def peripheral_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                         proj_weight: torch.Tensor, proj_bias: torch.Tensor, num_heads: int,
                         position_attention: torch.Tensor, num_prefix_tokens: int = 0) -> torch.Tensor:
    """The release's Multi-head Peripheral Attention (PerViT Eq. 5), then the output projection:

        proj(normalize_L1(exp(S - rowmax S) * Φp) V),   S = q k^T / sqrt(d),

    Φp (heads, H*W, H*W) over the grid pairs and 1 wherever a prefix token is. The L1
    normalisation loses rows whose Φp underflows (a sharp Φp); posattn adds log Φp instead.
    """
    q, k, v = _split_heads(x, qkv_weight, qkv_bias, num_heads)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    weights = _over_all_pairs(position_attention, num_prefix_tokens, 1.0)
    attn = F.normalize(torch.exp(scores - scores.amax(-1, keepdim=True)) * weights, p=1, dim=-1)
    return F.linear(_merge_heads(attn @ v), proj_weight, proj_bias)


def softmax_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                      proj_weight: torch.Tensor, proj_bias: torch.Tensor, num_heads: int,
                      grid_bias: Optional[torch.Tensor] = None, num_prefix_tokens: int = 0) -> torch.Tensor:
    """proj(softmax(q k^T / sqrt(d) + b) V): multi-head self-attention (Vaswani et al. 2017) with a
    logits bias b (heads, H*W, H*W) over the grid pairs, zero wherever a prefix token is; plain
    attention without one."""
    q, k, v = _split_heads(x, qkv_weight, qkv_bias, num_heads)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if grid_bias is not None:
        scores = scores + _over_all_pairs(grid_bias, num_prefix_tokens, 0.0)
    return F.linear(_merge_heads(scores.softmax(-1) @ v), proj_weight, proj_bias)


def _piecewise_index(offset: float, ratio: float) -> int:
    """g(x) of iRPE (Wu et al. 2021, Eq. 18), alpha = ratio, beta = 2 ratio, gamma = 8 ratio."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    if abs(offset) <= alpha:
        return int(offset)
    compressed = round(alpha + math.log(abs(offset) / alpha) / math.log(gamma / alpha) * (beta - alpha))
    return int(math.copysign(min(compressed, beta), offset))


def irpe_bucket_ids(height: int, width: int, num_prefix_tokens: int, method: str, ratio: float) -> torch.Tensor:
    """iRPE's bucket of every (query, key) pair, one pair at a time: (tables, N, N) int64.

    Offsets (dr, dc) are query minus key in grid rows and columns; with b = int(2 ratio):
    euc g(round(sqrt(dr^2 + dc^2))) + b, quant g(dr^2 + dc^2) + b, cross g(dr) + b and g(dc) + b
    (two tables), product (g(dr) + b)(2b + 1) + g(dc) + b. Pairs with a prefix token share the
    bucket after the last.
    """
    b = int(2 * ratio)
    per_axis = 2 * b + 1
    prefix_bucket = per_axis ** 2 if method == 'product' else per_axis
    tables = 2 if method == 'cross' else 1
    tokens = num_prefix_tokens + height * width
    ids: List[List[List[int]]] = [[[prefix_bucket] * tokens for _ in range(tokens)] for _ in range(tables)]
    for i in range(height * width):
        for j in range(height * width):
            dr, dc = i // width - j // width, i % width - j % width
            if method == 'euc':
                values = [_piecewise_index(round(math.sqrt(dr * dr + dc * dc)), ratio) + b]
            elif method == 'quant':
                values = [_piecewise_index(dr * dr + dc * dc, ratio) + b]
            elif method == 'cross':
                values = [_piecewise_index(dr, ratio) + b, _piecewise_index(dc, ratio) + b]
            elif method == 'product':
                values = [(_piecewise_index(dr, ratio) + b) * per_axis + _piecewise_index(dc, ratio) + b]
            else:
                raise ValueError(f'unknown iRPE method {method!r}')
            for table, value in enumerate(values):
                ids[table][num_prefix_tokens + i][num_prefix_tokens + j] = value
    return torch.tensor(ids)


def irpe_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                   proj_weight: torch.Tensor, proj_bias: torch.Tensor, num_heads: int,
                   tables: Mapping[str, Sequence[torch.Tensor]], ids: torch.Tensor, mode: str) -> torch.Tensor:
    """iRPE attention (Wu et al. 2021, Eq. 11-13), every table read out per (query, key) pair:

        softmax(q_s k^T + b) V + sum_j A[i, j] T_v[id(i, j)],   then proj,

    with q_s, k_s the queries and keys over sqrt(d) and b the sum of each table's term: bias mode
    T_k[id(i, j)] and T_q[id(j, i)]; ctx mode q_s[i] . T_k[:, id(i, j)] and k_s[j] . T_q[:, id(j, i)].

    Args:
        tables: {'q' | 'k' | 'v': [one table per id table]} in the release's shapes, heads (or 1
            when shared) first: bias (heads, buckets); ctx on q, k (heads, d, buckets); on v
            (heads, buckets, d).
        ids: (tables, N, N) bucket ids, [table, query, key] (:func:`irpe_bucket_ids`).
        mode: 'bias' or 'ctx'.
    """
    q, k, v = _split_heads(x, qkv_weight, qkv_bias, num_heads)
    q_s, k_s = q / math.sqrt(q.shape[-1]), k / math.sqrt(k.shape[-1])
    logits = q_s @ k.transpose(-1, -2)
    for target in ('q', 'k'):
        for table, table_ids in zip(tables.get(target, ()), ids):
            table = table.expand(num_heads, *table.shape[1:])
            if mode == 'bias':
                per_pair = table[:, table_ids]  # (heads, N, N): [h, i, j] = T[h, id(i, j)]
                logits = logits + (per_pair if target == 'k' else per_pair.transpose(-1, -2))
            elif target == 'k':
                logits = logits + torch.einsum('bhid,hdij->bhij', q_s, table[:, :, table_ids])
            else:  # [h, :, j, i] = T_q[h, :, id(j, i)]
                logits = logits + torch.einsum('bhjd,hdji->bhij', k_s, table[:, :, table_ids])
    attn = logits.softmax(-1)
    out = attn @ v
    for table, table_ids in zip(tables.get('v', ()), ids):
        per_pair = table.expand(num_heads, *table.shape[1:])[:, table_ids]  # (heads, N, N, d)
        out = out + torch.einsum('bhij,hijd->bhid', attn, per_pair)
    return F.linear(_merge_heads(out), proj_weight, proj_bias)


CUBIC_A = -0.75  # Keys' cubic convolution parameter, PyTorch's (and OpenCV's) bicubic


def _cubic_weight(distance: float) -> float:
    """Keys' cubic convolution kernel at ``distance`` from a sample, a = -0.75."""
    x, a = abs(distance), CUBIC_A
    if x <= 1:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _cubic_taps(out_index: int, in_size: int, out_size: int) -> List[Tuple[int, float]]:
    """The 4 (input index, weight) pairs of output ``out_index``: source coordinate
    (o + 1/2) in / out - 1/2 (half-pixel centres, ``align_corners=False``), indices clamped to the border."""
    source = (out_index + 0.5) * in_size / out_size - 0.5
    first = math.floor(source)
    return [(min(max(index, 0), in_size - 1), _cubic_weight(source - index)) for index in range(first - 1, first + 3)]


def bicubic_resize(canvas: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """``canvas`` (C, h, w) resampled to (C, *size), one output value at a time, as
    ``F.interpolate(mode='bicubic', align_corners=False)`` computes it: the 4 x 4 nearest samples
    weighted by Keys' cubic convolution (a = -0.75) along each axis."""
    height, width = size
    out = canvas.new_zeros(canvas.shape[0], height, width)
    for y in range(height):
        for x in range(width):
            for row, row_weight in _cubic_taps(y, canvas.shape[1], height):
                for col, col_weight in _cubic_taps(x, canvas.shape[2], width):
                    out[:, y, x] += row_weight * col_weight * canvas[:, row, col]
    return out


def relative_position_bias(table: torch.Tensor, table_size: Sequence[int], height: int, width: int,
                           num_prefix_tokens: int = 0) -> torch.Tensor:
    """The learned relative position bias of Swin (Liu et al. 2021, Sec. 3.2) and BEiT (Bao et al.
    2022) on an H x W grid, pair by pair: (heads, N, N), [head, query, key], N = num_prefix_tokens + H W.

    ``table`` is timm's ``relative_position_bias_table`` ((2h - 1)(2w - 1) [+ 3], heads) of a
    ``table_size`` (h, w) grid, row (dy + h - 1)(2w - 1) + dx + w - 1 for the offset (dy, dx) =
    query minus key; on a grid of another size the (2h - 1) x (2w - 1) offsets are resampled to
    (2H - 1) x (2W - 1) (:func:`bicubic_resize`). A pair with a prefix token reads BEiT's extra rows
    (prefix query and grid key, grid query and prefix key, two prefix tokens), or gets 0 without them.
    """
    table_height, table_width = table_size
    offsets = (2 * table_height - 1) * (2 * table_width - 1)
    canvas = table[:offsets].t().reshape(-1, 2 * table_height - 1, 2 * table_width - 1)
    if (height, width) != (table_height, table_width):
        canvas = bicubic_resize(canvas, (2 * height - 1, 2 * width - 1))
    extra = table[offsets:]
    prefix = num_prefix_tokens
    tokens = prefix + height * width
    bias = table.new_zeros(table.shape[1], tokens, tokens)
    for i in range(tokens):
        for j in range(tokens):
            if i >= prefix and j >= prefix:
                dy = (i - prefix) // width - (j - prefix) // width
                dx = (i - prefix) % width - (j - prefix) % width
                bias[:, i, j] = canvas[:, dy + height - 1, dx + width - 1]
            elif len(extra):
                bias[:, i, j] = extra[0 if i < prefix <= j else 1 if j < prefix <= i else 2]
    return bias


def alibi_bias(slopes: Sequence[float], height: int, width: int) -> torch.Tensor:
    """2D ALiBi (Press et al. 2022; CROMA, Fuller et al. 2023) on an H x W grid, pair by pair:
    -m_h ||p_i - p_j||_2 with m_h = ``slopes[h]``, (heads, H W, H W) float64 over the grid pairs.

    The slopes come from the caller (the tests pass those of ALiBi's released ``get_slopes``), so
    that this statement of the bias does not repeat posattn's slope rule.
    """
    positions = [(row, col) for row in range(height) for col in range(width)]
    return torch.tensor([[[-float(slope) * math.hypot(p[0] - q[0], p[1] - q[1]) for q in positions]
                          for p in positions] for slope in slopes], dtype=torch.float64)


def gpsa_position_attention(pos_weight: torch.Tensor, pos_bias: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """ConViT's positional attention (d'Ascoli et al. 2021, Eq. 10) on an H x W grid, pair by pair:
    softmax over the keys j of v_h · r_ij + c_h, r_ij = (dx, dy, dx² + dy²) with (dx, dy) the column and
    row of key j minus those of query i; ``pos_weight`` (heads, 3) = (v_h), ``pos_bias`` (heads,) = (c_h)
    (timm's ``pos_proj``). (heads, H W, H W), [head, query, key]."""
    positions = [(row, col) for row in range(height) for col in range(width)]
    logits = pos_weight.new_zeros(pos_weight.shape[0], len(positions), len(positions))
    for i, (query_row, query_col) in enumerate(positions):
        for j, (key_row, key_col) in enumerate(positions):
            dx, dy = key_col - query_col, key_row - query_row
            offset = torch.tensor([dx, dy, dx * dx + dy * dy], dtype=pos_weight.dtype)
            logits[:, i, j] = pos_weight @ offset + pos_bias
    return logits.softmax(-1)


def gpsa_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                   proj_weight: torch.Tensor, proj_bias: torch.Tensor, num_heads: int, pos_weight: torch.Tensor,
                   pos_bias: torch.Tensor, gating_param: torch.Tensor, height: int, width: int,
                   num_prefix_tokens: int = 0) -> torch.Tensor:
    """ConViT's gated positional self-attention (d'Ascoli et al. 2021, Eq. 9-10; timm's ``GPSA``), then
    the output projection:

        proj(normalize(A) V),   A_h = (1 - σ(λ_h)) softmax(q k^T / sqrt(d)) + σ(λ_h) P_h,

    P_h of :func:`gpsa_position_attention` over the grid pairs, ``normalize`` dividing every row by
    its sum. With prefix tokens P is zero wherever a prefix token is the key, and a prefix query keeps
    its content attention (its gate is 0).
    """
    q, k, v = _split_heads(x, qkv_weight, qkv_bias, num_heads)
    content = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)  # (B, heads, N, N)
    position = _over_all_pairs(gpsa_position_attention(pos_weight, pos_bias, height, width), num_prefix_tokens, 0.0)
    attn = content.clone()  # a prefix query's row
    gate = torch.sigmoid(gating_param)[:, None]  # (heads, 1)
    for i in range(num_prefix_tokens, content.shape[-2]):
        attn[:, :, i] = (1 - gate) * content[:, :, i] + gate * position[:, i]
    attn = attn / attn.sum(-1, keepdim=True)
    return F.linear(_merge_heads(attn @ v), proj_weight, proj_bias)


def rope_rotate(x: torch.Tensor, height: int, width: int, num_prefix_tokens: int = 0,
                mixed_frequencies: Optional[torch.Tensor] = None, temperature: float = 10000.0,
                position_offset: float = 0.0, reference_grid: Optional[Sequence[int]] = None,
                axis_order: str = 'yx', pairing: str = 'interleaved') -> torch.Tensor:
    """Rotary position embedding (RoPE, Su et al. 2021) of the grid tokens of queries or keys ``x``
    (B, heads, N, d), one token and one pair of channels at a time: float64, prefix tokens as they are.

    Token (row y, column x) of the H x W grid has coordinates y' = (y + o) h / H, x' = (x + o) w / W
    (o = ``position_offset``; (h, w) = ``reference_grid``, the grid itself when None), the first
    axis a and the second b by ``axis_order`` ('yx': a = y'). Pair p of a head turns by

        axial (EVA-02, Fang et al. 2024):   φ = a θ^(-p / F) for p < F, b θ^(-(p - F) / F) after, F = d / 4
        mixed (RoPE-ViT, Heo et al. 2024):  φ = a f1[h, p] + b f2[h, p]

    with θ = ``temperature`` and (f1, f2) = ``mixed_frequencies`` (2, heads, d / 2) (None: axial),
    and its channels (u, v), (2p, 2p + 1) or (p, p + d / 2) by ``pairing``, become
    (u cos φ - v sin φ, v cos φ + u sin φ).
    """
    given = x.detach().to(torch.float64)
    out = given.clone()
    heads, tokens, dim = x.shape[1:]
    num_pairs, num_bands = dim // 2, dim // 4
    ref_height, ref_width = reference_grid if reference_grid is not None else (height, width)
    for token in range(num_prefix_tokens, tokens):
        row, col = divmod(token - num_prefix_tokens, width)
        y = (row + position_offset) * ref_height / height
        x_coordinate = (col + position_offset) * ref_width / width
        a, b = (y, x_coordinate) if axis_order == 'yx' else (x_coordinate, y)
        for head in range(heads):
            for pair in range(num_pairs):
                if mixed_frequencies is None:
                    coordinate = a if pair < num_bands else b
                    angle = coordinate * temperature ** (-(pair % num_bands) / num_bands)
                else:
                    f1, f2 = mixed_frequencies.detach()[:, head, pair].tolist()
                    angle = a * f1 + b * f2
                first, second = (2 * pair, 2 * pair + 1) if pairing == 'interleaved' else (pair, pair + num_pairs)
                u, v = given[:, head, token, first], given[:, head, token, second]
                out[:, head, token, first] = u * math.cos(angle) - v * math.sin(angle)
                out[:, head, token, second] = v * math.cos(angle) + u * math.sin(angle)
    return out


def linear_resize(embeddings: torch.Tensor, length: int) -> torch.Tensor:
    """``embeddings`` (L, d) resampled along L to (length, d), one output row at a time, as
    ``F.interpolate(mode='linear', align_corners=False)`` computes it: output row o lies at the source
    coordinate (o + 1/2) L / length - 1/2 (half-pixel centres), clamped at 0, between its two nearest rows."""
    size = embeddings.shape[0]
    out = embeddings.new_zeros(length, embeddings.shape[1])
    for row in range(length):
        source = max((row + 0.5) * size / length - 0.5, 0.0)
        below = math.floor(source)
        above = min(below + 1, size - 1)
        weight = source - below
        out[row] = (1 - weight) * embeddings[below] + weight * embeddings[above]
    return out


def decomposed_relative_position_bias(q: torch.Tensor, rel_pos_h: torch.Tensor, rel_pos_w: torch.Tensor,
                                      height: int, width: int, num_prefix_tokens: int = 0) -> torch.Tensor:
    """Decomposed relative position embeddings (MViTv2, Li et al. 2022; SAM's image encoder, Kirillov et
    al. 2023) on an H x W grid, pair by pair: q_i · R_h[dy + H - 1] + q_i · R_w[dx + W - 1] for the
    queries q (..., N, d), (..., N, N), [query, key], N = num_prefix_tokens + H W.

    (dy, dx) is query minus key in rows and columns; ``rel_pos_h`` (2h - 1, d) and ``rel_pos_w``
    (2w - 1, d) are SAM's embeddings of the offsets of an h x w grid, resampled to 2H - 1 and 2W - 1
    rows where they have another number (:func:`linear_resize`). Pairs with a prefix token get 0.
    """
    if rel_pos_h.shape[0] != 2 * height - 1:
        rel_pos_h = linear_resize(rel_pos_h, 2 * height - 1)
    if rel_pos_w.shape[0] != 2 * width - 1:
        rel_pos_w = linear_resize(rel_pos_w, 2 * width - 1)
    prefix = num_prefix_tokens
    tokens = prefix + height * width
    bias = q.new_zeros(*q.shape[:-2], tokens, tokens)
    for i in range(prefix, tokens):
        for j in range(prefix, tokens):
            dy = (i - prefix) // width - (j - prefix) // width
            dx = (i - prefix) % width - (j - prefix) % width
            query = q[..., i, :]
            along_rows = (query * rel_pos_h[dy + height - 1]).sum(-1)
            bias[..., i, j] = along_rows + (query * rel_pos_w[dx + width - 1]).sum(-1)
    return bias


def decomposed_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                         proj_weight: torch.Tensor, proj_bias: torch.Tensor, num_heads: int, rel_pos_h: torch.Tensor,
                         rel_pos_w: torch.Tensor, height: int, width: int, num_prefix_tokens: int = 0) -> torch.Tensor:
    """proj(softmax(q k^T / sqrt(d) + b) V) with b the decomposed relative position bias of the
    layer's own queries (:func:`decomposed_relative_position_bias`), added unscaled: the attention of
    SAM's image encoder (its ``use_rel_pos``) with the class-token pairs of MViTv2."""
    q, k, v = _split_heads(x, qkv_weight, qkv_bias, num_heads)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores + decomposed_relative_position_bias(q, rel_pos_h, rel_pos_w, height, width, num_prefix_tokens)
    return F.linear(_merge_heads(scores.softmax(-1) @ v), proj_weight, proj_bias)
