"""The computation of the peripheral Φp (:mod:`posattn.phi.peripheral`): log Φp of an H x W grid
from its parameters, exactly, for all queries at once.

Exact shortcuts, none of which changes the result (``posattn.reference`` computes Φp without them):
- no nonlinearity sits between w and PP1, so the 4*heads distance channels collapse into one:
  PP1 is a 1-channel 3x3 conv with kernel sum_r w_r W1[:, r];
- the distances depend only on the offset k - q, so PP1 runs once on an offset canvas of
  (2H+3) x (2W+3) distances and each query reads its (H+2) x (W+2) window of the result;
- the biases of w, PP1 and PP2 add constants that the next instance norm removes, so they are
  not parameters here (no gradient could train them); a release checkpoint's are dropped when
  it is converted (:mod:`posattn.convert`), and ``posattn.reference`` still takes them.
Feeding ``logsigmoid(z)`` to a softmax instead of multiplying by ``sigmoid(z)`` also keeps a
sharp Φp (z around -60) exact where the release's L1 normalisation loses the row.

:func:`peripheral_log_attention` computes PerViT's design this way; :func:`design_log_attention`
the other designs of the paper's Table 5, keeping the offset canvas and the per-query kernel.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .._cache import grid_constant

__all__ = ['PeripheralWeights', 'axis_offsets', 'distance_canvas', 'peripheral_log_attention', 'design_log_attention']

KERNEL_SIZE = 3  # PP1 and PP2; keys are padded by 2 so that both valid convolutions end on H x W
NORM_EPS = 1e-5
# Elements of the (queries, H+2, W+2, hidden) activations per chunk of queries.
_CHUNK_ELEMENTS = 1 << 20
# torch.compiler.is_exporting is PyTorch 2.6's; under 2.5 an export keeps the chunks of its example's grid.
_is_exporting = getattr(torch.compiler, 'is_exporting', lambda: False)


def axis_offsets(length: int, pad: int = 2) -> torch.Tensor:
    """Key-minus-query coordinate offsets -(n-1+pad)..(n-1+pad) of an axis of n positions whose
    keys are padded by ``pad``, in the units of ``linspace(-1, 1, n)``, float64.

    A single row or column has no step; it is taken as 2, the extent of [-1, 1].
    """
    step = 2.0 / (length - 1) if length > 1 else 2.0
    return torch.arange(-(length - 1 + pad), length + pad, dtype=torch.float64) * step


def distance_canvas(height: int, width: int, pad: int = 2) -> torch.Tensor:
    """||offset|| for every key-minus-query offset of an H x W grid with keys padded by ``pad``:
    (2H-1+2pad, 2W-1+2pad), float64 ((2H+3, 2W+3) for PerViT's two 3x3 projections)."""
    rows, cols = axis_offsets(height, pad), axis_offsets(width, pad)
    return torch.sqrt(rows[:, None] ** 2 + cols[None, :] ** 2)


def _windows(canvas: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Every window of the channels-last PP1 canvas (2H-1+2p, 2W-1+2p, hidden) that one query
    reads, as a view: (H, W, hidden, H+2p, W+2p) indexed by window start (a, b), for a k x k PP2
    with p = (k - 1) / 2 (PerViT's 3x3: windows (H+2) x (W+2) of a (2H+1, 2W+1) canvas).

    Query (i, j) sees padded key (y, x) at offset (y - p - i, x - p - j), which is canvas cell
    (H - 1 - i + y, W - 1 - j + x): window (a, b) = (H - 1 - i, W - 1 - j) is query (i, j)
    mirrored, so the windows of all queries are one strided view and only the output is flipped.
    It is ``canvas.unfold(0, H+2p, 1).unfold(1, W+2p, 1)``, written with the strides, whose sizes
    stay symbolic where ``unfold``'s window size would be fixed (``torch.export`` with dynamic sizes).
    """
    rows, cols, channels = canvas.shape
    row_stride, col_stride, channel_stride = canvas.stride()
    return canvas.as_strided((height, width, channels, rows - height + 1, cols - width + 1),
                             (row_stride, col_stride, channel_stride, row_stride, col_stride))


def _windows_adjoint(grad_windows: torch.Tensor, canvas_shape: torch.Size) -> torch.Tensor:
    """The gradient of a canvas given its :func:`_windows`' gradient (r, W, hidden, H+2, W+2):
    every window adds its gradient back where it was read, overlaps summed. The two unfolds'
    own adjoints, applied in reverse order (what autograd would run, without building a graph)."""
    starts, width, hidden, rows, cols = grad_windows.shape
    row_windows = torch.ops.aten.unfold_backward(
        grad_windows, (starts, canvas_shape[1], hidden, rows), 1, cols, 1)  # (r, 2W+1, hidden, H+2)
    return torch.ops.aten.unfold_backward(row_windows, tuple(canvas_shape), 0, rows, 1)


def _box_means(maps: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Mean of every ``rows`` x ``cols`` window of (..., R, C) maps, from an integral image."""
    integral = F.pad(maps.cumsum(-2).cumsum(-1), (1, 0, 1, 0))
    sums = (integral[..., rows:, cols:] - integral[..., :-rows, cols:]
            - integral[..., rows:, :-cols] + integral[..., :-rows, :-cols])
    return sums / (rows * cols)


@grid_constant(max_bytes=64 << 20)
def _grid_moments(height: int, width: int, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """What PP1 and IN1 need from the grid alone, in float64, channels last.

    PP1's output canvas is sum_s K1[o, s] * shifted_s, with shifted_s the distance canvas moved by
    the kernel offset s (9 of them). Its window statistics are then K1 . mean_s and
    K1^T cov_st K1, with the window means and covariances of the shifted maps: a Gram form
    (non-negative up to float64 rounding, which the norm's eps covers) and no per-step pass over
    the canvas. Returns shifted (2H+1, 2W+1, 9), means (H, W, 9) and covariances (H, W, 9, 9).
    """
    distances = distance_canvas(height, width)
    rows, cols = 2 * height + 1, 2 * width + 1
    shifted = torch.stack([distances[u:u + rows, v:v + cols]
                           for u in range(KERNEL_SIZE) for v in range(KERNEL_SIZE)])
    means = _box_means(shifted, height + 2, width + 2)
    covariances = _box_means(shifted[:, None] * shifted[None], height + 2, width + 2) - means[:, None] * means[None]
    return tuple(t.to(device).contiguous() for t in (shifted.permute(1, 2, 0), means.permute(1, 2, 0),
                                                       covariances.permute(2, 3, 0, 1)))


def _row_chunks(canvas: torch.Tensor, height: int, width: int) -> List[slice]:
    """Slices of window-start rows whose activations stay near ``_CHUNK_ELEMENTS``; one slice of
    all rows under ``torch.export``, whose graph cannot hold a number of chunks that depends on
    the input size."""
    if _is_exporting():
        return [slice(0, height)]
    per_row = width * _windows(canvas, height, width)[0, 0].numel()
    step = max(_CHUNK_ELEMENTS // per_row, 1)
    return [slice(a, min(a + step, height)) for a in range(0, height, step)]


def _chunk_forward(canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias, rows):
    """Window rows ``rows``: (ReLU(IN1) activations, IN2-normalised maps, IN2 1/std, log Φp).

    The activations of the chunk's q queries are a batch of q channels-last images (q, hidden,
    H+2, W+2), so that PP2 is one convolution (q, heads, H, W) in the layout oneDNN's
    convolutions run fastest in; the maps of the outputs stay in the convolution's layout.
    """
    height, width, _ = scale.shape
    windows = _windows(canvas, height, width)[rows].permute(0, 1, 3, 4, 2)  # (r, W, H+2p, W+2p, hidden)
    # Gathered dense first, so that the result is (q, hidden, H+2p, W+2p) in channels-last order
    # (the overlapping windows' own strides would give another order; out= cannot be traced).
    hidden = torch.addcmul(shift[rows, :, None, None], windows.contiguous(), scale[rows, :, None, None]).relu_()
    hidden = hidden.permute(0, 1, 4, 2, 3).flatten(0, 1)  # (q, hidden, H+2p, W+2p)
    maps = F.conv2d(hidden, proj2_weight)  # PP2: (q, heads, H, W)
    centered = maps - maps.mean((2, 3), keepdim=True)
    inv_std = torch.rsqrt(centered.square().mean((2, 3), keepdim=True) + NORM_EPS)
    normed = centered.mul_(inv_std)
    log_phi = F.logsigmoid(torch.addcmul(norm2_bias[:, None, None], normed, norm2_weight[:, None, None]))
    return hidden, normed, inv_std, log_phi


def _query_span(rows: slice, height: int, width: int) -> slice:
    """The queries of window-start rows ``rows``, reversed: window (a, b) is query (H-1-a, W-1-b),
    so the chunk's window order flipped fills this contiguous span of the query axis."""
    tokens = height * width
    return slice(tokens - rows.stop * width, tokens - rows.start * width)


class _LogPeripheralAttention(torch.autograd.Function):
    """log Φp = logsigmoid(IN2(PP2(ReLU(IN1(PP1))))) for all queries, from the PP1 canvas.

    IN1's statistics come in as a per-query affine (``scale``, ``shift``: (H, W, hidden) by
    window start), so the work per query is one fused affine + ReLU over its window of the
    channels-last canvas (2H+1, 2W+1, hidden), PP2 as a convolution over the queries as a batch,
    and IN2 over the H x W keys. Queries run in chunks of window rows; when there is more than
    one chunk the backward recomputes each instead of keeping the (queries, hidden, H+2, W+2)
    activations, so memory stays at one chunk's whatever the grid. Output: (heads, H*W, H*W)
    indexed [head, query, key].
    """

    @staticmethod
    def forward(ctx, canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias):
        height, width, _ = scale.shape
        tokens = height * width
        chunks = _row_chunks(canvas, height, width)
        heads = norm2_weight.shape[0]
        log_phi = canvas.new_empty(heads, tokens, tokens)
        for rows in chunks:
            activations = _chunk_forward(canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias, rows)
            span = log_phi[:, _query_span(rows, height, width)]
            span.view(heads, -1, height, width).copy_(activations[-1].flip(0).transpose(0, 1))
        ctx.save_for_backward(canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias)
        ctx.activations = activations if len(chunks) == 1 else None
        return log_phi

    @staticmethod
    def backward(ctx, grad):
        canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias = ctx.saved_tensors
        height, width, _ = scale.shape
        heads = norm2_weight.shape[0]
        grad_canvas, grad_scale, grad_shift, grad_proj2 = map(torch.zeros_like,
                                                              (canvas, scale, shift, proj2_weight))
        grad_norm2_weight, grad_norm2_bias = map(torch.zeros_like, (norm2_weight, norm2_bias))
        windows = _windows(canvas, height, width)
        window_rows = windows.shape[-2]
        for rows in _row_chunks(canvas, height, width):
            hidden, normed, inv_std, log_phi = ctx.activations or _chunk_forward(
                canvas, scale, shift, proj2_weight, norm2_weight, norm2_bias, rows)
            upstream = grad[:, _query_span(rows, height, width)].view(heads, -1, height, width)
            grad_logits = upstream.transpose(0, 1).flip(0) * torch.expm1(log_phi).neg_()  # (q, heads, H, W)
            grad_norm2_weight += (grad_logits * normed).sum((0, 2, 3))
            grad_norm2_bias += grad_logits.sum((0, 2, 3))
            grad_normed = grad_logits.mul_(norm2_weight[:, None, None])
            grad_maps = (grad_normed - grad_normed.mean((2, 3), keepdim=True)
                         - normed * (grad_normed * normed).mean((2, 3), keepdim=True)).mul_(inv_std)
            grad_hidden, grad_proj2_chunk, _ = torch.ops.aten.convolution_backward(  # PP2's, in one call
                grad_maps.contiguous(memory_format=torch.channels_last), hidden, proj2_weight, None,
                (1, 1), (0, 0), (1, 1), False, (0, 0), 1, (True, True, False))
            grad_proj2 += grad_proj2_chunk
            grad_hidden = torch.ops.aten.threshold_backward(grad_hidden, hidden, 0)  # through ReLU
            chunk_windows = windows[rows]  # (r, W, hidden, H+2p, W+2p)
            grad_hidden = grad_hidden.view(chunk_windows.shape)
            grad_scale[rows] = (grad_hidden * chunk_windows).sum((-2, -1))
            grad_shift[rows] = grad_hidden.sum((-2, -1))
            grad_windows = grad_hidden.mul_(scale[rows, :, :, None, None])
            covered = slice(rows.start, rows.stop + window_rows - 1)
            grad_canvas[covered] += _windows_adjoint(grad_windows, canvas[covered].shape)
        ctx.activations = None
        return grad_canvas, grad_scale, grad_shift, grad_proj2, grad_norm2_weight, grad_norm2_bias


class PeripheralWeights(NamedTuple):
    """The parameters of one peripheral Φp, C = 4 * heads channels: the distance embedding w, the
    first projection PP1 and norm IN1, the second projection PP2 and norm IN2. The biases of w,
    PP1 and PP2 (the release has them) are optional: the norm after each removes them, and
    :func:`peripheral_log_attention` leaves them out."""
    distance_weight: torch.Tensor  # (C, 1)
    proj1_weight: torch.Tensor  # (C, C, 3, 3)
    norm1_weight: torch.Tensor  # (C,)
    norm1_bias: torch.Tensor  # (C,)
    proj2_weight: torch.Tensor  # (heads, C, 3, 3)
    norm2_weight: torch.Tensor  # (heads,) v: strength
    norm2_bias: torch.Tensor  # (heads,) s: size
    distance_bias: Optional[torch.Tensor] = None  # (C,)
    proj1_bias: Optional[torch.Tensor] = None  # (C,)
    proj2_bias: Optional[torch.Tensor] = None  # (heads,)


def _norm_affine(mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """An instance norm with affine (``weight``, ``bias``: (channels,)) over windows of the given
    channels-last ``mean`` and ``var``, as one affine per window: x -> scale * x + shift, float64."""
    scale = weight.double() * torch.rsqrt(var + NORM_EPS)
    return scale, bias.double() - scale * mean


def peripheral_log_attention(height: int, width: int, weights: PeripheralWeights) -> torch.Tensor:
    """log Φp for an H x W grid: (heads, H*W, H*W), indexed [head, query, key].

    PP1 runs once on the offset canvas, and IN1's window statistics come from the grid's cached
    moments (:func:`_grid_moments`), all in float64: Φp is ill-conditioned, and one-pass fp32
    statistics lose it. The canvas is centred per channel before it is cast, which IN1 cannot
    see but keeps the fp32 windows free of any large offset. The optional biases of ``weights``
    are not read: IN1 and IN2 remove them exactly.
    """
    w = weights
    dtype = w.proj1_weight.dtype
    shifted, means, covariances = _grid_moments(height, width, w.proj1_weight.device)
    proj1 = w.proj1_weight.double()
    kernel = torch.einsum('orhw,r->ohw', proj1, w.distance_weight.double()[:, 0]).flatten(1)
    canvas = shifted @ kernel.t()  # PP1, channels last: (2H+1, 2W+1, hidden)
    centre = canvas.mean((0, 1))
    mean = means @ kernel.t()  # (H, W, hidden) by window start
    var = ((covariances @ kernel.t()) * kernel.t()).sum(-2)  # (H, W, hidden)
    scale, shift = _norm_affine(mean - centre, var, w.norm1_weight, w.norm1_bias)
    return _LogPeripheralAttention.apply((canvas - centre).to(dtype), scale.to(dtype), shift.to(dtype),
                                         w.proj2_weight, w.norm2_weight, w.norm2_bias)



def _window_statistics(canvas: torch.Tensor, rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per channel mean and variance of every ``rows`` x ``cols`` window of a (channels, R, C)
    float64 canvas, channels last: each (R - rows + 1, C - cols + 1, channels), by window start."""
    mean = _box_means(canvas, rows, cols)
    var = (_box_means(canvas.square(), rows, cols) - mean.square()).clamp_min(0)
    return mean.permute(1, 2, 0), var.permute(1, 2, 0)


def design_log_attention(height: int, width: int, embedding: torch.Tensor, proj2_weight: torch.Tensor,
                         norm2_weight: torch.Tensor, norm2_bias: torch.Tensor,
                         proj1_weight: Optional[torch.Tensor] = None, norm1_weight: Optional[torch.Tensor] = None,
                         norm1_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log Φp of any design of Table 5 for an H x W grid: (heads, H*W, H*W), [head, query, key].

    ``embedding``: R at every key-minus-query offset with keys padded by the projections' total
    reach, (channels, 2H-1+2pad, 2W-1+2pad) float64 (:meth:`DistanceEmbedding.canvas`). With
    ``proj1_weight`` (ML), z = IN2(PP2(ReLU(IN1(PP1(R))))); without, z = IN2(PP2(R)). Each PP is a
    valid k x k convolution over the keys (k = 3 with the neighbourhood N, 1 without). As on the
    fast path, R depends only on the offset, so PP1 runs once on the offset canvas and IN1's
    window statistics are box sums of it (float64), and PP2 runs through the same kernel
    (:class:`_LogPeripheralAttention`); a single projection is a gather of its offset map.
    Autograd reaches the embedding and every parameter.
    """
    dtype = proj2_weight.dtype
    if proj1_weight is None:  # one projection: z = IN2(PP(R)) read from the (heads, 2H-1, 2W-1) offset map
        maps = F.conv2d(embedding[None], proj2_weight.double())[0]
        maps = maps - maps.mean((1, 2), keepdim=True)
        scale, shift = _norm_affine(*_window_statistics(maps, height, width), norm2_weight, norm2_bias)  # (H, W, heads)
        windows = _windows(maps.permute(1, 2, 0), height, width)  # (H, W, heads, H, W) by window start
        logits = torch.addcmul(shift[..., None, None].to(dtype), windows.to(dtype), scale[..., None, None].to(dtype))
        log_phi = F.logsigmoid(logits).flip(0, 1)  # window (a, b) is query (H-1-a, W-1-b)
        return log_phi.permute(2, 0, 1, 3, 4).reshape(-1, height * width, height * width)
    canvas = F.conv2d(embedding[None], proj1_weight.double())[0]  # PP1: (hidden, 2H-1+2p, 2W-1+2p)
    canvas = canvas - canvas.mean((1, 2), keepdim=True)
    reach = proj2_weight.shape[-1] - 1
    scale, shift = _norm_affine(*_window_statistics(canvas, height + reach, width + reach), norm1_weight,
                                norm1_bias)  # (H, W, hidden)
    return _LogPeripheralAttention.apply(*(t.to(dtype).contiguous() for t in (canvas.permute(1, 2, 0), scale, shift)),
                                         proj2_weight, norm2_weight, norm2_bias)

