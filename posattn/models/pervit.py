"""PerViT: Peripheral Vision Transformer (Min et al., NeurIPS 2022), Tiny / Small / Medium.

The layout of the authors' release (paper Appendix E, Table A5), with posattn's parameter names
(``posattn.convert.pervit_from_release`` maps a release checkpoint):

    stem    4 x [3x3 conv stride 2 -> BatchNorm -> ReLU], 1x1 conv       (B, 3, H, W) -> (B, C0, H/16, W/16)
    blocks  12 in 4 stages [2, 2, 6, 2], one token grid throughout (columnar, no downsampling):
              x = x + DropPath(MPA(LN1(CPE(x))))
              x = res(x) + DropPath(MLP(LN2(x)))
            CPE: 3x3 depthwise conv on the attention branch only; MPA: Multi-head Peripheral
            Attention, softmax(q k^T / sqrt(d) + log Φp) v (Eq. 5); at the last block of stages 1-3
            ``res`` is a Linear to the next stage's width and the MLP's fc2 outputs that width.
    head    LayerNorm -> mean over tokens -> Linear

Every layer's Φp (:class:`~posattn.phi.peripheral.PeripheralPhi`) reads one distance embedding
owned by the model, and starts from the release's initialisation over all 12 layers (early
layers local, late ones near uniform). Φp depends only on the token grid, so any input the stem
accepts works, square or not: the grid is ceil(H/16) x ceil(W/16) and each Φp is evaluated on it
(recomputed once per forward while training, cached per grid at eval).

High resolution (detection, segmentation; ViTDet's recipe, Li et al. 2022): with ``window_size``
the blocks attend within non-overlapping ws x ws windows (:class:`posattn.window.GridWindows`,
padding masked exactly), their Φp evaluated once on the ws x ws window grid and shared by every
window and image, and the ``global_blocks`` attend over the whole grid. The CPE convolution,
norms and MLP always see the whole grid.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterator, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ..attention import Attention
from ..grid import TokenGrid
from ..phi.peg import PositionEncodingGenerator
from ..phi.none import NoPosition
from ..phi.peripheral import EMBEDDINGS, PeripheralPhi, random_init_
from ..window import GridWindows
from .blocks import DropPath, Mlp, init_linear_layers
from .model_api import BlockStackApi, ClassifierApi, images_by_size, tokens_as_map
from .registry import create_from_arch, register_model

__all__ = ['PerViT', 'PerViTBlock', 'ConvStem', 'PatchStem', 'PERVIT_ARCHS', 'pervit_tiny', 'pervit_small',
           'pervit_medium']

# Sizes by arch (paper Table A5): heads, channels and blocks per stage, conv-stem channels. The
# release's Small stem ends at 272; the table's 262 is a typo (the 1x1 conv maps 272 -> 272).
PERVIT_ARCHS = {
    'tiny': dict(num_heads=4, embed_dims=(128, 192, 224, 280), depths=(2, 2, 6, 2), stem_dims=(48, 64, 96, 128)),
    'small': dict(num_heads=8, embed_dims=(272, 320, 368, 464), depths=(2, 2, 6, 2), stem_dims=(64, 128, 192, 272)),
    'medium': dict(num_heads=12, embed_dims=(312, 468, 540, 684), depths=(2, 2, 6, 2),
                   stem_dims=(64, 192, 256, 312)),
}


STEMS = ('conv', 'patch')  # ConvStem, PatchStem


class ConvStem(nn.Module):
    """Convolutional patch embedding (Xiao et al. 2021, "Early convolutions help transformers see better").

    Each 3x3 stride-2 convolution (padding 1) maps a side of n pixels to ceil(n / 2), so the grid
    is ceil(H / 2^k) x ceil(W / 2^k) for k = ``len(dims)`` layers; inputs with a side shorter than
    2^k pixels are refused (they would give a grid whose tokens see mostly padding).

    Args:
        in_chans: image channels.
        dims: output channels of the 3x3 conv-BN-ReLU layers.
        embed_dim: token channels, from the final 1x1 convolution.
    """

    def __init__(self, in_chans: int, dims: Sequence[int], embed_dim: int):
        super().__init__()
        self.in_chans = in_chans
        self.stride = 2 ** len(dims)
        self.layers = nn.Sequential(*[
            nn.Sequential(OrderedDict(conv=nn.Conv2d(c_in, c_out, 3, 2, 1), norm=nn.BatchNorm2d(c_out),
                                      act=nn.ReLU(inplace=True)))
            for c_in, c_out in zip((in_chans, *dims[:-1]), dims)])
        self.proj = nn.Conv2d(dims[-1], embed_dim, 1)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, TokenGrid]:
        """Images (B, in_chans, H, W) -> tokens (B, h*w, embed_dim) and their h x w grid."""
        if x.dim() != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f'expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}'
                             + ('; convert them to RGB (e.g. repeat a grey channel 3 times)'
                                if x.dim() == 4 and self.in_chans == 3 else ''))
        height, width = x.shape[-2:]
        if height < self.stride or width < self.stride:
            raise ValueError(f'input of {height}x{width} pixels is too small for the stem, which '
                             f'downsamples by {self.stride}: each side needs at least {self.stride} pixels')
        x = self.proj(self.layers(x))
        return rearrange(x, 'b c h w -> b (h w) c'), TokenGrid(x.shape[-2], x.shape[-1])


class PatchStem(nn.Module):
    """A plain patch embedding (ViT, DeiT): one 16x16 stride-16 convolution, the stem of the
    paper's ablation rows without the C-stem (Table 1 (d), (f), (h), (i)).

    Images are zero-padded on the right and bottom to a multiple of 16, so that the grid is
    ceil(H / 16) x ceil(W / 16), as with :class:`ConvStem`.
    """

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int = 16):
        super().__init__()
        self.in_chans = in_chans
        self.stride = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, TokenGrid]:
        """Images (B, in_chans, H, W) -> tokens (B, h*w, embed_dim) and their h x w grid."""
        if x.dim() != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f'expected images (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}')
        height, width = x.shape[-2:]
        x = F.pad(x, (0, -width % self.stride, 0, -height % self.stride))
        x = self.proj(x)
        return rearrange(x, 'b c h w -> b (h w) c'), TokenGrid(x.shape[-2], x.shape[-1])


class PerViTBlock(nn.Module):
    """x = x + DropPath(MPA(LN1(CPE(x)))), then x = res(x) + DropPath(MLP(LN2(x))) (the release's block).

    Args:
        dim: token channels in.
        out_dim: token channels out; a different width adds the ``res`` Linear on the residual.
        num_heads: attention heads.
        phi: this layer's Φp: peripheral, or :class:`~posattn.phi.none.NoPosition` (plain MHSA).
        drop_path: stochastic depth rate of both branches.
        window_size: None attends over the whole grid; ws attends within ws x ws windows, with Φp
            of the ws x ws grid.
        cpe: the CPE convolution on the attention branch; False passes the tokens unchanged.
        content: the content term q k^T of the attention; False attends by Φp alone.

    The MLP is 4 * ``dim`` wide (DeiT's ratio, the release's).
    """

    def __init__(self, dim: int, out_dim: int, num_heads: int, phi: Union[PeripheralPhi, NoPosition],
                 drop_path: float = 0.0, window_size: Optional[int] = None, cpe: bool = True,
                 content: bool = True):
        super().__init__()
        self.window_size = window_size
        self.cpe = PositionEncodingGenerator(dim, residual=False) if cpe else NoPosition()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, phi=phi, qkv_bias=False, content=content)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim, out_dim=out_dim)
        self.drop_path2 = DropPath(drop_path)
        self.res = nn.Linear(dim, out_dim) if out_dim != dim else nn.Identity()

    def forward(self, x: torch.Tensor, grid: TokenGrid, **phi_inputs: Any) -> torch.Tensor:
        """x: (B, H*W, dim) on ``grid`` -> (B, H*W, out_dim); ``phi_inputs``: the model's shared state
        (its ``distance_embedding``), passed on where the attention's Φp reads it."""
        x = x + self.drop_path1(self._attend(self.norm1(self.cpe.tokens(x, grid)), grid, phi_inputs))
        return self.res(x) + self.drop_path2(self.mlp(self.norm2(x)))

    def _attend(self, x: torch.Tensor, grid: TokenGrid, phi_inputs: Dict[str, Any]) -> torch.Tensor:
        phi_inputs = self.attn.taking(phi_inputs)
        if self.window_size is None:
            return self.attn(x, grid, **phi_inputs)
        windows = GridWindows(grid, self.window_size)
        out = self.attn(windows.partition(x), windows.window_grid, windows.key_mask(x.shape[0], x.device), **phi_inputs)
        return windows.merge(out)  # (B, H*W, dim)

    def extra_repr(self) -> str:
        return f'window_size={self.window_size}'


class PerViT(ClassifierApi, BlockStackApi, nn.Module):
    """Peripheral Vision Transformer: conv stem, columnar blocks with peripheral attention, GAP head.

    Args:
        embed_dims: token channels of each stage.
        depths: blocks per stage.
        num_heads: attention heads in every block (head width = stage width / heads).
        stem_dims: channels of the stem's 3x3 conv layers.
        in_chans: image channels.
        num_classes: classifier outputs; 0 for no head (``forward`` returns pooled features).
        drop_path_rate: stochastic depth, rising linearly from 0 over all blocks to this rate
            (paper: 0.0 / 0.1 / 0.2 for T / S / M).
        window_size: None (the release) attends over the whole grid in every block; ws attends
            within ws x ws windows in every block but the ``global_blocks`` (e.g. 14, the
            ImageNet grid, so that windows see the Φp they were trained with).
        global_blocks: indices of the blocks that attend over the whole grid when windowed
            (e.g. (3, 7, 11), one per quarter as in ViTDet).
        global_pool: 'avg' (the release's mean over tokens) or '' (no pooling: the head sees the
            (B, C, h, w) map, timm's convention).

    The paper's ablations (docs/models.md lists each table row and its arguments); the defaults
    build PerViT itself:
        phi: 'peripheral' (Φp) or 'none' (plain MHSA, no position-based attention: Table 1 (b)).
        phi_init: initialisation of every layer's Φp, 'peripheral', 'conv' or 'rand'
            (:data:`posattn.phi.peripheral.PHI_INITS`; Table 5, top).
        phi_trainable: False freezes every Φp and the distance embedding at their
            initialisation (supplement Tab. A3).
        stem: 'conv' (the convolutional stem, C-stem) or 'patch' (a 16x16 patch embedding,
            :class:`PatchStem`: Table 1 (d)).
        cpe: the CPE convolution before every attention layer (False: Table 1 (e)).
        content: the content-based attention Φc, softmax(q k^T / sqrt(d)); False attends by
            Φp alone, softmax(log Φp) v, and projects only values (Table 1 (c)).
        phi_embedding, phi_neighbourhood, phi_multi_layer: the design of every Φp (Table 5,
            bottom): the embedding R, 'euc' or 'lrn' (one per model either way), the 3x3
            neighbourhood N of its projections (False: 1x1) and its multi-layer design ML
            (False: one projection); :class:`~posattn.phi.peripheral.PeripheralPhi`.

    A list of images of different sizes runs as one batch per size (the stem's BatchNorm and the
    CPE convolutions see each size's images as a batch). While a BatchNorm normalises by the
    batch's statistics (training mode), every size of a list must hold at least
    :attr:`min_images_per_size` images.
    """

    #: The fewest images of one size a list may hold while a BatchNorm of the model is in training
    #: mode: the statistics of fewer are not a batch's (of one image, a single image's).
    min_images_per_size = 8

    def __init__(self, embed_dims: Sequence[int] = (128, 192, 224, 280), depths: Sequence[int] = (2, 2, 6, 2),
                 num_heads: int = 4, stem_dims: Sequence[int] = (48, 64, 96, 128), in_chans: int = 3,
                 num_classes: int = 1000, drop_path_rate: float = 0.0, window_size: Optional[int] = None,
                 global_blocks: Sequence[int] = (), global_pool: str = 'avg', phi: str = 'peripheral',
                 phi_init: str = 'peripheral', phi_trainable: bool = True, stem: str = 'conv', cpe: bool = True,
                 content: bool = True, phi_embedding: str = 'euc', phi_neighbourhood: bool = True,
                 phi_multi_layer: bool = True):
        super().__init__()
        if phi not in ('peripheral', 'none'):
            raise ValueError(f"PerViT's phi is 'peripheral' or 'none', got {phi!r}")
        if phi == 'none' and not content:
            raise ValueError("content=False attends by Φp alone; with phi='none' there is nothing to attend by")
        design = dict(embedding=phi_embedding, neighbourhood=phi_neighbourhood, multi_layer=phi_multi_layer)
        if phi == 'none' and (phi_init != 'peripheral' or not phi_trainable
                              or design != dict(embedding='euc', neighbourhood=True, multi_layer=True)):
            raise ValueError(f"phi_init={phi_init!r}, phi_trainable={phi_trainable} and the Φp design {design} "
                             "set up a peripheral Φp; with phi='none' there is none")
        if phi_embedding not in EMBEDDINGS:
            raise ValueError(f'unknown phi_embedding {phi_embedding!r}; choose one of {sorted(EMBEDDINGS)}')
        if stem not in STEMS:
            raise ValueError(f'unknown stem {stem!r}; choose one of {sorted(STEMS)}')
        if len(embed_dims) != len(depths):
            raise ValueError(f'{len(embed_dims)} stage widths for {len(depths)} stages')
        bad = [d for d in embed_dims if d % num_heads]
        if bad:
            raise ValueError(f'stage widths {bad} are not divisible by num_heads {num_heads}')
        num_layers = sum(depths)
        global_blocks = tuple(sorted({int(i) for i in global_blocks}))
        if window_size is None and global_blocks:
            raise ValueError(f'global_blocks {global_blocks} needs window_size: without windows every block is global')
        if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)
                                        or window_size < 1):
            raise ValueError(f'window_size must be None or a positive int, got {window_size!r}')
        if any(not 0 <= i < num_layers for i in global_blocks):
            raise ValueError(f'global_blocks {global_blocks} must be block indices in 0..{num_layers - 1}')
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.global_pool = self._checked_pool(global_pool)
        self.grad_checkpointing = False
        self.stem = (ConvStem(in_chans, stem_dims, embed_dims[0]) if stem == 'conv'
                     else PatchStem(in_chans, embed_dims[0]))
        if phi == 'peripheral':
            # Φp's R: one for the whole model (Euc's w_r: the release's Linear(1, 4 * heads)).
            self.distance_embedding = EMBEDDINGS[phi_embedding](4 * num_heads)
            if phi_init == 'rand':
                for parameter in self.distance_embedding.parameters():
                    random_init_(parameter)
        dims = [dim for dim, depth in zip(embed_dims, depths) for _ in range(depth)]
        out_dims = dims[1:] + dims[-1:]
        drop_paths = torch.linspace(0, drop_path_rate, num_layers, device='cpu').tolist()

        def layer_phi(i: int) -> Union[PeripheralPhi, NoPosition]:
            if phi == 'none':
                return NoPosition()
            return PeripheralPhi(num_heads, layer_index=i, num_layers=num_layers, shared_embedding=True,
                                 init=phi_init, **design)

        self.blocks = nn.ModuleList([
            PerViTBlock(dims[i], out_dims[i], num_heads, layer_phi(i), drop_paths[i],
                        window_size=None if i in global_blocks else window_size, cpe=cpe, content=content)
            for i in range(num_layers)])
        if not phi_trainable:
            for module in (self.distance_embedding, *(block.attn.phi for block in self.blocks)):
                module.requires_grad_(False)
        self.norm = nn.LayerNorm(self.num_features, eps=1e-6)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=out_dims[i], reduction=self.stem.stride)
                             for i in range(num_layers)]
        self.init_weights()

    @staticmethod
    def _checked_pool(global_pool: str) -> str:
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool must be 'avg' or '' (PerViT has no class token), got {global_pool!r}")
        return global_pool

    def init_weights(self) -> None:
        """The release's: truncated normal (std 0.02, zero bias) for every Linear (qkv, proj, MLP,
        res, head); PyTorch's defaults for the convolutions and norms; each Φp keeps its own."""
        init_linear_layers(self)

    def forward_image_list(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """Images (C, H_i, W_i) of different sizes -> logits (len(images), num_classes) in the list's
        order, the images of each size run as one batch. While a BatchNorm of the model is in training
        mode, a ValueError before any work if a size holds fewer than :attr:`min_images_per_size`."""
        self._check_sizes_for_batch_norm(images)
        return super().forward_image_list(images)

    def _check_sizes_for_batch_norm(self, images: Sequence[torch.Tensor]) -> None:
        """A ValueError naming each size of ``images`` with fewer than :attr:`min_images_per_size`
        images, and the fix, where a BatchNorm of the model normalises by the batch's statistics."""
        if not any(isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm)) and module.training
                   for module in self.modules()):
            return
        few = {shape[-2:]: len(indices) for shape, indices in images_by_size(images).items()
               if len(indices) < self.min_images_per_size}
        if few:
            sizes = ', '.join(f'{height}x{width} ({count} image{"s" if count > 1 else ""})'
                              for (height, width), count in few.items())
            raise ValueError(f'in training mode {type(self).__name__} runs the images of each size of a list as one '
                             f'batch through BatchNorm, whose statistics over fewer than {self.min_images_per_size} '
                             f'images (min_images_per_size) are not a batch\'s; these sizes hold fewer: {sizes}. '
                             'Resize the images to a few sizes, each held by at least '
                             f'{self.min_images_per_size} images of the list, or give batches (B, C, H, W) of one size')

    def embed_tokens(self, x: torch.Tensor) -> Tuple[torch.Tensor, TokenGrid]:
        """Images (B, 3, H, W) -> the first block's input (B, h*w, C0) and its grid (the stem's)."""
        return self.stem(x)

    def _block_inputs(self) -> Dict[str, Any]:
        """Every block's Φp reads this model's one distance embedding, given with each call (so a
        copy, or ``nn.DataParallel``'s replica, reads its own)."""
        embedding = getattr(self, 'distance_embedding', None)
        return {} if embedding is None else {'distance_embedding': embedding}

    def _as_features(self, tokens: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """``forward_features`` returns the final normalised map (B, C, ceil(H/16), ceil(W/16))."""
        return tokens_as_map(tokens, grid)

    def _norm_intermediate(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        """With ``norm=True`` the last block's output goes through the final norm, the others stay as
        they are (timm's hierarchical models: the norm belongs to the last stage's output)."""
        return self.norm(tokens) if index == len(self.blocks) - 1 else tokens

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, C, h, w) -> logits (B, num_classes): global average pooling, then the classifier; with
        ``pre_logits`` the pooled features (B, C). With ``global_pool=''`` nothing is pooled."""
        if self.global_pool == 'avg':
            x = x.mean(dim=(-2, -1))
        return x if pre_logits else self.head(x)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """None beyond what weight-decaying optimisers skip anyway (biases, norms: 1-D parameters)."""
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Parameter groups by depth, for layer-wise learning-rate decay (timm's convention): the
        stem and the shared distance embedding first, then each block, then the final norm."""
        return dict(stem=r'^stem|^distance_embedding', blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])


@register_model('pervit_tiny')
def pervit_tiny(**kwargs: Any) -> PerViT:
    """PerViT-T: 4 heads, widths 128-192-224-280; 7,590,744 parameters, 1.6 GMAC; 78.8% top-1."""
    return create_from_arch(PerViT, PERVIT_ARCHS, 'pervit_tiny', 'tiny', **kwargs)


@register_model('pervit_small')
def pervit_small(**kwargs: Any) -> PerViT:
    """PerViT-S: 8 heads, widths 272-320-368-464; 21,317,160 parameters, 4.4 GMAC; 82.1% top-1
    (trained with drop_path_rate=0.1)."""
    return create_from_arch(PerViT, PERVIT_ARCHS, 'pervit_small', 'small', **kwargs)


@register_model('pervit_medium')
def pervit_medium(**kwargs: Any) -> PerViT:
    """PerViT-M: 12 heads, widths 312-468-540-684; 43,723,168 parameters, 9.0 GMAC; 82.9% top-1
    (trained with drop_path_rate=0.2)."""
    return create_from_arch(PerViT, PERVIT_ARCHS, 'pervit_medium', 'medium', **kwargs)
