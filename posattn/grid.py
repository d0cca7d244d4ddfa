"""Token-grid geometry: which tokens of a sequence form the H x W image grid.

A sequence is ``num_prefix_tokens`` extra tokens (class, distillation; timm's name) followed by
the H x W grid in row-major order, so ``N = num_prefix_tokens + H * W``. Every layer checks its
input against a :class:`TokenGrid` and fails with a message that says what it expected, rather
than guessing ``H = W = sqrt(N)``.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ['TokenGrid', 'GridLike', 'is_integer']


def _plural(count: int, noun: str) -> str:
    return f'{count} {noun}' + ('' if count == 1 else 's')


def is_integer(value: Any) -> bool:
    """An int (Python's, numpy's or a compiler's symbolic one), not a bool."""
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def _as_integer(value: Any, name: str) -> int:
    """``value`` as an int when it is an integer or a 0-dim integer tensor; a TypeError otherwise."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        return int(value)
    if is_integer(value):
        return value if isinstance(value, (int, torch.SymInt)) else int(value)
    raise TypeError(f'{name} must be an integer, got {value!r}')


@dataclass(frozen=True)
class TokenGrid:
    """Layout of a token sequence.

    Args:
        height: grid rows H (>= 1).
        width: grid columns W (>= 1).
        num_prefix_tokens: extra tokens before the grid (>= 0).
    """
    height: int
    width: int
    num_prefix_tokens: int = 0

    def __post_init__(self):
        for name in ('height', 'width', 'num_prefix_tokens'):
            object.__setattr__(self, name, _as_integer(getattr(self, name), f'TokenGrid.{name}'))
        if self.height < 1 or self.width < 1:
            raise ValueError(
                f'empty grid {self.height}x{self.width}: height and width must be at least 1')
        if self.num_prefix_tokens < 0:
            raise ValueError(f'num_prefix_tokens must be >= 0, got {self.num_prefix_tokens}')

    @classmethod
    def of(cls, hw: 'GridLike', num_prefix_tokens: int = 0) -> 'TokenGrid':
        """A grid from ``(H, W)`` and a prefix count, or a :class:`TokenGrid` (whose count must agree)."""
        if isinstance(hw, TokenGrid):
            if hw.num_prefix_tokens != num_prefix_tokens:
                raise ValueError(
                    f'{hw} does not match this layer, which has '
                    f'{_plural(num_prefix_tokens, "extra token")}')
            return hw
        if isinstance(hw, (str, bytes)):
            raise TypeError(f'hw must be a (height, width) pair, got {hw!r}')
        try:
            height, width = hw
        except (TypeError, ValueError):
            raise TypeError(f'hw must be a (height, width) pair, got {hw!r}') from None
        return cls(_as_integer(height, 'the height in hw'), _as_integer(width, 'the width in hw'),
                   num_prefix_tokens)

    @property
    def num_grid_tokens(self) -> int:
        return self.height * self.width

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_grid_tokens

    def positions(self, device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(row, column) of every grid token, each (H*W,) int64 in row-major order."""
        rows = torch.arange(self.height, device=device).repeat_interleave(self.width)
        cols = torch.arange(self.width, device=device).repeat(self.height)
        return rows, cols

    def pad_prefix(self, grid_bias: torch.Tensor) -> torch.Tensor:
        """A bias over grid pairs (..., H*W, H*W) as one over all pairs (..., N, N): zero wherever a
        prefix token is the query or the key."""
        prefix = self.num_prefix_tokens
        return F.pad(grid_bias, (prefix, 0, prefix, 0)) if prefix else grid_bias

    def check_num_tokens(self, num_tokens: int) -> None:
        """Raise a ValueError naming the expected count when ``num_tokens`` does not fit the grid."""
        if num_tokens != self.num_tokens:
            raise ValueError(f'got {num_tokens} tokens for a {self}; expected {self.num_tokens}')

    def __str__(self) -> str:
        return f'{self.height}x{self.width} grid with {_plural(self.num_prefix_tokens, "extra token")}'


GridLike = Union[TokenGrid, Sequence[int]]
