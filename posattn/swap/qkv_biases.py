"""The q/k/v projection of BEiT and EVA: a bias-free fused ``qkv`` with separate learned query and
value biases (``q_bias``, ``v_bias``) and keys without one (``k_bias``, a zero buffer), or, in
EVA's unfused form, three projections ``q_proj``, ``k_proj``, ``v_proj``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .core import SwappedAttention

__all__ = ['SeparateBiasQkv']


class SeparateBiasQkv(SwappedAttention):
    """A swapped attention whose q/k/v come as BEiT's and EVA's do, under their state-dict names."""

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'attn_drop', 'proj_drop')
        for name in ('q_bias', 'v_bias', 'q_proj', 'k_proj', 'v_proj'):
            setattr(self, name, getattr(old, name, None))
        self.register_buffer('k_bias', getattr(old, 'k_bias', None), persistent=False)
        self.qkv_bias_separate = getattr(old, 'qkv_bias_separate', False)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B, N, 3 * heads * d), laid out as a fused qkv (three, heads, d)."""
        if self.qkv is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_bias is None:
            return self.qkv(x)
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        return self.qkv(x) + bias if self.qkv_bias_separate else F.linear(x, self.qkv.weight, bias)
