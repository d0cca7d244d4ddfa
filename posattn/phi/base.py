"""The Φp interface: what a positional module may contribute to multi-head attention.

Every positional module ("Φp", after PerViT's notation) is a function of the token grid that
touches attention in up to five places. Think of it like FlexAttention's ``score_mod``: one
interface, no special cases in the attention layer.

    x    <- tokens(x, grid)                       token mixing before qkv (PEG / CPE)
    q, k <- queries_keys(q, k, grid)              rotation of queries and keys (RoPE)
    A    =  softmax(q k^T / sqrt(d) + logits_bias(q, k, grid))
    A    <- mix_probabilities(A, grid, key_mask)  probabilities mixed with positional ones (ConViT's GPSA)
    out  =  A v + value_term(A, grid)             contextual terms on values (iRPE-V)

Each hook is a no-op by default, so a Φp overrides only what it contributes. The attention layer
calls the module itself for the logits bias (``phi(q, k, grid)``, whose ``forward`` is
``logits_bias``), so that its forward hooks and pre-hooks run (``torch.nn.utils.prune``, hooks
that observe or edit the bias). A Φp that gives no logits bias may make ``forward`` its own
contribution instead (PEG's is the token mixing, which ``tokens`` calls).
"""
from __future__ import annotations

from typing import Optional, Tuple

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
        bias_per_image: True when the logits bias depends on the tokens, (B, heads, N, N) rather
            than (1, heads, N, N): the layer's memory check counts it once per image.
        position_cache: the :class:`~posattn._cache.PositionCache` a token-independent bias may be
            served from, set by :func:`posattn.cache_positions` for the length of its block; None
            (no caching) otherwise.
    """
    uses_attention_probs: bool = False
    bias_per_image: bool = False
    position_cache: Optional[PositionCache] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        """The logits bias, :meth:`logits_bias`: the layer calls ``phi(q, k, grid)``, so hooks run."""
        return self.logits_bias(q, k, grid)

    def _overrides(self, hook: str) -> bool:
        return getattr(type(self), hook) is not getattr(PositionalModule, hook)

    @property
    def gives_logits_bias(self) -> bool:
        """Whether this Φp contributes a logits bias (overrides :meth:`logits_bias`)."""
        return self._overrides('logits_bias')

    @property
    def transforms_queries_keys(self) -> bool:
        """Whether this Φp changes the queries and keys (overrides :meth:`queries_keys`)."""
        return self._overrides('queries_keys')

    @property
    def mixes_probabilities(self) -> bool:
        """Whether this Φp changes the attention probabilities (overrides :meth:`mix_probabilities`),
        which needs them materialised (no fused kernel)."""
        return self._overrides('mix_probabilities')

    def tokens(self, x: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """Transform the layer's input tokens ``x`` (B, N, C) before the qkv projection."""
        return x

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor,
                     grid: TokenGrid) -> Tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys the logits are formed from, given the projected ones.

        Args:
            q, k: (B, heads, N, head_dim), after the layer's q/k norms, not yet scaled.
            grid: the layout of the N tokens.

        Returns:
            (q, k) of the same shapes and dtype; what the logits bias, the softmax and the analyses
            then see. A fused attention kernel still runs.
        """
        return q, k

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

    def mix_probabilities(self, attn: torch.Tensor, grid: TokenGrid,
                          key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention probabilities, given the content ones ``attn`` (B, heads, N, N), rows summing
        to 1 (0 for a query with no key left); ``key_mask``: None, or a bool (B, N), False for keys
        no query may attend to, which the result must leave at 0. Rows of the result sum to 1."""
        return attn

    def value_term(self, attn: torch.Tensor, grid: TokenGrid) -> Optional[torch.Tensor]:
        """Term added to ``attn @ v``, given the probabilities ``attn`` (B, heads, N, N)."""
        return None
