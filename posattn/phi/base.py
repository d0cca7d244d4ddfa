"""The Φp interface: what a positional module may contribute to multi-head attention.

Every positional module ("Φp", after PerViT's notation) is a function of the token grid that
touches attention in up to three places. Think of it like FlexAttention's ``score_mod``: one
interface, no special cases in the attention layer.

    x    <- tokens(x, grid)                       token mixing before qkv (PEG / CPE)
    A    =  softmax(q k^T / sqrt(d) + logits_bias(q, k, grid))
    out  =  A v + value_term(A, grid)             contextual terms on values (iRPE-V)

Each hook is a no-op by default, so a Φp overrides only what it contributes. The attention layer
calls the module itself for the logits bias (``phi(q, k, grid)``, whose ``forward`` is
``logits_bias``), so that its forward hooks and pre-hooks run (``torch.nn.utils.prune``, hooks
that observe or edit the bias). A Φp that gives no logits bias may make ``forward`` its own
contribution instead (PEG's is the token mixing, which ``tokens`` calls).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._cache import PositionCache
from ..grid import TokenGrid

__all__ = ['PositionalModule']


class PositionalModule(nn.Module):
    """Base class of every Φp; subclasses register with :func:`posattn.register_phi`.

    Class attributes:
        uses_attention_probs: True when :meth:`value_term` contributes, which needs the
            attention probabilities materialised (no fused kernel).
        position_cache: the :class:`~posattn._cache.PositionCache` a token-independent bias may be
            served from, set by :func:`posattn.cache_positions` for the length of its block; None
            (no caching) otherwise.
    """
    uses_attention_probs: bool = False
    position_cache: Optional[PositionCache] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        """The logits bias, :meth:`logits_bias`: the layer calls ``phi(q, k, grid)``, so hooks run."""
        return self.logits_bias(q, k, grid)

    @property
    def gives_logits_bias(self) -> bool:
        """Whether this Φp contributes a logits bias (overrides :meth:`logits_bias`)."""
        return type(self).logits_bias is not PositionalModule.logits_bias

    def tokens(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """Transform the layer's input tokens ``x`` (B, N, C) before the qkv projection."""
        return x

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor,
                    grid: TokenGrid) -> Optional[torch.Tensor]:
        """Additive bias on the attention logits.

        Args:
            q, k: (B, heads, N, head_dim), not yet scaled by head_dim ** -0.5.
            grid: the layout of the N tokens.

        Returns:
            None, or a tensor broadcastable to (B, heads, N, N) in q's dtype: (1, heads, N, N)
            for a content-independent bias, which lets kernels sum its gradient over the batch.
        """
        return None

    def value_term(self, attn: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        """Term added to ``attn @ v``, given the probabilities ``attn`` (B, heads, N, N)."""
        return None
