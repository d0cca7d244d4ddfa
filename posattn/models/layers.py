"""The building blocks posattn's models share: stochastic depth, the transformer MLP, patch
embedding, and timm's conventions for choosing blocks."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from einops import rearrange
from torch import nn

from .registry import load_checkpoint

__all__ = ['ClassifierApi', 'DropPath', 'Mlp', 'PatchEmbed', 'take_indices']


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


def take_indices(num_blocks: int, indices: Optional[Union[int, Sequence[int]]] = None) -> List[int]:
    """The blocks that ``indices`` names, in block order (timm's ``forward_intermediates`` convention):
    None, every block; an int n, the last n; a sequence, those blocks (negative ones counted from
    the end)."""
    if indices is None:
        indices = num_blocks
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f'asked for the last {indices} blocks of {num_blocks}')
        return list(range(num_blocks - indices, num_blocks))
    resolved = sorted({int(i) + num_blocks if int(i) < 0 else int(i) for i in indices})
    if not resolved or not all(0 <= i < num_blocks for i in resolved):
        raise ValueError(f'block indices {list(indices)} are not in 0..{num_blocks - 1} (or -{num_blocks}..-1)')
    return resolved


class ClassifierApi:
    """timm's classifier API on a posattn model with ``head``, ``num_features``, ``num_classes``,
    ``global_pool`` (checked by its ``_checked_pool``) and ``grad_checkpointing``."""

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new classifier of ``num_classes`` outputs (0: none), and optionally a new pooling."""
        if global_pool is not None:
            self.global_pool = self._checked_pool(global_pool)
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    @torch.jit.ignore
    def load_pretrained(self, checkpoint_path: str) -> None:
        """Weights from a file, in any layout ``posattn.create_model`` reads; a classifier of another
        size is left out (with a warning). timm calls it for ``timm.create_model(name,
        pretrained=True, pretrained_cfg_overlay=dict(file=checkpoint_path))``."""
        load_checkpoint(self, checkpoint_path, target=type(self).__name__, classifier_may_differ=True)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of keeping its activations."""
        self.grad_checkpointing = enable
