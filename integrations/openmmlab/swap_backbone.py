"""``PosattnSwappedBackbone``: any supported OpenMMLab backbone, its weights loaded, with posattn's
attention and a Φp swapped in, from a config.

    model = dict(
        backbone=dict(
            type='PosattnSwappedBackbone',
            backbone=dict(type='mmdet.SwinTransformer', ...,
                          init_cfg=dict(type='Pretrained', checkpoint='checkpoints/swin_tiny.pth')),
            phi='peripheral'),
        ...)

The inner backbone is built with mmengine's registry (a type such as
``'mmpretrain.VisionTransformer'``, ``'mmseg.VisionTransformer'``, ``'mmdet.SwinTransformer'`` or
``'mmpretrain.TIMMBackbone'``; a type without a scope is looked up in the config's
``default_scope``), initialised by its own ``init_weights`` (so a ``Pretrained`` ``init_cfg``
loads the original model's weights), and then swapped with :func:`posattn.swap_attention`, all at
construction: mmengine builds the optimiser before it initialises the model, and the optimiser
must hold the new Φp parameters.
"""
from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Dict, List, Mapping, Optional

import torch
from mmengine.config import ConfigDict
from mmengine.model import BaseModule
from mmengine.registry import MODELS
from torch import nn

from posattn.swap import AddedParametersWarning, swap_attention

__all__ = ['PosattnSwappedBackbone']

_PRETRAINED_TYPES = ('Pretrained', 'Pretrained_Part')


def _pretrained_cfgs(backbone: Mapping[str, Any]) -> List[Mapping[str, Any]]:
    """The ``Pretrained`` entries of a backbone config's ``init_cfg`` (a dict or a list of them), and
    its ``pretrained`` path, which mmseg's and mmdet's backbones turn into one."""
    init_cfg = backbone.get('init_cfg')
    cfgs = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
    found = [cfg for cfg in cfgs if isinstance(cfg, Mapping) and cfg.get('type') in _PRETRAINED_TYPES]
    if isinstance(backbone.get('pretrained'), str):
        found.append(dict(type='Pretrained', checkpoint=backbone['pretrained']))
    return found


def _fingerprints(module: nn.Module) -> Dict[str, torch.Tensor]:
    """(sum, sum of squares) of each parameter in float64 on the CPU: enough to tell whether a
    parameter was written since, without a copy of the weights."""
    with torch.no_grad():
        return {name: torch.stack([p.double().sum(), p.double().square().sum()]).cpu()
                for name, p in module.named_parameters()}


@MODELS.register_module()
class PosattnSwappedBackbone(BaseModule):
    """An OpenMMLab backbone whose attention is posattn's, with Φp ``phi`` in every layer.

    Everything but the attention is the inner backbone's: its forward (``out_indices``,
    ``out_type``, ``frozen_stages``, ...), ``train(mode)`` and ``norm_eval``. The inner backbone
    sits under ``.backbone``, so the model's parameter names are the inner backbone's behind
    ``backbone.backbone.`` (and each swapped layer's Φp under ``....attn.phi.``): checkpoints of the
    swapped model load back exactly (``--resume``, ``load_from``, ``tools/test.py``).

    The weights are set at construction: the inner backbone's ``init_weights`` runs there, before
    the swap, and this module's :meth:`init_weights`, called later by the runner, changes nothing.
    The Φp parameters are new in every layer, frozen stages included, and start at their own
    initialisation.

    Args:
        backbone: the config of any backbone posattn can swap (mmpretrain's and mmseg's
            VisionTransformer, mmdet's SwinTransformer, a timm model in mmpretrain's TIMMBackbone,
            ...: :func:`posattn.swap_attention` lists the families). Its ``init_cfg`` (e.g.
            ``dict(type='Pretrained', checkpoint=...)``) is applied before the swap.
        phi: the Φp of every layer, by registered name (``posattn.list_phis()``); 'none' keeps
            the backbone's outputs.
        phi_cfg: the Φp's options (``posattn.swap_attention``'s ``**phi_cfg``).
        own_positions: keep the backbone's own positional terms beside the Φp; False zeroes and
            freezes its absolute embeddings and drops its relative position biases.
        pretrained: refused; mmseg's segmentors pass their ``model.pretrained`` here. Set the
            checkpoint in the inner backbone's ``init_cfg`` and ``model.pretrained=None``.
    """

    def __init__(self, backbone: Mapping[str, Any], phi: str = 'peripheral',
                 phi_cfg: Optional[Mapping[str, Any]] = None, own_positions: bool = True,
                 pretrained: Optional[str] = None):
        super().__init__()
        if pretrained is not None:
            raise ValueError(f'{type(self).__name__} got pretrained={pretrained!r} (a segmentor\'s model.pretrained): '
                             f"set model.pretrained=None and the inner backbone's "
                             f"init_cfg=dict(type='Pretrained', checkpoint={pretrained!r}) instead")
        backbone = ConfigDict(copy.deepcopy(dict(backbone)))
        checkpoints = [cfg.get('checkpoint', '') for cfg in _pretrained_cfgs(backbone)]
        for path in checkpoints:
            if '://' not in path and not os.path.isfile(os.path.expanduser(path)):
                raise FileNotFoundError(
                    f"{type(self).__name__}: no checkpoint at {path!r} for the {backbone.get('type')} backbone's "
                    f"Pretrained init_cfg. Put the original model's weights there, point the config at them with "
                    f"--cfg-options model.backbone.backbone.init_cfg.checkpoint=PATH, or train from scratch with "
                    f"--cfg-options model.backbone.backbone.init_cfg=None")
        self.backbone = MODELS.build(backbone)
        # TIMMBackbone marks itself initialised when timm has loaded weights (pretrained, checkpoint_path).
        loaded = bool(checkpoints) or getattr(self.backbone, 'is_init', False)
        if hasattr(self.backbone, 'init_weights') and not getattr(self.backbone, 'is_init', False):
            self.backbone.init_weights()
        if isinstance(self.backbone, BaseModule):
            self.backbone.is_init = True
        with warnings.catch_warnings():  # mmengine builds the optimiser after the model: it holds the new Φp
            warnings.simplefilter('ignore', AddedParametersWarning)
            swap_attention(self.backbone, phi, own_positions=own_positions, **dict(phi_cfg or {}))
        self._source = checkpoints[0] if checkpoints else 'its pretrained weights'
        self._loaded_weights = _fingerprints(self) if loaded else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.backbone(*args, **kwargs)

    def init_weights(self) -> None:
        """Initialises nothing: the weights were set at construction.

        A model's own ``init_cfg`` initialises every submodule of its type before the backbone's
        ``init_weights`` (mmpretrain's DeiT configs give the classifier ``TruncNormal`` on every
        ``Linear``), which would overwrite the weights loaded at construction; that is an error
        naming the weights and the fix.
        """
        if self._loaded_weights is not None:
            now = _fingerprints(self)
            changed = [name for name, before in self._loaded_weights.items()
                       if not torch.allclose(now[name], before, rtol=1e-6, atol=1e-6)]
            if changed:
                raise RuntimeError(
                    f'{len(changed)} weights of the {type(self.backbone).__name__} loaded from {self._source} were '
                    f'written again before {type(self).__name__}.init_weights, by an init_cfg of the model around '
                    f'it (e.g. TruncNormal on every Linear): set model.init_cfg=None, or give that init_cfg to the '
                    f'head alone. Changed: {", ".join(changed[:3])}' + (f' ({len(changed) - 3} more)'
                                                                       if len(changed) > 3 else ''))
            self._loaded_weights = None
        self.is_init = True
