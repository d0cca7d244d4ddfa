"""timm's model API on posattn's models, written once for the ViT and PerViT.

- :func:`resolve_block_indices`: block indices, negative ones counted from the end, checked; the
  one rule behind timm's ``indices`` (:func:`take_indices`) and OpenMMLab's ``out_indices``.
- :class:`ClassifierApi`: the classifier (``forward``, ``get_classifier``, ``reset_classifier``)
  and timm's pretrained-weights hook (``load_pretrained``).
- :class:`BlockStackApi`: the blocks, all on one token grid: the block loop (``iter_blocks``,
  gradient checkpointing), ``forward_features``, ``forward_intermediates`` and
  ``prune_intermediate_layers``.
- :class:`LayoutStackApi`: a block stack whose blocks take an :class:`~posattn.layout.ImageLayout`
  in place of the grid: a list of images of different sizes runs through it in one call.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint
from einops import rearrange
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..grid import TokenGrid
from ..layout import ImageLayout, run_by_size
from .registry import load_checkpoint

__all__ = ['BlockStackApi', 'ClassifierApi', 'LayoutStackApi', 'images_by_size', 'resolve_block_indices',
           'take_indices', 'tokens_as_map']

OUTPUT_FMTS = ('NCHW', 'NLC')
Intermediate = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def resolve_block_indices(indices: Sequence[int], num_blocks: int, name: str = 'indices') -> List[int]:
    """``indices`` of a stack of ``num_blocks`` blocks as indices in 0..num_blocks - 1, in the order
    given, repeats kept: a negative index counts from the end (-1 is the last block).

    Raises a ValueError, naming ``name`` (the argument they were passed as), when there are none
    or one is outside the stack.
    """
    resolved = [int(i) + num_blocks if int(i) < 0 else int(i) for i in indices]
    if not resolved or not all(0 <= i < num_blocks for i in resolved):
        shown = indices if isinstance(indices, (list, tuple)) else list(indices)
        raise ValueError(f'{name} {shown} must name blocks in 0..{num_blocks - 1} (or -{num_blocks}..-1)')
    return resolved


def take_indices(num_blocks: int, indices: Optional[Union[int, Sequence[int]]] = None) -> List[int]:
    """The blocks that ``indices`` names, in block order (timm's ``forward_intermediates`` convention):
    None, every block; an int n, the last n; a sequence, those blocks (negative ones counted from
    the end, :func:`resolve_block_indices`)."""
    if indices is None:
        indices = num_blocks
    if isinstance(indices, int):
        if not 0 < indices <= num_blocks:
            raise ValueError(f'asked for the last {indices} blocks of {num_blocks}')
        return list(range(num_blocks - indices, num_blocks))
    return sorted(set(resolve_block_indices(indices, num_blocks)))


def tokens_as_map(tokens: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
    """The grid tokens (B, h*w, C) of ``grid`` as a feature map (B, C, h, w)."""
    return rearrange(tokens, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)


def _intermediate(tokens: torch.Tensor, grid: TokenGrid, output_fmt: str, return_prefix_tokens: bool) -> Intermediate:
    """One block's tokens (B, prefix + h*w, C) as ``forward_intermediates`` returns them: the grid
    tokens as a map (B, C, h, w) for 'NCHW' or as they are (B, h*w, C) for 'NLC'; with
    ``return_prefix_tokens`` paired with the prefix tokens (B, prefix, C)."""
    prefix, spatial = tokens.split([grid.num_prefix_tokens, grid.num_grid_tokens], dim=1)
    if output_fmt == 'NCHW':
        spatial = tokens_as_map(spatial, grid)
    return (spatial, prefix) if return_prefix_tokens else spatial


def images_by_size(images: Sequence[torch.Tensor]) -> Dict[Tuple[int, ...], List[int]]:
    """The positions in ``images``, a list of images (C, H, W), of the images of each shape, shapes in
    the order they first appear; a TypeError or ValueError, as :func:`posattn.layout.run_by_size`
    gives, for anything but a non-empty list of such tensors."""
    if isinstance(images, torch.Tensor) or not len(images):
        raise TypeError('expected a list of images (C, H, W), one per image, of any sizes')
    if not all(isinstance(image, torch.Tensor) and image.dim() == 3 for image in images):
        shapes = [tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__ for image in images]
        raise ValueError(f'each image of a list must be a tensor (C, H, W), got {shapes}')
    by_size: Dict[Tuple[int, ...], List[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault(tuple(image.shape), []).append(index)
    return by_size


def _refuse_image_list(x: Any, method: str) -> None:
    """A TypeError naming what to do where ``method``, which returns features, is given a list of images."""
    if isinstance(x, (list, tuple)):
        raise TypeError(f'{method} takes one batch (B, C, H, W): features of images of different sizes do not '
                        'stack. Give the list to the model itself (logits), or call it on each size\'s batch '
                        '(torch.stack of the images of one size)')


class ClassifierApi:
    """timm's classifier API on a posattn model with ``head``, ``num_features``, ``num_classes``,
    ``global_pool`` (checked by its ``_checked_pool``), ``forward_features`` and ``forward_head``."""

    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        """Images (B, C, H, W) -> ``forward_head(forward_features(x))``: logits (B, num_classes).

        Or a list of images (C, H_i, W_i) of different sizes, each at its own resolution:
        :meth:`forward_image_list`."""
        if isinstance(x, (list, tuple)):
            return self.forward_image_list(x)
        return self.forward_head(self.forward_features(x))

    def forward_image_list(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Images (C, H_i, W_i) of different sizes -> logits (len(images), num_classes), each image's as
        the image alone gives them, in the list's order. Here the images of each size run as one
        batch (:func:`posattn.layout.run_by_size`); a :class:`LayoutStackApi` runs them all at once."""
        return run_by_size(self.forward, images)

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


class BlockStackApi:
    """timm's feature API on a model whose blocks all see one token grid (no downsampling between them).

    The model has ``blocks`` (an ``nn.ModuleList`` of blocks called as ``block(tokens, grid)``),
    ``norm`` (the final norm), ``grad_checkpointing`` and :class:`ClassifierApi`'s
    ``reset_classifier``, and supplies what differs between models:

    - ``embed_tokens(images)``: the first block's tokens (B, prefix + h*w, C) and their grid,
      which counts the prefix tokens;
    - ``_as_features(tokens, grid)``: the final normalised tokens as ``forward_features`` returns them;
    - ``_norm_intermediate(index, tokens)``: block ``index``'s output as ``norm=True`` returns it;
    - ``_after_block(index, tokens, grid)``: what runs between block ``index`` and the next one
      (nothing by default);
    - ``_keep_blocks(num_blocks)``: pruning to the first ``num_blocks`` blocks (and whatever
      belongs to them).
    """

    blocks: nn.ModuleList
    norm: nn.Module
    grad_checkpointing: bool

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in the backward pass instead of keeping its activations."""
        self.grad_checkpointing = enable

    def iter_blocks(self, x: torch.Tensor, grid: Union[TokenGrid, ImageLayout],
                    num_blocks: Optional[int] = None) -> Iterator[Tuple[int, torch.Tensor]]:
        """Runs the first ``num_blocks`` blocks (all by default) on tokens ``x`` (B, N, C) of
        ``grid`` (or, where the blocks take one, on images of different grids (B, L, C) placed by an
        :class:`~posattn.layout.ImageLayout`), each followed by ``_after_block``, yielding (block
        index, tokens) after each.
        With gradient checkpointing on and gradients enabled, each block (not ``_after_block``) is
        recomputed in the backward pass (``torch.utils.checkpoint``, non-reentrant)."""
        inputs = self._block_inputs()
        for i, block in enumerate(self.blocks[:num_blocks]):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, grid, use_reentrant=False, **inputs)
            else:
                x = block(x, grid, **inputs)
            x = self._after_block(i, x, grid)
            yield i, x

    def _block_inputs(self) -> Dict[str, Any]:
        """What every block is given besides its tokens and grid: the model's shared state, which its
        blocks pass on to their attention's Φp (PerViT's ``distance_embedding``); none by default."""
        return {}

    def _after_block(self, index: int, x: torch.Tensor, grid: Union[TokenGrid, ImageLayout]) -> torch.Tensor:
        return x

    def _keep_blocks(self, num_blocks: int) -> None:
        self.blocks = self.blocks[:num_blocks]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> the last block's output through the final norm (``_as_features``)."""
        _refuse_image_list(x, 'forward_features')
        x, grid = self.embed_tokens(x)
        for _, x in self.iter_blocks(x, grid):
            pass
        return self._as_features(self.norm(x), grid)

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, Sequence[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False):
        """The outputs of the blocks ``indices`` (timm's convention: None all, n the last n, or a
        list), in block order: (B, C_i, h, w) for ``output_fmt='NCHW'``, (B, h*w, C_i) for 'NLC',
        the prefix tokens left out; with ``norm``, as ``_norm_intermediate`` gives them.

        Returns the list alone with ``intermediates_only``, else (the final normalised features,
        laid out as ``forward_features`` gives them, and the list); ``stop_early`` runs no block
        after the last one asked for.
        """
        return self._forward_intermediates(x, indices, norm, stop_early, output_fmt, intermediates_only,
                                           return_prefix_tokens=False)

    def _forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, Sequence[int]]], norm: bool,
                               stop_early: bool, output_fmt: str, intermediates_only: bool,
                               return_prefix_tokens: bool):
        """``forward_intermediates``, each output paired with the block's prefix tokens (B, prefix, C)
        with ``return_prefix_tokens``."""
        _refuse_image_list(x, 'forward_intermediates')
        if output_fmt not in OUTPUT_FMTS:
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        wanted = take_indices(len(self.blocks), indices)
        x, grid = self.embed_tokens(x)
        last = wanted[-1] + 1 if stop_early or intermediates_only else None
        intermediates = []
        for i, x in self.iter_blocks(x, grid, num_blocks=last):
            if i in wanted:
                tokens = self._norm_intermediate(i, x) if norm else x
                intermediates.append(_intermediate(tokens, grid, output_fmt, return_prefix_tokens))
        return intermediates if intermediates_only else (self._as_features(self.norm(x), grid), intermediates)

    def prune_intermediate_layers(self, indices: Union[int, Sequence[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        """Drop the blocks after the last of ``indices`` (``_keep_blocks``), and optionally the final
        norm and the classifier (then ``forward_head`` passes its input through); returns the indices."""
        wanted = take_indices(len(self.blocks), indices)
        self._keep_blocks(wanted[-1] + 1)
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        return wanted


class LayoutStackApi(BlockStackApi):
    """A :class:`BlockStackApi` whose blocks take an :class:`~posattn.layout.ImageLayout` in place of
    the grid (``block(x, layout)``: per-token layers and :class:`posattn.Attention`, no convolution
    over the grid and no batch statistics inside a block), with ``_after_block`` taking one too.

    A list of images of different sizes then runs through the model in one call
    (:meth:`forward_image_list`). Besides :class:`BlockStackApi`'s, the model has
    ``num_prefix_tokens``, ``global_pool`` ('token': classify the first token, 'avg': the mean of the
    grid tokens, '': every token) and ``head``.
    """

    num_prefix_tokens: int
    global_pool: str
    head: nn.Module

    def forward_image_list(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Images (C, H_i, W_i) of different sizes -> logits (len(images), num_classes) in the list's
        order, each image's as the image alone gives them: the images of each size are embedded as
        one batch, then all of them run through the blocks in one call, one image a row padded at the
        end, and each row is pooled over its own image's tokens."""
        if self.global_pool not in ('token', 'avg'):
            raise ValueError(f"global_pool={self.global_pool!r} gives the head every token, and images of different "
                             "sizes have different token counts: pool them (global_pool='token' or 'avg', "
                             "reset_classifier), or call the model on each size's batch (B, C, H, W)")
        tokens, layout = self._layout_features(images)
        return self.head(self._pool_layout(tokens, layout))

    def _layout_features(self, images: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ImageLayout]:
        """Images (C, H_i, W_i) -> the final normalised tokens of all of them, one image a row, (I, L, C)
        with L the most tokens of an image, and their padded :class:`~posattn.layout.ImageLayout`.
        Row i holds image i's prefix tokens, then its grid row-major; what follows is padding, whose
        values are finite and mean nothing."""
        x, layout = self._embed_image_list(images)
        for _, x in self.iter_blocks(x, layout):
            pass
        return self.norm(x), layout

    def _embed_image_list(self, images: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ImageLayout]:
        """The first block's input of every image, (I, L, C) zero-padded at the end of each row, and the
        layout: the images of each size are embedded as one batch (``embed_tokens``)."""
        tokens: List[Optional[torch.Tensor]] = [None] * len(images)
        grids: List[Optional[TokenGrid]] = [None] * len(images)
        for indices in images_by_size(images).values():
            embedded, grid = self.embed_tokens(torch.stack([images[i] for i in indices]))  # (B_s, N_s, C)
            for i, image_tokens in zip(indices, embedded.unbind(0)):
                tokens[i], grids[i] = image_tokens, grid
        return pad_sequence(tokens, batch_first=True), ImageLayout.padded(grids, self.num_prefix_tokens)

    def _pool_layout(self, tokens: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        """(I, L, C) normalised rows of a padded layout -> (I, C): each row's first token ('token'), or
        the mean of its image's H_i * W_i grid tokens, the prefix tokens and padding left out ('avg')."""
        if self.global_pool == 'token':
            return tokens[:, 0]
        ends = torch.tensor([grid.num_tokens for grid in layout.grids], device=tokens.device)  # (I,)
        position = torch.arange(layout.length, device=tokens.device)  # (L,)
        on_grid = (position >= self.num_prefix_tokens) & (position < ends[:, None])  # (I, L)
        total = tokens.masked_fill(~on_grid[..., None], 0).sum(dim=1)  # (I, C)
        return total / (ends - self.num_prefix_tokens)[:, None].to(tokens.dtype)
