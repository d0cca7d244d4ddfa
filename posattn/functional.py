"""Attention kernels: softmax(q k^T / sqrt(d) + bias) v with exact gradients for q, k, v and bias.

PyTorch's fused ``scaled_dot_product_attention`` (SDPA) takes an additive float mask, but on the
CPU a mask that requires grad sends it to the math backend, which materialises (B, heads, N, N)
several times (at N = 784, 444 ms / 247 MB against 173 ms / 17 MB without a mask).
:class:`_BiasedAttention` runs the fused forward with the bias detached and writes its own
backward, recomputing the probabilities in tiles of (batch, head, query rows), so memory stays
at one tile whatever B * heads * N^2 is, and the gradient of a batch-free (1, heads, N, N) bias is
summed over the batch as it is produced.

Both kernels take an optional boolean ``key_mask`` (B, N): keys marked False get logit -inf, so
zero weight, exactly (padding of windowed attention, :mod:`posattn.window`). A sequence with no
key left attends to nothing: its output is zero and its gradients are zero, on every path.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from ._compat import function_transform_active

__all__ = ['biased_attention', 'attention_probs', 'function_transforms_active']

# Logits per tile of the CPU backward (1 Mi floats, 4 MiB in fp32), and query rows per tile:
# measured on 2 cores, tiles this size run the backward 25% faster at N = 784 than whole rows.
_BLOCK_ELEMENTS = 1 << 20
_TILE_ROWS = 256


def function_transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) of the user's is tracing the current
    call (``torch.compile`` runs its own, which trace custom autograd functions fine)."""
    if torch.compiler.is_compiling():
        return False
    return function_transform_active()


def _check_bias(bias: Optional[torch.Tensor]) -> None:
    if bias is not None and bias.dtype == torch.bool:
        raise TypeError('bias is an additive float term of the logits; a bool tensor would add 0 or 1, '
                        'not mask. Pass which keys to attend to as key_mask, a bool (B, N) that is True '
                        'for keys to attend to')


def _key_mask_terms(key_mask: torch.Tensor, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A boolean key mask (B, N), True = attend, as (additive logits term (B, 1, 1, N) of 0 or -inf,
    whether each sequence keeps a key (B, 1, 1, 1)).

    A sequence whose keys are all masked attends to nothing: its mask is lifted here so that its
    softmax stays finite, and the caller zeroes its output, so its gradients are zero, not NaN.
    Nothing is checked on the host (no GPU synchronisation).
    """
    batch, _, tokens, _ = q.shape
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f'key_mask must be a bool tensor of shape (B, N) = ({batch}, {tokens}), got a '
                        f'{type(key_mask).__name__}: pass torch.tensor(mask, dtype=torch.bool)')
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, tokens):
        raise ValueError(f'key_mask must be a bool tensor of shape (B, N) = ({batch}, {tokens}), '
                         f'got {key_mask.dtype} of shape {tuple(key_mask.shape)}')
    key_mask = key_mask.to(q.device)
    has_key = key_mask.any(-1, keepdim=True)  # (B, 1)
    additive = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device)
    additive.masked_fill_(~(key_mask | ~has_key), float('-inf'))
    return additive[:, None, None, :], has_key[:, :, None, None]


def attention_probs(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor] = None,
                    key_mask: Optional[torch.Tensor] = None, *, keeps_a_key: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) over the keys ``key_mask`` keeps, materialised: (B, heads, N, N).

    Rows of a sequence with no key left are zero; ``keeps_a_key``: the caller knows that every
    sequence keeps a key, and the zeroing is skipped.
    """
    _check_bias(bias)
    logits = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias
    if key_mask is None:
        return logits.softmax(dim=-1)
    mask, has_key = _key_mask_terms(key_mask, q)
    probs = (logits + mask).softmax(dim=-1)
    return probs if keeps_a_key else probs.masked_fill(~has_key, 0.0)


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: Optional[torch.Tensor] = None,
                     key_mask: Optional[torch.Tensor] = None, *, keeps_a_key: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with an additive logits bias and an optional key mask.

    Args:
        q, k, v: (B, heads, N, d).
        bias: None or a tensor broadcastable to (B, heads, N, N) in q's dtype, e.g. a batch-free
            (1, heads, N, N) positional bias. It may require grad.
        key_mask: None or a bool (B, N), False for keys that get no weight (logit -inf). The CPU
            backward adds it per tile, so a batch-free bias keeps its (1, heads, N, N) gradient.
            A sequence with every key False gets a zero output.
        keeps_a_key: the caller knows that every sequence keeps a key (a layout's own padding mask),
            and the zeroing is skipped.

    Returns:
        (B, heads, N, d) = softmax(q k^T / sqrt(d) + bias + mask) v.
    """
    _check_bias(bias)
    if key_mask is None:
        return _biased_attention(q, k, v, bias, None)
    mask, has_key = _key_mask_terms(key_mask, q)
    out = _biased_attention(q, k, v, bias, mask)
    return out if keeps_a_key else out.masked_fill(~has_key, 0.0)


def _biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                      mask: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`biased_attention` with the key mask as an additive (B, 1, 1, N) term."""
    if function_transforms_active():  # torch.func traces plain operations only
        logits = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        for term in (bias, mask):
            logits = logits if term is None else logits + term
        return logits.softmax(dim=-1) @ v
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if bias.dim() > 4:
        raise ValueError(f'bias must have at most 4 dims (B, heads, N, N), got shape {tuple(bias.shape)}')
    bias = bias.to(q.dtype).reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if bias.requires_grad and q.device.type == 'cpu' and torch.is_grad_enabled():
        return _BiasedAttention.apply(q, k, v, bias, mask)
    # CUDA: SDPA's memory-efficient backend takes an additive bias and returns its gradient.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias if mask is None else bias + mask)


def _tiles(batch: int, heads: int, tokens: int) -> Iterator[Tuple[slice, slice, slice]]:
    """(batch, head, query-row) slices covering B x heads x N, each about ``_BLOCK_ELEMENTS`` logits.

    Query rows are tiled so that the (pairs, rows, N) intermediates stay in cache at large N.
    """
    rows = min(tokens, _TILE_ROWS)
    pairs = max(_BLOCK_ELEMENTS // (rows * tokens), 1)
    for r0 in range(0, tokens, rows):
        row_slice = slice(r0, min(r0 + rows, tokens))
        if heads <= pairs:
            step = pairs // heads
            for b0 in range(0, batch, step):
                yield slice(b0, min(b0 + step, batch)), slice(0, heads), row_slice
        else:
            for b in range(batch):
                for h0 in range(0, heads, pairs):
                    yield slice(b, b + 1), slice(h0, min(h0 + pairs, heads)), row_slice


def _bias_slice(bias: torch.Tensor, batch: slice, heads: slice, rows: slice) -> Tuple[slice, slice, slice]:
    """The part of a broadcast bias that a (batch, heads, rows) tile reads."""
    return ((batch if bias.shape[0] > 1 else slice(None)), (heads if bias.shape[1] > 1 else slice(None)),
            (rows if bias.shape[2] > 1 else slice(None)))


class _BiasedAttention(torch.autograd.Function):
    """Fused forward, tiled recomputing backward (FlashAttention's backward in matmuls).

    With P = softmax(S), S = q k^T / sqrt(d) + bias and upstream gradient dO:
        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),
        dQ = dS K / sqrt(d),   dK = dS^T Q / sqrt(d),   dbias = dS summed over broadcast dims.
    ``mask``: None or a constant (B, 1, 1, N) term (:func:`_key_mask_terms`) added to S.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, mask):
        logits_term = bias.detach() if mask is None else bias.detach() + mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=logits_term)
        ctx.save_for_backward(q, k, v, bias, mask, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, mask, out = ctx.saved_tensors
        need_q, need_k, need_v, need_bias, _ = ctx.needs_input_grad
        batch, heads, tokens, head_dim = q.shape
        scale = head_dim ** -0.5
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)  # (B, heads, N, 1)
        scaled_q = q * scale
        grad_q = torch.empty_like(q) if need_q else None
        grad_k = torch.zeros_like(k) if need_k else None
        grad_v = torch.zeros_like(v) if need_v else None
        # a bias of every (image, head) gets each tile's gradient as it is: written, never summed
        whole_bias = tuple(bias.shape) == (batch, heads, tokens, tokens)
        grad_bias = None if not need_bias else torch.empty_like(bias) if whole_bias else torch.zeros_like(bias)
        for bs, hs, rs in _tiles(batch, heads, tokens):
            qb, kb, vb, gob = scaled_q[bs, hs, rs], k[bs, hs], v[bs, hs], grad_out[bs, hs, rs]
            bias_index = _bias_slice(bias, bs, hs, rs)
            logits = (qb @ kb.transpose(-2, -1)).add_(bias[bias_index])
            if mask is not None:
                logits.add_(mask[bs])
            probs = logits.softmax(dim=-1)
            del logits  # one tile of logits alive at a time
            if need_v:
                grad_v[bs, hs] += probs.transpose(-2, -1) @ gob
            grad_logits = gob @ vb.transpose(-2, -1)  # dP
            grad_logits.sub_(delta[bs, hs, rs]).mul_(probs)  # dS
            del probs
            if need_bias and whole_bias:
                grad_bias[bias_index] = grad_logits
            elif need_bias:
                grad_bias[bias_index] += grad_logits.sum_to_size(grad_bias[bias_index].shape)
            if need_q:
                grad_q[bs, hs, rs] = (grad_logits @ kb).mul_(scale)
            if need_k:
                grad_k[bs, hs] += grad_logits.transpose(-2, -1) @ qb
        return grad_q, grad_k, grad_v, grad_bias, None
