"""DeiT-style Vision Transformers whose attention takes any Φp.

Dosovitskiy et al. 2021 (ViT) with the DeiT layouts of Touvron et al. 2021: patch 16, depth 12,
MLP ratio 4, pre-norm blocks, LayerNorm eps 1e-6; Tiny 192 channels / 3 heads, Small 384 / 6,
Base 768 / 12. Parameter names follow timm's ``VisionTransformer`` (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.i.attn.qkv``, ``norm``, ``head``), so a timm ViT / DeiT
state_dict loads as it is; each layer's Φp adds its own ``blocks.i.attn.phi.*`` parameters.

The rows of PerViT's Table 2 (DeiT-Tiny baseline, ImageNet-1k top-1) are one argument apart:

    create_model('vit_tiny')                                           # DeiT-T        72.2
    create_model('vit_tiny', pos_embed=False, peg_after=(0, 1, 2, 3, 4))  # + CPVT (0-5) 73.4
    create_model('vit_tiny', phi='irpe', phi_cfg=IRPE_K)               # + iRPE-K      73.7
    create_model('vit_tiny', phi='peripheral')                         # + PPE         74.4

with ``IRPE_K = dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)``.
``peg_after=(0,)`` is CPVT-Ti's single PEG at "position 0" (72.4, or 72.9 keeping the learned
embedding). Any input size works: the learned position embedding is resized (bicubic) to the
grid the input produces, and every Φp is evaluated on that grid.

DeiT III (Touvron et al. 2022, timm's ``deit3_*``) is two options away, with timm's names:
``init_values=1e-6`` (LayerScale ``ls1`` / ``ls2`` on the residual branches) and
``no_embed_class=True`` (no position embedding for the class token).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import Attention
from ..grid import TokenGrid
from ..layout import ImageLayout
from ..phi import PositionalModule, build_layer_phi, build_phi
from .blocks import DropPath, Mlp, PatchEmbed, init_linear_layers
from .model_api import ClassifierApi, LayoutStackApi
from .pos_embed import resample_abs_pos_embed
from .registry import create_from_arch, register_model

__all__ = ['VisionTransformer', 'Block', 'LayerScale', 'VIT_ARCHS', 'vit_tiny', 'vit_small', 'vit_base']


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch, ``x * gamma`` (CaiT's LayerScale, DeiT III's
    blocks), with timm's parameter name so that timm's layer-scale weights load as they are.

    Args:
        dim: token channels.
        init_values: every channel's starting scale (DeiT III: 1e-6 for S and B).
    """

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x))).

    Args:
        dim: token channels.
        num_heads: attention heads.
        phi: this layer's built Φp.
        mlp_ratio: MLP hidden width over ``dim``.
        qkv_bias: bias on the qkv projection.
        drop: dropout after the attention projection and in the MLP.
        attn_drop: dropout on the attention probabilities.
        drop_path: stochastic depth rate of both residual branches.
        num_prefix_tokens: extra tokens before the grid.
        init_values: starting scale of a :class:`LayerScale` on each residual branch (``ls1``,
            ``ls2``); None (or 0) for none, DeiT's and ViT's blocks.
    """

    def __init__(self, dim: int, num_heads: int, phi: PositionalModule, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, num_prefix_tokens: int = 0, init_values: Optional[float] = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, phi=phi, qkv_bias=qkv_bias, attn_drop=attn_drop,
                              proj_drop=drop, num_prefix_tokens=num_prefix_tokens)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: torch.Tensor, grid: Union[TokenGrid, ImageLayout]) -> torch.Tensor:
        """x: (B, N, C) on ``grid``, or images of different grids (B, L, C) placed by a layout."""
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), grid)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class VisionTransformer(LayoutStackApi, ClassifierApi, nn.Module):
    """ViT / DeiT with a pluggable Φp in every attention layer.

    A list of images of different sizes runs in one call through the blocks, each image on its own
    grid, one image a row (:class:`~posattn.models.model_api.LayoutStackApi`).

    Args:
        img_size: training resolution, a side or (height, width); sets the grid of the learned
            position embedding (other input sizes resample it).
        patch_size: patch side in pixels.
        in_chans: input channels.
        num_classes: classifier outputs; 0 for no head (features).
        embed_dim: token channels.
        depth: number of blocks.
        num_heads: attention heads.
        mlp_ratio: MLP hidden width over ``embed_dim``.
        qkv_bias: bias on the qkv projections.
        class_token: prepend a learned class token (the only prefix token).
        global_pool: 'token' (classify the class token, DeiT), 'avg' (mean of the grid tokens,
            CPVT's GAP head) or '' (no pooling: the head sees every token, timm's convention).
        pos_embed: learned absolute position embedding added after the patch embedding.
        peg_after: indices of the blocks after which a PEG (CPVT) runs on the tokens.
        phi: the Φp of the attention layers, by registered name (``posattn.list_phis()``).
        phi_cfg: its options; what each layer knows (``dim``, ``num_heads``, ``head_dim``,
            ``num_prefix_tokens``, ``layer_index``, ``num_layers``, and ``table_size``: the grid of
            ``img_size``) is filled in where the Φp takes it and ``phi_cfg`` does not set it
            (:func:`posattn.phi.build_layer_phi`): ``phi='rpb'`` learns its table for the model's grid.
        phi_blocks: the indices of the blocks whose attention takes ``phi``; the others attend
            without a Φp (``'none'``). None: every block. ConViT's layout is ``range(10)`` of 12
            (local gated layers first, plain ones last).
        drop_rate: dropout after the position embedding, attention projections and MLPs.
        attn_drop_rate: dropout on attention probabilities.
        drop_path_rate: stochastic depth, rising linearly to this rate over the blocks.
        init_values: layer scale (timm's ``ls1`` / ``ls2``, DeiT III's blocks) starting at this
            value; None for none (DeiT, ViT).
        no_embed_class: the learned position embedding covers the grid only and is added before
            the class token is prepended (DeiT III's layout, timm's name); False: it covers the
            class token too (DeiT's, ViT's).
        dynamic_img_size: True: any input size, the learned position embedding resampled to the
            grid it produces (timm's ``dynamic_img_size``; posattn's default). False: an input
            whose grid is not ``img_size``'s is an error.
        dynamic_img_pad: pad inputs on the right and bottom to a multiple of ``patch_size``
            (timm's ``dynamic_img_pad``); False: such inputs are an error.
    """

    def __init__(self, img_size: Union[int, Tuple[int, int]] = 224, patch_size: int = 16, in_chans: int = 3,
                 num_classes: int = 1000, embed_dim: int = 192, depth: int = 12, num_heads: int = 3,
                 mlp_ratio: float = 4.0, qkv_bias: bool = True, class_token: bool = True,
                 global_pool: str = 'token', pos_embed: bool = True, peg_after: Sequence[int] = (),
                 phi: str = 'none', phi_cfg: Optional[Mapping[str, Any]] = None,
                 phi_blocks: Optional[Sequence[int]] = None, drop_rate: float = 0.0, attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 init_values: Optional[float] = None, no_embed_class: bool = False,
                 dynamic_img_size: bool = True, dynamic_img_pad: bool = False):
        super().__init__()
        self.num_prefix_tokens = int(class_token)
        self.global_pool = self._checked_pool(global_pool)
        peg_after = tuple(sorted(set(peg_after)))
        if any(not 0 <= i < depth for i in peg_after):
            raise ValueError(f'peg_after {peg_after} names blocks outside 0..{depth - 1}')
        if embed_dim % num_heads:
            raise ValueError(f'embed_dim {embed_dim} is not divisible by num_heads {num_heads}')
        phi_blocks = range(depth) if phi_blocks is None else tuple(sorted(set(phi_blocks)))
        if any(not 0 <= i < depth for i in phi_blocks):
            raise ValueError(f'phi_blocks {tuple(phi_blocks)} names blocks outside 0..{depth - 1}')
        self.num_classes = num_classes
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.grad_checkpointing = False
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.no_embed_class = no_embed_class
        self.dynamic_img_size = dynamic_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        num_tokens = (0 if no_embed_class else self.num_prefix_tokens) + self.grid_size[0] * self.grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim)) if pos_embed else None
        self.pos_drop = nn.Dropout(drop_rate)
        drop_paths = torch.linspace(0, drop_path_rate, depth, device='cpu').tolist()
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads,
                  build_layer_phi(phi if i in phi_blocks else 'none', phi_cfg if i in phi_blocks else None,
                                  dim=embed_dim, num_heads=num_heads, num_prefix_tokens=self.num_prefix_tokens,
                                  layer_index=i, num_layers=depth, table_size=self.grid_size),
                  mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, drop_paths[i], self.num_prefix_tokens, init_values)
            for i in range(depth)])
        self.pegs = nn.ModuleDict({str(i): build_phi('peg', dim=embed_dim) for i in peg_after})
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=patch_size) for i in range(depth)]
        self.init_weights()

    def _checked_pool(self, global_pool: str) -> str:
        if global_pool not in ('token', 'avg', ''):
            raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}")
        if global_pool == 'token' and not self.num_prefix_tokens:
            raise ValueError("global_pool='token' classifies the class token: pass class_token=True "
                             "or global_pool='avg'")
        return global_pool

    def init_weights(self) -> None:
        """timm's ViT initialisation; each Φp keeps its own."""
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        init_linear_layers(self)

    def embed_tokens(self, x: torch.Tensor) -> Tuple[torch.Tensor, TokenGrid]:
        """Images (B, C, H, W) -> the first block's input (B, prefix + h*w, embed_dim) and its grid."""
        height, width = x.shape[-2:]
        patch = self.patch_embed.patch_size
        if self.dynamic_img_pad:  # timm pads on the right and bottom
            x = F.pad(x, (0, -width % patch, 0, -height % patch))
        x, hw = self.patch_embed(x)
        if not self.dynamic_img_size and tuple(hw) != self.grid_size:
            raise ValueError(f'input of {height}x{width} pixels gives a {hw[0]}x{hw[1]} grid, the model\'s is '
                             f'{self.grid_size[0]}x{self.grid_size[1]} (dynamic_img_size=False): resize the input '
                             f'or build the model with dynamic_img_size=True')
        grid = TokenGrid(*hw, self.num_prefix_tokens)
        if self.pos_embed is not None and self.no_embed_class:
            x = x + resample_abs_pos_embed(self.pos_embed, hw, self.grid_size, num_prefix_tokens=0)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        if self.pos_embed is not None and not self.no_embed_class:
            x = x + resample_abs_pos_embed(self.pos_embed, hw, self.grid_size, self.num_prefix_tokens)
        return self.pos_drop(x), grid

    def _after_block(self, index: int, x: torch.Tensor, grid: Union[TokenGrid, ImageLayout]) -> torch.Tensor:
        """Block ``index``'s output through the PEG that follows it, if it has one; on a layout the PEG,
        a convolution over each image's grid, runs once per distinct grid (zero at padding)."""
        key = str(index)
        if key not in self.pegs:
            return x
        peg = self.pegs[key]
        if isinstance(grid, ImageLayout):
            return grid.per_grid((x,), lambda group, tokens: peg.tokens(tokens, group.grid), x.shape[-1])
        return peg.tokens(x, grid)

    def _as_features(self, tokens: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        """``forward_features`` returns the normalised tokens (B, prefix + h*w, embed_dim) as they are."""
        return tokens

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Normalised tokens (B, N, C) -> logits (B, num_classes), or with ``pre_logits`` the pooled
        features the classifier takes (B, C); with ``global_pool=''`` nothing is pooled."""
        if self.global_pool == 'token':
            x = x[:, 0]
        elif self.global_pool == 'avg':
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, Sequence[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False):
        """The outputs of the blocks ``indices`` (timm's convention: None all, n the last n, or a
        list), in block order, after the block's PEG if it has one; with ``norm`` through the
        final norm. Each is (B, C, h, w) for ``output_fmt='NCHW'`` or (B, h*w, C) for 'NLC', the
        prefix tokens left out, or paired with them (B, prefix, C) with ``return_prefix_tokens``
        (timm's ViT signature).

        Returns the list alone with ``intermediates_only``, else (the final normalised tokens, the
        list); ``stop_early`` runs no block after the last one asked for.
        """
        return self._forward_intermediates(x, indices, norm, stop_early, output_fmt, intermediates_only,
                                           return_prefix_tokens)

    def _norm_intermediate(self, index: int, tokens: torch.Tensor) -> torch.Tensor:
        """Every block's output goes through the final norm with ``norm=True`` (timm's ViT)."""
        return self.norm(tokens)

    def _keep_blocks(self, num_blocks: int) -> None:
        """The first ``num_blocks`` blocks and the PEGs after them."""
        super()._keep_blocks(num_blocks)
        self.pegs = nn.ModuleDict({i: peg for i, peg in self.pegs.items() if int(i) < num_blocks})

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """Parameters a weight-decaying optimiser should leave alone (timm's optimiser factory reads it)."""
        return {name for name in ('pos_embed', 'cls_token') if getattr(self, name) is not None}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Parameter groups by depth, for layer-wise learning-rate decay (timm's convention): the
        embeddings first, then each block with the PEG that follows it, then the final norm."""
        return dict(stem=r'^cls_token|^pos_embed|^patch_embed',
                    blocks=[(r'^(?:blocks|pegs)\.(\d+)', None), (r'^norm', (99999,))])


# DeiT's sizes by arch; all have depth 12, patch 16 and MLP ratio 4 (the constructor's defaults).
VIT_ARCHS = {'tiny': dict(embed_dim=192, num_heads=3), 'small': dict(embed_dim=384, num_heads=6),
             'base': dict(embed_dim=768, num_heads=12)}


@register_model('vit_tiny')
def vit_tiny(**kwargs: Any) -> VisionTransformer:
    """DeiT-Tiny layout: 192 channels, 3 heads (5.7M parameters with ``phi='none'``)."""
    return create_from_arch(VisionTransformer, VIT_ARCHS, 'vit_tiny', 'tiny', **kwargs)


@register_model('vit_small')
def vit_small(**kwargs: Any) -> VisionTransformer:
    """DeiT-Small layout: 384 channels, 6 heads (22M parameters)."""
    return create_from_arch(VisionTransformer, VIT_ARCHS, 'vit_small', 'small', **kwargs)


@register_model('vit_base')
def vit_base(**kwargs: Any) -> VisionTransformer:
    """DeiT-Base layout: 768 channels, 12 heads (86M parameters)."""
    return create_from_arch(VisionTransformer, VIT_ARCHS, 'vit_base', 'base', **kwargs)
