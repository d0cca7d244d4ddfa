"""A swapped model's own positional terms, computed each call, as Φp that own nothing.

Some models compute a positional term once per call and hand it to every block: timm's Eva its
rotary embedding (``rope=``), BEiT its shared relative position bias (``shared_rel_pos_bias=``),
VisionTransformerRelPos its shared bias. Others compute it in the attention from parameters the
attention holds: Swin's and BEiT's per-block tables, RelPos's bias, SAM's RoPE. The swapped layer
keeps those parameters under the model's names and offers the term with the call; these Φp apply
it as the model did, first in the layer's :class:`~posattn.phi.PhiStack`, beside any other Φp.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..grid import TokenGrid
from ..phi import PositionalModule
from .core import imported

__all__ = ['GivenBias', 'GivenRotation', 'rotate_grid_tokens']


class GivenBias(PositionalModule):
    """A logits bias given with each call as ``name`` (broadcastable to (B, heads, N, N)), added as it
    is: the bias the model computed (BEiT's shared table's, RelPos's)."""

    def __init__(self, name: str):
        super().__init__(hooks=('logits_bias',), call_inputs=(name,))
        self.name = name

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid, **given: Any) -> torch.Tensor:
        bias = given[self.name]
        if bias is None:
            raise ValueError(f'this layer adds its model\'s own positional bias, which the model gives with each call '
                             f'({self.name}=); it was called without one: run the whole model')
        return bias.to(q.dtype)

    def settings(self) -> Dict[str, Any]:
        return {'name': self.name}


def rotate_grid_tokens(t: torch.Tensor, rope: torch.Tensor, num_prefix_tokens: int, half: bool) -> torch.Tensor:
    """A timm RoPE ``rope`` (sin and cos of the grid, timm's layout) on the grid tokens of t (B, heads,
    N, d), by timm's ``apply_rot_embed_cat``; the prefix tokens stay as they are."""
    apply_rot_embed_cat = imported('timm.layers', 'apply_rot_embed_cat')
    prefix, tokens = t.split([num_prefix_tokens, t.shape[2] - num_prefix_tokens], dim=2)
    return torch.cat([prefix, apply_rot_embed_cat(tokens, rope, half=half)], dim=2)


class GivenRotation(PositionalModule):
    """The queries and keys of the grid tokens rotated by a timm RoPE given with each call as ``rope``
    (EVA's, which its model gives every block; SAM's, which its attention computes), as timm rotates
    them; they keep their dtype.

    Args:
        num_prefix_tokens: tokens before the grid, which are not rotated.
        rotate_half: timm's pairing of the channels (``rope_rotate_half``).
    """

    def __init__(self, num_prefix_tokens: int = 0, rotate_half: bool = False):
        super().__init__(hooks=('queries_keys',), call_inputs=('rope',))
        self.num_prefix_tokens, self.rotate_half = num_prefix_tokens, rotate_half

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid,
                     rope: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if rope is None:
            raise ValueError('this layer applies its model\'s RoPE, which the model gives with each call (rope=); it '
                             'was called without one: run the whole model')
        return tuple(rotate_grid_tokens(t, rope, self.num_prefix_tokens, self.rotate_half).to(t.dtype) for t in (q, k))

    def settings(self) -> Dict[str, Any]:
        return {'num_prefix_tokens': self.num_prefix_tokens, 'rotate_half': self.rotate_half}
