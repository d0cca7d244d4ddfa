"""posattn's models as OpenMMLab backbones, registered once in mmengine's root ``MODELS``.

The root registry is the parent of mmpretrain's, mmdet's and mmseg's, so a config of any of
them builds ``dict(type='PosattnPerViT', ...)`` or ``dict(type='PosattnViT', ...)`` after
``custom_imports = dict(imports=['posattn_openmmlab'])``. The ``Posattn`` prefix keeps the
names clear of the toolboxes' own ``VisionTransformer`` and friends.

Both follow mmpretrain's backbone conventions (``arch`` table or dict, ``out_indices``,
``frozen_stages``, ``init_cfg``) and return a tuple with one output per index in
``out_indices``. The wrapped posattn model sits under ``.model`` with posattn's parameter names;
``init_cfg=dict(type='Pretrained', checkpoint=...)`` reads posattn checkpoints (timm's ViT / DeiT
are in that layout) and the layouts :func:`posattn.convert.to_posattn_layout` converts (the PerViT
release's, mmpretrain's ViT / DeiT, and classifiers these backbones trained under mmengine),
weights-only, and loads everything but the classifier strictly
(:func:`posattn.models.registry.load_pretrained`), with a warning that names the classifier's
weights it leaves out. Weights without the backbone's Φp (a plain ViT / DeiT's) leave the Φp at
its own initialisation, with a warning that names those keys; ``strict=False`` in the
``init_cfg`` loads what fits and logs the keys it skipped.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.utils.checkpoint
from einops import rearrange
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.registry import MODELS
from mmengine.runner import CheckpointLoader
from torch import nn

from posattn.convert import to_posattn_layout
from posattn.grid import TokenGrid
from posattn.models.pervit import PERVIT_ARCHS, PerViT
from posattn.models.registry import load_pretrained
from posattn.models.vit import VIT_ARCHS, VisionTransformer

__all__ = ['PosattnPerViT', 'PosattnViT']



def _resolve_arch(arch: Union[str, Mapping[str, Any]], archs: Dict[str, Dict[str, Any]],
                  keys: Sequence[str]) -> Dict[str, Any]:
    """``archs[arch]``, or ``arch`` itself when it is a dict with exactly ``keys``."""
    if isinstance(arch, str):
        if arch not in archs:
            raise ValueError(f'unknown arch {arch!r}; choose one of {sorted(archs)} or pass a dict with {list(keys)}')
        return dict(archs[arch])
    if set(arch) != set(keys):
        raise ValueError(f'an arch dict needs exactly the keys {sorted(keys)}, got {sorted(arch)}')
    return dict(arch)


def _resolve_out_indices(out_indices: Union[int, Sequence[int]], num_blocks: int) -> Tuple[int, ...]:
    """Block indices, negative ones counted from the end, checked and in the order given."""
    indices = (out_indices,) if isinstance(out_indices, int) else tuple(out_indices)
    resolved = tuple(i + num_blocks if i < 0 else i for i in indices)
    if not resolved or any(not 0 <= i < num_blocks for i in resolved):
        raise ValueError(f'out_indices {indices} must name blocks in 0..{num_blocks - 1} (or -{num_blocks}..-1)')
    return resolved


def _freeze(*modules: Optional[nn.Module]) -> None:
    for module in modules:
        if module is None:
            continue
        if isinstance(module, nn.Parameter):
            module.requires_grad = False
            continue
        module.eval()
        for param in module.parameters():
            param.requires_grad = False


def _backbone_remedy(model_name: str) -> str:
    """What a config sets to build the backbone that weights of the registered ``model_name`` fit."""
    family, arch = model_name.split('_', 1)
    backbone = 'PosattnPerViT' if family == 'pervit' else 'PosattnViT'
    return f"use model.backbone.type='{backbone}' with arch='{arch}'"


class _PretrainedMixin:
    """``init_cfg=dict(type='Pretrained', checkpoint=..., strict=True)`` through posattn's conversion.

    The backbone's weights load through :func:`posattn.models.registry.load_pretrained`, the
    classifier (``head.``) left out: strictly by default, so a checkpoint that does not fit raises
    an error naming the registered model it fits and listing the differing keys; ``strict=False``
    loads what fits and logs every key it skipped. A plain ViT / DeiT checkpoint leaves the Φp at
    its own initialisation (and a ``pos_embed=False`` backbone drops its ``pos_embed``), logged
    as one warning. The layout is recognised from the keys, so there is no ``prefix`` to set.
    Other ``init_cfg`` types go to mmengine's :class:`BaseModule` as usual.
    """

    model: nn.Module

    def init_weights(self) -> None:
        cfg = self.init_cfg
        if not (isinstance(cfg, dict) and cfg.get('type') == 'Pretrained'):
            super().init_weights()
            return
        extra = set(cfg) - {'type', 'checkpoint', 'map_location', 'strict'}
        if extra:
            layout = ('; the layout is recognised from the keys (posattn, timm, mmpretrain, the PerViT release, '
                      'mmengine), so no prefix is needed' if 'prefix' in extra else '')
            raise ValueError(f'{type(self).__name__} reads only checkpoint, map_location and strict from a '
                             f'Pretrained init_cfg; got {sorted(extra)} too{layout}')
        checkpoint = cfg['checkpoint']
        if '://' not in checkpoint and not os.path.isfile(os.path.expanduser(checkpoint)):
            raise FileNotFoundError(
                f'{type(self).__name__}: no pretrained checkpoint at {checkpoint!r}. Put an ImageNet '
                f'checkpoint there (the PerViT release\'s pervit_tiny.pth / pervit_small.pth, or one '
                f'trained with configs/pervit_t_imagenet.py), point the config at it with '
                f'--cfg-options model.backbone.init_cfg.checkpoint=PATH, or train from scratch with '
                f'--cfg-options model.backbone.init_cfg=None')
        # mmengine's CheckpointLoader handles URLs; local files go through the weights-only
        # loader that posattn_openmmlab.checkpoint registers.
        raw = CheckpointLoader.load_checkpoint(checkpoint, map_location=cfg.get('map_location', 'cpu'))
        state_dict, layout = to_posattn_layout(raw)
        source = f'checkpoint {checkpoint} ({layout} layout)'
        skipped, fresh = load_pretrained(self.model, state_dict, source=source, target=type(self).__name__,
                                         strict=cfg.get('strict', True), ignore=('head.',), remedy=_backbone_remedy)
        if fresh is not None:
            print_log(fresh, logger='current', level=logging.WARNING)
        if skipped:
            print_log(f'{type(self).__name__}: partial load (strict=False) from {source}; {len(skipped)} keys '
                      f'skipped:\n  ' + '\n  '.join(skipped), logger='current', level=logging.WARNING)
        head_keys = sorted(k for k in state_dict if k.startswith('head.'))
        loaded = ('the backbone weights that fit' if skipped else 'every other backbone weight' if fresh
                  else 'every backbone weight')
        print_log(f'{type(self).__name__}: loaded {loaded} from {checkpoint} ({layout} layout)'
                  + (f'; not loaded, the classifier: {", ".join(head_keys)}' if head_keys else ''),
                  logger='current', level=logging.WARNING if head_keys else logging.INFO)
        self._is_init = True


@MODELS.register_module()
class PosattnPerViT(_PretrainedMixin, BaseModule):
    """PerViT (Min et al. 2022) as a backbone: stem, 12 columnar blocks, one stride-16 grid.

    Any input size works (mmdet pads to multiples of 32, so grids like 50 x 83 arrive): the grid
    is ceil(H/16) x ceil(W/16). For detection and segmentation at 800-1333 px, ``window_size`` and
    ``global_blocks`` select windowed peripheral attention (:class:`posattn.models.pervit.PerViT`),
    and ``with_cp`` trades compute for memory.

    Args:
        arch: 'tiny', 'small', 'medium', or a dict with ``embed_dims``, ``depths``, ``num_heads``
            and ``stem_dims`` (as :class:`posattn.models.pervit.PerViT` takes them).
        out_indices: blocks whose outputs are returned, each as a (B, C_i, H/16, W/16) map; the
            last block's goes through the final LayerNorm, as in the classifier.
        frozen_stages: -1 trains everything; k >= 0 freezes the stem and the first k of the
            stages (``depths``); k >= 1 also freezes the distance embedding every layer's Φp reads.
        norm_eval: keep the stem's BatchNorm layers in eval mode while training (frozen statistics).
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        window_size: None attends over the whole grid in every block (the classifier's
            behaviour); ws attends within ws x ws windows, Φp computed once for the window grid.
        global_blocks: blocks that attend over the whole grid when ``window_size`` is set,
            e.g. (3, 7, 11).
        with_cp: while training, recompute each block in the backward pass instead of keeping
            its activations (``torch.utils.checkpoint``, non-reentrant), Φp included.
        init_cfg: mmengine init config; ``type='Pretrained'`` reads posattn or PerViT-release
            checkpoints (the classifier is not loaded; ``strict=False`` for a partial load).

    ``out_channels`` lists the channels of each output, for necks (e.g. mmdet's FPN ``in_channels``).
    """

    def __init__(self, arch: Union[str, Mapping[str, Any]] = 'tiny', out_indices: Union[int, Sequence[int]] = -1,
                 frozen_stages: int = -1, norm_eval: bool = False, drop_path_rate: float = 0.0,
                 window_size: Optional[int] = None, global_blocks: Sequence[int] = (), with_cp: bool = False,
                 init_cfg: Optional[Union[dict, list]] = None):
        super().__init__(init_cfg=copy.deepcopy(init_cfg))
        arch = _resolve_arch(arch, PERVIT_ARCHS, ('embed_dims', 'depths', 'num_heads', 'stem_dims'))
        self.model = PerViT(**arch, num_classes=0, drop_path_rate=drop_path_rate, window_size=window_size,
                            global_blocks=global_blocks)
        self.with_cp = with_cp
        self.stage_ends = torch.tensor(arch['depths']).cumsum(0).tolist()
        if not -1 <= frozen_stages <= len(self.stage_ends):
            raise ValueError(f'frozen_stages must be in -1..{len(self.stage_ends)}, got {frozen_stages}')
        self.out_indices = _resolve_out_indices(out_indices, len(self.model.blocks))
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.out_channels = [self.model.blocks[i].mlp.fc2.out_features for i in self.out_indices]
        self._freeze_stages()

    def _freeze_stages(self) -> None:
        if self.frozen_stages < 0:
            return
        _freeze(self.model.stem)
        if self.frozen_stages >= 1:
            _freeze(self.model.distance_embedding, *self.model.blocks[:self.stage_ends[self.frozen_stages - 1]])
        if self.frozen_stages == len(self.stage_ends):
            _freeze(self.model.norm)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Images (B, 3, H, W) -> one (B, C_i, ceil(H/16), ceil(W/16)) map per ``out_indices``."""
        x, grid = self.model.stem(x)
        last = len(self.model.blocks) - 1
        maps = {}
        checkpointed = self.with_cp and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.model.blocks[:max(self.out_indices) + 1]):
            if checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, grid, use_reentrant=False)
            else:
                x = block(x, grid)
            if i in self.out_indices:
                tokens = self.model.norm(x) if i == last else x
                maps[i] = rearrange(tokens, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)
        return tuple(maps[i] for i in self.out_indices)

    def train(self, mode: bool = True) -> 'PosattnPerViT':
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self


@MODELS.register_module()
class PosattnViT(_PretrainedMixin, BaseModule):
    """ViT / DeiT (posattn's :class:`~posattn.models.vit.VisionTransformer`) with any Φp.

    Args:
        arch: 'tiny', 'small', 'base' (DeiT's sizes), or a dict with ``embed_dim`` and ``num_heads``.
        img_size: training resolution, which sizes the learned position embedding.
        out_indices: blocks whose outputs are returned; the last block's goes through the final
            LayerNorm.
        out_type: 'cls_token' (B, C), 'featmap' (B, C, h, w) or 'avg_featmap' (B, C), as in
            mmpretrain's ``VisionTransformer``.
        frozen_stages: -1 trains everything; k >= 0 freezes the patch embedding, class token and
            position embedding and the first k blocks (and the PEGs after them).
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        init_cfg: mmengine init config; ``type='Pretrained'`` reads posattn, timm and mmpretrain
            ViT / DeiT checkpoints (the classifier is not loaded; ``strict=False`` for a partial
            load); a plain ViT / DeiT's weights leave the Φp at its own initialisation, logged.
        **vit_kwargs: the rest of :class:`~posattn.models.vit.VisionTransformer`'s options:
            ``phi``, ``phi_cfg``, ``pos_embed``, ``peg_after``, ``class_token``, ``patch_size``, ...

    ``out_channels`` lists the channels of each output.
    """

    OUT_TYPES = ('cls_token', 'featmap', 'avg_featmap')

    def __init__(self, arch: Union[str, Mapping[str, Any]] = 'tiny', img_size: int = 224,
                 out_indices: Union[int, Sequence[int]] = -1, out_type: str = 'cls_token',
                 frozen_stages: int = -1, drop_path_rate: float = 0.0,
                 init_cfg: Optional[Union[dict, list]] = None, **vit_kwargs: Any):
        super().__init__(init_cfg=copy.deepcopy(init_cfg))
        if out_type not in self.OUT_TYPES:
            raise ValueError(f'out_type must be one of {self.OUT_TYPES}, got {out_type!r}')
        arch = _resolve_arch(arch, VIT_ARCHS, ('embed_dim', 'num_heads'))
        self.model = VisionTransformer(img_size=img_size, num_classes=0, drop_path_rate=drop_path_rate,
                                       **arch, **vit_kwargs)
        if out_type == 'cls_token' and self.model.cls_token is None:
            raise ValueError("out_type='cls_token' needs the class token: pass class_token=True or "
                             "out_type='avg_featmap'")
        depth = len(self.model.blocks)
        if not -1 <= frozen_stages <= depth:
            raise ValueError(f'frozen_stages must be in -1..{depth}, got {frozen_stages}')
        self.out_indices = _resolve_out_indices(out_indices, depth)
        self.out_type = out_type
        self.frozen_stages = frozen_stages
        self.out_channels = [arch['embed_dim']] * len(self.out_indices)
        self._freeze_stages()

    def _freeze_stages(self) -> None:
        if self.frozen_stages < 0:
            return
        model = self.model
        _freeze(model.patch_embed, model.cls_token, model.pos_embed, *model.blocks[:self.frozen_stages],
                *[peg for i, peg in model.pegs.items() if int(i) < self.frozen_stages])
        if self.frozen_stages == len(model.blocks):
            _freeze(model.norm)

    def _output(self, tokens: torch.Tensor, grid: TokenGrid) -> torch.Tensor:
        if self.out_type == 'cls_token':
            return tokens[:, 0]
        patches = tokens[:, grid.num_prefix_tokens:]
        if self.out_type == 'avg_featmap':
            return patches.mean(dim=1)
        return rearrange(patches, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``VisionTransformer.forward_features``, keeping the ``out_indices`` blocks' outputs."""
        model = self.model
        x, grid = model.embed_tokens(x)
        last = len(model.blocks) - 1
        outputs = {}
        for i, x in model.iter_blocks(x, grid, num_blocks=max(self.out_indices) + 1):
            if i in self.out_indices:
                outputs[i] = self._output(model.norm(x) if i == last else x, grid)
        return tuple(outputs[i] for i in self.out_indices)

    def train(self, mode: bool = True) -> 'PosattnViT':
        super().train(mode)
        self._freeze_stages()
        return self
