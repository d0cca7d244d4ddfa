"""The building blocks posattn's models share: stochastic depth, the transformer MLP, patch
embedding, and the initialisation of their Linear layers."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from einops import rearrange
from torch import nn

from ..phi import PositionalModule

__all__ = ['DropPath', 'Mlp', 'PatchEmbed', 'init_linear_layers']


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): drop a sample's residual branch with probability p."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob}'


class Mlp(nn.Module):
    """fc2(drop(GELU(fc1(x)))), then dropout; fc2 maps to ``out_dim`` (default ``dim``)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, out_dim: Optional[int] = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class PatchEmbed(nn.Module):
    """Non-overlapping patches: a stride-``patch_size`` convolution, (B, C, H, W) -> tokens and grid.

    Inputs whose sides are not multiples of the patch size are rejected rather than cropped.
    """

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        height, width = x.shape[-2:]
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(f'input of {height}x{width} pixels does not split into {self.patch_size}-pixel '
                             f'patches; resize or pad it to a multiple of {self.patch_size}')
        x = self.proj(x)
        return rearrange(x, 'b c h w -> b (h w) c'), (x.shape[-2], x.shape[-1])


def init_linear_layers(module: nn.Module) -> None:
    """timm's ViT initialisation and the PerViT release's, for every Linear of ``module`` outside a
    Φp: weight truncated normal (std 0.02), bias zero, drawn in module order. A Φp's own
    initialisation (zero iRPE tables, PerViT's per-layer norms) is part of its definition and is
    left as it is; convolutions and norms keep PyTorch's defaults."""
    for child in module.children():
        if isinstance(child, PositionalModule):
            continue
        if isinstance(child, nn.Linear):
            nn.init.trunc_normal_(child.weight, std=0.02)
            if child.bias is not None:
                nn.init.zeros_(child.bias)
        else:
            init_linear_layers(child)
