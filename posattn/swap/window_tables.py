"""What the Swin families share: attention inside windows with a relative position table.

Swin (Liu et al. 2021) attends within wh x ww windows, each its own sequence of N = wh * ww tokens:

    A = softmax(q k^T / sqrt(d) + B[index] + M) v

with ``B`` the learned relative position table ((2 wh - 1) * (2 ww - 1), heads), ``index`` the
(N, N) offsets into it, and ``M`` the shift mask of a shifted block (0 within a region of the
rolled map, -100 between regions that the roll brought into one window), which is not
positional and is always kept (the layer's ``attn_mask``). In a swapped model the Φp is evaluated
once on the wh x ww window grid and shared by every window of every image; ``B[index]`` stays
beside it, computed by the layer from the model's table and added by the first member of its Φp
(:class:`~posattn.swap.given.GivenBias`), unless the model's own positions are dropped. Zero-padded tokens at the bottom and right of the map take part as
keys, as in every Swin implementation (posattn's own windowed attention, :mod:`posattn.window`,
masks them instead).

``B[index]`` is what the ``rpb`` Φp computes on the window grid from the same table (its layout and
index are Swin's, and BEiT's with its three class-token entries): ``swap_attention(model,
phi='own')`` hands the table itself to an ``rpb`` (:func:`table_phi`), which then gives the model's
outputs; a resize by the model's own code still resizes it (:func:`resize_table`).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from einops import rearrange, repeat
from torch import nn

from ..grid import TokenGrid
from ..phi import PhiStack, PositionalModule
from ..phi.rpb import RelativePositionBias
from .core import AttentionSite, SwappedAttention
from .given import GivenBias

__all__ = ['WindowTableAttention', 'COSINE_ATTENTION', 'tables_of', 'table_phi', 'kept_table', 'resize_table']

COSINE_ATTENTION = ("Swin V2's cosine attention (normalised queries and keys times a learned logit scale, "
                    'with a position bias from a continuous MLP) is not the scaled dot product posattn computes')


def tables_of(sites: Sequence[AttentionSite]) -> List[nn.Parameter]:
    """The relative position tables of the window attentions at ``sites``."""
    return [site.module.relative_position_bias_table for site in sites]


def table_phi(site: AttentionSite, index: int) -> RelativePositionBias:
    """A plan's ``own.converted``: the ``rpb`` whose table is the attention's at ``site`` (the same Parameter,
    ``relative_position_bias_table``), learned for its ``window_size``, with BEiT's three extra rows
    where the site has prefix tokens (``index``, the site's place in depth order, changes nothing)."""
    attn = site.module
    return RelativePositionBias.of_table(attn.relative_position_bias_table, attn.window_size, site.num_prefix_tokens)


def kept_table(site: AttentionSite, index: int) -> List[PositionalModule]:
    """A plan's ``own.kept``: the bias ``B[index]`` that the swapped layer computes from the model's
    table (which stays the layer's, under the model's name), added as given."""
    return [GivenBias(RELATIVE_POSITION_BIAS)]


RELATIVE_POSITION_BIAS = 'relative_position_bias'  # the call input of a bias computed from the model's table


def resize_table(layer: SwappedAttention, model_resize: Callable[[SwappedAttention], None]) -> None:
    """``model_resize(layer)``: the model's own resize of the layer's table to a new window (timm's
    ``set_window_size``, which replaces the table by a new Parameter, interpolated as timm interpolates,
    and rebuilds the index), also after ``phi='own'``, when the table is the Φp's: it is lent back to
    the layer under the model's name for the resize, and the table the layer then holds goes to the
    Φp, learned for the layer's new ``window_size``. So the swapped model stays the model, resized."""
    holder = _table_holder(layer)
    if holder is not None:
        layer.relative_position_bias_table = holder.relative_position_bias_table
    model_resize(layer)
    if holder is not None:
        holder.set_table(layer.relative_position_bias_table, layer.window_size)
        layer.register_parameter('relative_position_bias_table', None)


def _table_holder(layer: SwappedAttention) -> Optional[RelativePositionBias]:
    """The ``rpb`` that holds the layer's table after ``phi='own'`` (the layer's Φp, or a member of its
    stack), or None where the layer holds its table itself."""
    if layer.relative_position_bias_table is not None or getattr(layer, 'window_size', None) is None:
        return None
    members = layer.phi.members if isinstance(layer.phi, PhiStack) else [layer.phi]
    return next(member for member in members if isinstance(member, RelativePositionBias)
                and member.relative_position_bias_table is not None)


class WindowTableAttention(SwappedAttention):
    """Called as timm's ``WindowAttention`` and the OpenMMLab ``WindowMSA`` are:
    ``attn(windows, mask=None)``, windows (B * num_windows, wh * ww, C), window-major within each
    image, ``mask`` the shift mask (num_windows, N, N) or None.

    State-dict names stay the model's: ``qkv``, ``proj``, ``relative_position_bias_table`` and
    ``relative_position_index`` (persistent where the model's was).
    """
    window_size: Tuple[int, int]

    def take_over(self, old: nn.Module) -> None:
        self.take(old, 'qkv', 'proj', 'attn_drop', 'proj_drop', 'relative_position_bias_table')
        self.take_index(old)

    def take_index(self, old: nn.Module) -> None:
        """The model's relative position index, its window size and the buffer's persistence."""
        persistent = 'relative_position_index' in old.state_dict(keep_vars=True)  # saved by the model
        self.register_buffer('relative_position_index', old.relative_position_index, persistent=persistent)
        self.window_size = tuple(old.window_size)

    def current_grid(self, *tensors: Optional[torch.Tensor]) -> TokenGrid:
        """Every window is one wh x ww grid, whatever the call."""
        return TokenGrid(*self.window_size)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """windows (B * num_windows, N, C) -> the layer's output (B * num_windows, N, C)."""
        bias = self.relative_position_bias() if self.reads(RELATIVE_POSITION_BIAS) else None
        return self.attention_output(x, attn_mask=self.shift_mask(x.shape[0], mask), relative_position_bias=bias)

    def relative_position_bias(self) -> torch.Tensor:
        """B[index]: (1, heads, N, N)."""
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]  # (N * N, heads)
        return rearrange(bias, '(n m) h -> 1 h n m', n=self.current_grid().num_tokens)

    @staticmethod
    def shift_mask(all_windows: int, shift_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The shift mask (num_windows, N, N) for every window of every image, (B * nW, 1, N, N), or
        None; ``all_windows`` = B * nW counts the windows of all images."""
        if shift_mask is None:
            return None
        images, left = divmod(all_windows, shift_mask.shape[0])
        if left:
            raise ValueError(f'got {all_windows} windows for a shift mask of {shift_mask.shape[0]} windows per image: '
                             'the mask has one (N, N) entry per window of an image, the windows come image by image')
        return repeat(shift_mask, 'w n m -> (b w) 1 n m', b=images)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, window_size={self.window_size}'
