"""posattn's models as OpenMMLab backbones, registered once in mmengine's root ``MODELS``.

The root registry is the parent of mmpretrain's, mmdet's and mmseg's, so a config of any of
them builds ``dict(type='PosattnPerViT', ...)`` or ``dict(type='PosattnViT', ...)`` after
``custom_imports = dict(imports=['posattn_openmmlab'])``. The ``Posattn`` prefix keeps the
names clear of the toolboxes' own ``VisionTransformer`` and friends.

Both follow mmpretrain's backbone conventions (those of its ``VisionTransformer``): ``arch`` as a
name from an arch table or a dict of sizes, ``out_indices`` (negative ones counted from the end),
``out_type``, ``frozen_stages`` (-1 and 0 freeze nothing), ``norm_eval``, ``with_cp``,
``get_layer_depth`` for mmpretrain's layer-wise learning-rate decay, and a tuple with one output
per index in ``out_indices``. The wrapped posattn model sits under ``.model`` with posattn's
parameter names.

``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=...)`` reads posattn checkpoints (timm's
ViT / DeiT are in that layout) and the layouts :func:`posattn.convert.to_posattn_layout` converts
(the PerViT release's, mmpretrain's ViT / DeiT, and classifiers these backbones trained under
mmengine), weights-only, and loads everything but the classifier strictly
(:func:`posattn.models.registry.load_pretrained`), with a warning that names the classifier's
weights it leaves out. ``prefix`` (mmengine's meaning) loads only the keys under it, e.g.
``'backbone.'`` of a classifier checkpoint. Weights without the backbone's Φp (a plain ViT /
DeiT's) leave the Φp at its own initialisation, with a warning that names those keys;
``strict=False`` in the ``init_cfg`` loads what fits and logs the keys it skipped.
"""
from __future__ import annotations

import copy
import logging
import os
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from einops import rearrange
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.registry import MODELS
from torch import nn

from posattn.convert import saved_phi_records, to_posattn_layout
from posattn.grid import TokenGrid
from posattn.models.model_api import resolve_block_indices
from posattn.models.pervit import PERVIT_ARCHS, PerViT
from posattn.models.registry import load_pretrained
from posattn.models.vit import VisionTransformer

from .checkpoint import load_checkpoint_file

__all__ = ['PosattnPerViT', 'PosattnViT']


# mmpretrain's VisionTransformer arch names with its sizes, and 't' / 'tiny' for DeiT-T; 's' / 'small'
# are DeiT-S here (timm's and posattn's ViT-S), where mmpretrain has a 768-wide, 8-block model.
VIT_ARCH_ZOO = {
    **dict.fromkeys(('t', 'tiny', 'deit-t', 'deit-tiny'),
                    dict(embed_dims=192, num_layers=12, num_heads=3, feedforward_channels=768)),
    **dict.fromkeys(('s', 'small', 'deit-s', 'deit-small'),
                    dict(embed_dims=384, num_layers=12, num_heads=6, feedforward_channels=1536)),
    **dict.fromkeys(('b', 'base', 'deit-b', 'deit-base'),
                    dict(embed_dims=768, num_layers=12, num_heads=12, feedforward_channels=3072)),
    **dict.fromkeys(('l', 'large'), dict(embed_dims=1024, num_layers=24, num_heads=16, feedforward_channels=4096)),
    **dict.fromkeys(('h', 'huge'), dict(embed_dims=1280, num_layers=32, num_heads=16, feedforward_channels=5120)),
}
PERVIT_ARCH_ZOO = {alias: PERVIT_ARCHS[name] for name in PERVIT_ARCHS for alias in (name, name[0])}

OUT_TYPES = ('raw', 'cls_token', 'featmap', 'avg_featmap')
# what norm_eval keeps in eval mode: torch's batch norms (the lazy ones become these when they first run)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _resolve_arch(arch: Union[str, Mapping[str, Any]], arch_zoo: Mapping[str, Mapping[str, Any]],
                  keys: Sequence[str]) -> Dict[str, Any]:
    """``arch_zoo[arch.lower()]``, or ``arch`` itself when it is a dict with exactly ``keys``."""
    if isinstance(arch, str):
        if arch.lower() not in arch_zoo:
            raise ValueError(f'unknown arch {arch!r}; choose one of {sorted(arch_zoo)} or pass a dict with '
                             f'{list(keys)}')
        return dict(arch_zoo[arch.lower()])
    if not isinstance(arch, Mapping):
        raise TypeError(f'arch must be a name or a dict with {list(keys)}, got {type(arch).__name__}')
    missing, unknown = [k for k in keys if k not in arch], sorted(set(arch) - set(keys))
    problems = ([f'missing {missing}'] if missing else []) + ([f'unknown {unknown}'] if unknown else [])
    if problems:
        raise ValueError(f'an arch dict needs exactly the keys {list(keys)}; ' + '; '.join(problems))
    return dict(arch)


def _resolve_out_indices(out_indices: Union[int, Sequence[int]], num_blocks: int) -> Tuple[int, ...]:
    """Block indices in the order given (OpenMMLab's convention: an int is one block's index, where
    timm's ``indices`` take it as the last n blocks), negative ones counted from the end and checked
    by :func:`posattn.models.model_api.resolve_block_indices`."""
    if isinstance(out_indices, int):
        out_indices = (out_indices,)
    if not isinstance(out_indices, Sequence) or not all(isinstance(i, int) for i in out_indices):
        raise TypeError(f'out_indices must be a block index or a sequence of them, got {out_indices!r}')
    return tuple(resolve_block_indices(tuple(out_indices), num_blocks, name='out_indices'))


def _check_out_type(out_type: str) -> str:
    if out_type not in OUT_TYPES:
        raise ValueError(f'out_type must be one of {OUT_TYPES}, got {out_type!r}')
    return out_type


def _format_output(tokens: torch.Tensor, grid: TokenGrid, out_type: str) -> torch.Tensor:
    """One block's tokens (B, prefix + h*w, C) as ``out_type`` asks (mmpretrain's names): 'raw' as
    they are; 'cls_token' the class token (B, C); 'featmap' the grid tokens as a map (B, C, h, w);
    'avg_featmap' their mean (B, C)."""
    if out_type == 'raw':
        return tokens
    if out_type == 'cls_token':
        return tokens[:, 0]
    patches = tokens[:, grid.num_prefix_tokens:]
    if out_type == 'avg_featmap':
        return patches.mean(dim=1)
    return rearrange(patches, 'b (h w) c -> b c h w', h=grid.height, w=grid.width)


def _freeze(*modules: Optional[Union[nn.Module, nn.Parameter]]) -> None:
    """Eval mode and no gradients for each module (or parameter); None is skipped."""
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


class _TokenBackbone(BaseModule):
    """What both backbones share: the forward over ``out_indices``, ``train(mode)`` keeping frozen
    parts frozen, ``get_layer_depth`` and the ``Pretrained`` init through posattn's conversion.

    Subclasses build ``self.model`` (a posattn model with ``blocks``, ``norm``, ``embed_tokens``,
    ``iter_blocks``, ``set_grad_checkpointing`` and ``group_matcher``), set ``out_indices``,
    ``out_type`` and ``with_cp``, and define ``_freeze_stages``.
    """

    model: Union[PerViT, VisionTransformer]
    out_indices: Tuple[int, ...]
    out_type: str
    with_cp: bool

    def _freeze_stages(self) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Images (B, 3, H, W) -> one output per ``out_indices``; the last block's goes through the
        final norm, as in the classifier. Blocks after the last one asked for are not run."""
        tokens, grid = self.model.embed_tokens(x)
        last = len(self.model.blocks) - 1
        outputs = {}
        for i, tokens in self.model.iter_blocks(tokens, grid, num_blocks=max(self.out_indices) + 1):
            if i in self.out_indices:
                outputs[i] = _format_output(self.model.norm(tokens) if i == last else tokens, grid, self.out_type)
        return tuple(outputs[i] for i in self.out_indices)

    def train(self, mode: bool = True) -> '_TokenBackbone':
        """mmpretrain's convention: frozen stages stay in eval mode; ``with_cp`` only while training."""
        super().train(mode)
        self._freeze_stages()
        self.model.set_grad_checkpointing(self.with_cp and mode)
        return self

    def get_layer_depth(self, param_name: str, prefix: str = '') -> Tuple[int, int]:
        """(depth of a parameter, number of depths), mmpretrain's ``VisionTransformer`` convention that
        its ``LearningRateDecayOptimWrapperConstructor`` reads: with ``num_blocks + 2`` depths, 0 is
        the embedding (the model's ``group_matcher`` stem), i + 1 is block i, and the last is
        everything else, the final norm and any parameter outside ``prefix`` (the neck and head,
        when a classifier asks with ``prefix='backbone.'``)."""
        num_depths = len(self.model.blocks) + 2
        if not param_name.startswith(prefix):
            return num_depths - 1, num_depths
        name = param_name[len(prefix):]
        name = name[len('model.'):] if name.startswith('model.') else name
        matcher = self.model.group_matcher()
        if re.match(matcher['stem'], name):
            return 0, num_depths
        for pattern, fixed_group in matcher['blocks']:
            match = re.match(pattern, name)
            if match and fixed_group is None:
                return int(match.group(1)) + 1, num_depths
        return num_depths - 1, num_depths

    def init_weights(self) -> None:
        """``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=None, strict=True)`` through posattn's
        conversion.

        The backbone's weights load through :func:`posattn.models.registry.load_pretrained`, the
        classifier (``head.``) left out: strictly by default, so a checkpoint that does not fit
        raises an error naming the registered model it fits and listing the differing keys;
        ``strict=False`` loads what fits and logs every key it skipped. A plain ViT / DeiT
        checkpoint leaves the Φp at its own initialisation (and a ``pos_embed=False`` backbone drops
        its ``pos_embed``), logged as one warning. The layout is recognised from the keys;
        ``prefix`` selects the part of the checkpoint to read
        (:func:`posattn.convert.to_posattn_layout`). Other
        ``init_cfg`` types go to mmengine's :class:`BaseModule` as usual.
        """
        cfg = self.init_cfg
        if not (isinstance(cfg, dict) and cfg.get('type') == 'Pretrained'):
            super().init_weights()
            return
        name = type(self).__name__
        extra = set(cfg) - {'type', 'checkpoint', 'prefix', 'map_location', 'strict'}
        if extra:
            raise ValueError(f'{name} reads only checkpoint, prefix, map_location and strict from a Pretrained '
                             f'init_cfg; got {sorted(extra)} too')
        checkpoint = cfg['checkpoint']
        if '://' not in checkpoint and not os.path.isfile(os.path.expanduser(checkpoint)):
            raise FileNotFoundError(
                f'{name}: no pretrained checkpoint at {checkpoint!r}. Put an ImageNet '
                f'checkpoint there (the PerViT release\'s pervit_tiny.pth / pervit_small.pth, or one '
                f'trained with configs/pervit_t_imagenet.py), point the config at it with '
                f'--cfg-options model.backbone.init_cfg.checkpoint=PATH, or train from scratch with '
                f'--cfg-options model.backbone.init_cfg=None')
        # local files weights-only with mmengine's types allowed; URLs through mmengine's CheckpointLoader
        raw = load_checkpoint_file(checkpoint, map_location=cfg.get('map_location', 'cpu'))
        prefix = cfg.get('prefix')
        if prefix is not None and not prefix.endswith('.'):
            prefix += '.'  # as mmengine reads it
        where = checkpoint if prefix is None else f'{checkpoint} under {prefix!r}'
        state_dict, layout = to_posattn_layout(raw, prefix=prefix, source=checkpoint)
        source = f'checkpoint {where} ({layout} layout)'
        skipped, fresh = load_pretrained(self.model, state_dict, source=source, target=name,
                                         strict=cfg.get('strict', True), ignore=('head.',), remedy=_backbone_remedy,
                                         saved_phis=saved_phi_records(raw))
        if fresh is not None:
            print_log(fresh, logger='current', level=logging.WARNING)
        if skipped:
            print_log(f'{name}: partial load (strict=False) from {source}; {len(skipped)} keys '
                      f'skipped:\n  ' + '\n  '.join(skipped), logger='current', level=logging.WARNING)
        head_keys = sorted(k for k in state_dict if k.startswith('head.'))
        loaded = ('the backbone weights that fit' if skipped else 'every other backbone weight' if fresh
                  else 'every backbone weight')
        print_log(f'{name}: loaded {loaded} from {where} ({layout} layout)'
                  + (f'; not loaded, the classifier: {", ".join(head_keys)}' if head_keys else ''),
                  logger='current', level=logging.WARNING if head_keys else logging.INFO)
        self.is_init = True


@MODELS.register_module()
class PosattnPerViT(_TokenBackbone):
    """PerViT (Min et al. 2022) as a backbone: stem, 12 columnar blocks, one stride-16 grid.

    Any input size works (mmdet pads to multiples of 32, so grids like 50 x 83 arrive): the grid
    is ceil(H/16) x ceil(W/16). For detection and segmentation at 800-1333 px, ``window_size`` and
    ``global_blocks`` select windowed peripheral attention (:class:`posattn.models.pervit.PerViT`),
    and ``with_cp`` trades compute for memory.

    Args:
        arch: 't' / 'tiny', 's' / 'small', 'm' / 'medium' (any case), or a dict with
            ``embed_dims``, ``depths``, ``num_heads`` and ``stem_dims`` (as
            :class:`posattn.models.pervit.PerViT` takes them).
        out_indices: blocks whose outputs are returned, in the order given; negative ones count
            from the end. The last block's output goes through the final LayerNorm.
        out_type: 'featmap' (B, C_i, H/16, W/16), 'avg_featmap' (B, C_i), the mean over the map
            (the classifier's pooled features), or 'raw' tokens (B, h*w, C_i). PerViT has no class
            token, so 'cls_token' is refused.
        frozen_stages: -1 or 0 train everything; k >= 1 freezes the stem, the distance embedding
            every layer's Φp reads, and the first k stages (groups of blocks of one width,
            ``depths``); k = len(depths) freezes the final norm too. Frozen parts stay in eval mode.
        norm_eval: keep the stem's BatchNorm layers in eval mode while training (frozen statistics).
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        window_size: None attends over the whole grid in every block (the classifier's
            behaviour); ws attends within ws x ws windows, Φp computed once for the window grid.
        global_blocks: blocks that attend over the whole grid when ``window_size`` is set,
            e.g. (3, 7, 11).
        with_cp: while training, recompute each block in the backward pass instead of keeping
            its activations (``torch.utils.checkpoint``, non-reentrant), Φp included.
        init_cfg: mmengine init config; ``type='Pretrained'`` reads posattn or PerViT-release
            checkpoints (``prefix`` for a part of one; the classifier is not loaded;
            ``strict=False`` for a partial load).
        phi, phi_init, phi_trainable, stem, cpe, content, phi_embedding, phi_neighbourhood,
        phi_multi_layer: the paper's ablations, as
            :class:`posattn.models.pervit.PerViT` takes them; the defaults build PerViT.

    ``out_channels`` lists the channels of each output, for necks (e.g. mmdet's FPN ``in_channels``).
    """

    ARCH_KEYS = ('embed_dims', 'depths', 'num_heads', 'stem_dims')

    def __init__(self, arch: Union[str, Mapping[str, Any]] = 'tiny', out_indices: Union[int, Sequence[int]] = -1,
                 out_type: str = 'featmap', frozen_stages: int = -1, norm_eval: bool = False,
                 drop_path_rate: float = 0.0, window_size: Optional[int] = None, global_blocks: Sequence[int] = (),
                 with_cp: bool = False, init_cfg: Optional[Union[dict, list]] = None, phi: str = 'peripheral',
                 phi_init: str = 'peripheral', phi_trainable: bool = True, stem: str = 'conv', cpe: bool = True,
                 content: bool = True, phi_embedding: str = 'euc', phi_neighbourhood: bool = True,
                 phi_multi_layer: bool = True):
        super().__init__(init_cfg=copy.deepcopy(init_cfg))
        if _check_out_type(out_type) == 'cls_token':
            raise ValueError("out_type='cls_token': PerViT has no class token; use 'avg_featmap' for the pooled "
                             "features its classifier reads, or 'featmap'")
        arch = _resolve_arch(arch, PERVIT_ARCH_ZOO, self.ARCH_KEYS)
        self.model = PerViT(**arch, num_classes=0, drop_path_rate=drop_path_rate, window_size=window_size,
                            global_blocks=global_blocks, phi=phi, phi_init=phi_init, phi_trainable=phi_trainable,
                            stem=stem, cpe=cpe, content=content, phi_embedding=phi_embedding,
                            phi_neighbourhood=phi_neighbourhood, phi_multi_layer=phi_multi_layer)
        self.stage_ends = torch.tensor(arch['depths']).cumsum(0).tolist()
        if not -1 <= frozen_stages <= len(self.stage_ends):
            raise ValueError(f'frozen_stages must be in -1..{len(self.stage_ends)} (the stages of depths '
                             f'{tuple(arch["depths"])}), got {frozen_stages}')
        self.out_indices = _resolve_out_indices(out_indices, len(self.model.blocks))
        self.out_type = out_type
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.out_channels = [self.model.blocks[i].mlp.fc2.out_features for i in self.out_indices]
        self.train()

    def _freeze_stages(self) -> None:
        if self.frozen_stages <= 0:
            return
        model = self.model
        _freeze(model.stem, getattr(model, 'distance_embedding', None),  # none without Φp
                *model.blocks[:self.stage_ends[self.frozen_stages - 1]])
        if self.frozen_stages == len(self.stage_ends):
            _freeze(model.norm)

    def train(self, mode: bool = True) -> 'PosattnPerViT':
        super().train(mode)
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, BATCH_NORMS):
                    module.eval()
        return self


@MODELS.register_module()
class PosattnViT(_TokenBackbone):
    """ViT / DeiT (posattn's :class:`~posattn.models.vit.VisionTransformer`) with any Φp.

    Args:
        arch: a name, in any case, as mmpretrain's ``VisionTransformer`` takes it: 't' / 'tiny' /
            'deit-t' / 'deit-tiny', 's' / 'small' / 'deit-s' / 'deit-small' (DeiT-S, 384 wide:
            timm's and posattn's ViT-S, not mmpretrain's 768-wide 'small'), 'b' / 'base' /
            'deit-b' / 'deit-base', 'l' / 'large', 'h' / 'huge'; or a dict with ``embed_dims``,
            ``num_layers``, ``num_heads`` and ``feedforward_channels``, as mmpretrain takes it.
        img_size: training resolution, a side or (height, width), which sizes the learned position
            embedding; a ``Pretrained`` checkpoint's of another grid is resampled to it (bicubic,
            as timm and mmpretrain do), logged.
        out_indices: blocks whose outputs are returned, in the order given; negative ones count
            from the end. The last block's output goes through the final LayerNorm.
        out_type: 'cls_token' (B, C), 'featmap' (B, C, h, w), 'avg_featmap' (B, C), the mean of
            the grid tokens, or 'raw' (B, 1 + h*w, C), all tokens, as in mmpretrain's
            ``VisionTransformer`` (whose 'avg_featmap' adds a LayerNorm after the mean, which
            posattn's ViT does not have).
        frozen_stages: -1 or 0 train everything; k >= 1 freezes the patch embedding, class token
            and position embedding and the first k blocks (and the PEGs after them); k = the
            number of blocks freezes the final norm too. Frozen parts stay in eval mode.
        norm_eval: only False: posattn's ViT normalises with LayerNorm, which keeps no running
            statistics, so there is nothing to hold in eval mode.
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        with_cp: while training, recompute each block in the backward pass instead of keeping
            its activations (``torch.utils.checkpoint``, non-reentrant), Φp included.
        init_cfg: mmengine init config; ``type='Pretrained'`` reads posattn, timm and mmpretrain
            ViT / DeiT checkpoints (``prefix`` for a part of one; the classifier is not loaded;
            ``strict=False`` for a partial load); a plain ViT / DeiT's weights leave the Φp at
            its own initialisation, logged.
        **vit_kwargs: the rest of :class:`~posattn.models.vit.VisionTransformer`'s options:
            ``phi``, ``phi_cfg``, ``phi_blocks``, ``pos_embed``, ``peg_after``, ``class_token``, ``patch_size``,
            ``init_values`` and ``no_embed_class`` (DeiT III), ...

    ``out_channels`` lists the channels of each output.
    """

    ARCH_KEYS = ('embed_dims', 'num_layers', 'num_heads', 'feedforward_channels')

    def __init__(self, arch: Union[str, Mapping[str, Any]] = 'tiny', img_size: Union[int, Tuple[int, int]] = 224,
                 out_indices: Union[int, Sequence[int]] = -1, out_type: str = 'cls_token',
                 frozen_stages: int = -1, norm_eval: bool = False, drop_path_rate: float = 0.0,
                 with_cp: bool = False, init_cfg: Optional[Union[dict, list]] = None, **vit_kwargs: Any):
        super().__init__(init_cfg=copy.deepcopy(init_cfg))
        self.out_type = _check_out_type(out_type)
        if norm_eval:
            raise ValueError('norm_eval=True: PosattnViT has no BatchNorm; its LayerNorms keep no running '
                             'statistics, so there is nothing to hold in eval mode. Leave norm_eval out, or '
                             'use frozen_stages to freeze blocks')
        arch = _resolve_arch(arch, VIT_ARCH_ZOO, self.ARCH_KEYS)
        embed_dims, hidden = arch['embed_dims'], arch['feedforward_channels']
        if int(embed_dims * (hidden / embed_dims)) != hidden:
            raise ValueError(f'feedforward_channels {hidden} is not int(embed_dims * mlp_ratio) for any mlp_ratio '
                             f'with embed_dims {embed_dims}; posattn\'s ViT sizes its MLP that way')
        if not vit_kwargs.get('class_token', True):
            vit_kwargs.setdefault('global_pool', 'avg')  # no class token to classify; the backbone has no head
        self.model = VisionTransformer(img_size=img_size, num_classes=0, drop_path_rate=drop_path_rate,
                                       embed_dim=embed_dims, depth=arch['num_layers'], num_heads=arch['num_heads'],
                                       mlp_ratio=hidden / embed_dims, **vit_kwargs)
        if out_type == 'cls_token' and self.model.cls_token is None:
            raise ValueError("out_type='cls_token' needs the class token: pass class_token=True or "
                             "out_type='avg_featmap'")
        depth = len(self.model.blocks)
        if not -1 <= frozen_stages <= depth:
            raise ValueError(f'frozen_stages must be in -1..{depth} (the number of blocks), got {frozen_stages}')
        self.out_indices = _resolve_out_indices(out_indices, depth)
        self.frozen_stages = frozen_stages
        self.with_cp = with_cp
        self.out_channels = [embed_dims] * len(self.out_indices)
        self.train()

    def _freeze_stages(self) -> None:
        if self.frozen_stages <= 0:
            return
        model = self.model
        _freeze(model.patch_embed, model.cls_token, model.pos_embed, model.pos_drop,
                *model.blocks[:self.frozen_stages],
                *[peg for i, peg in model.pegs.items() if int(i) < self.frozen_stages])
        if self.frozen_stages == len(model.blocks):
            _freeze(model.norm)
