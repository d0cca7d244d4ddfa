"""posattn's models in timm's registry, added by :func:`posattn.register_timm_models` (importing
posattn adds nothing to timm):

    posattn.register_timm_models()
    timm.create_model('posattn_pervit_small', num_classes=10)
    timm.create_model('posattn_pervit_tiny', features_only=True, out_indices=(1, 3, 9, 11))
    timm.create_model('posattn_vit_small', phi='peripheral', pretrained=True,
                      pretrained_cfg_overlay=dict(file='deit_small_patch16_224.safetensors'))

posattn's PerViT and ViT sizes are registered as ``posattn_`` + their posattn name
(``posattn_pervit_tiny``, ``posattn_vit_small``, ...): the prefix keeps them apart from timm's own
models (timm's ``vit_small_patch16_224`` is not posattn's ``vit_small``), and
``timm.list_models('posattn_*')`` lists them. Each has a pretrained config (input size,
normalisation, crop, first convolution, classifier, paper) and timm's ``features_only`` through
``forward_intermediates``. No weights are hosted: ``pretrained=True`` takes a local file through
``pretrained_cfg_overlay=dict(file=...)``, PyTorch's or safetensors, in any layout
``posattn.create_model`` reads (the PerViT release's, posattn's, timm's and mmpretrain's DeiT /
ViT), with timm's convention for a classifier of another size (left out).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Mapping

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, is_model, model_entrypoint, register_model
from torch import nn

from .pervit import PERVIT_ARCHS, PerViT
from .registry import create_from_arch
from .vit import VIT_ARCHS, VisionTransformer

__all__ = ['TIMM_PREFIX', 'default_cfgs', 'register']

TIMM_PREFIX = 'posattn_'  # timm name = TIMM_PREFIX + posattn name

_PERVIT = dict(paper_ids='arXiv:2206.06243', paper_name='Peripheral Vision Transformer',
               origin_url='http://cvlab.postech.ac.kr/research/PerViT/')
_DEIT = dict(paper_ids='arXiv:2012.12877', license='apache-2.0',
             paper_name='Training data-efficient image transformers & distillation through attention',
             origin_url='https://github.com/facebookresearch/deit')


def _cfg(**kwargs: Any) -> Dict[str, Any]:
    """ImageNet-1k at 224, evaluated as DeiT and PerViT are: resize to 256, centre crop 224."""
    return {**dict(url='', num_classes=1000, input_size=(3, 224, 224), pool_size=(14, 14), crop_pct=0.875,
                   interpolation='bicubic', mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                   classifier='head', custom_load=True), **kwargs}


default_cfgs = generate_default_cfgs({
    **{f'{TIMM_PREFIX}pervit_{arch}': _cfg(first_conv='stem.layers.0.conv', **_PERVIT) for arch in PERVIT_ARCHS},
    **{f'{TIMM_PREFIX}vit_{arch}': _cfg(first_conv='patch_embed.proj', pool_size=None, **_DEIT) for arch in VIT_ARCHS},
})


def _build(model_class: Callable[..., nn.Module], archs: Mapping[str, Mapping[str, Any]], name: str, arch: str,
           features: Mapping[str, Any], pretrained: bool, **kwargs: Any) -> nn.Module:
    if kwargs.get('pretrained_cfg_overlay'):  # a file given here is read by posattn's loader, whatever its layout
        kwargs['pretrained_cfg_overlay'] = {'custom_load': True, **kwargs['pretrained_cfg_overlay']}
    return build_model_with_cfg(functools.partial(create_from_arch, model_class, archs, name, arch), name,
                                pretrained, feature_cfg=dict(feature_cls='getter', **features), **kwargs)


_PERVIT_STAGE_ENDS = dict(out_indices=(1, 3, 9, 11))  # the blocks where each stage's width ends
_VIT_LAST_BLOCKS = dict(out_indices=3)


def posattn_pervit_tiny(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-T (posattn): 7.6M parameters, 78.8% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'posattn_pervit_tiny', 'tiny', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


def posattn_pervit_small(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-S (posattn): 21.3M parameters, 82.1% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'posattn_pervit_small', 'small', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


def posattn_pervit_medium(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-M (posattn): 43.7M parameters, 82.9% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'posattn_pervit_medium', 'medium', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


def posattn_vit_tiny(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Tiny layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'posattn_vit_tiny', 'tiny', _VIT_LAST_BLOCKS, pretrained, **kwargs)


def posattn_vit_small(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Small layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'posattn_vit_small', 'small', _VIT_LAST_BLOCKS, pretrained, **kwargs)


def posattn_vit_base(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Base layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'posattn_vit_base', 'base', _VIT_LAST_BLOCKS, pretrained, **kwargs)


_ENTRYPOINTS = (posattn_pervit_tiny, posattn_pervit_small, posattn_pervit_medium,
                posattn_vit_tiny, posattn_vit_small, posattn_vit_base)
_REGISTERING = threading.Lock()  # two threads registering at once would both see a name missing


def register() -> List[str]:
    """Register the models above with timm (each once; calling again changes nothing) and return
    their timm names. A name timm already holds for another model is an error, never overwritten."""
    with _REGISTERING:
        for entrypoint in _ENTRYPOINTS:
            name = entrypoint.__name__
            if not is_model(name):
                register_model(entrypoint)
            elif model_entrypoint(name) is not entrypoint:
                other = model_entrypoint(name)
                raise ValueError(f'timm already has a model {name!r} ({other.__module__}.{other.__qualname__}); '
                                 f'posattn does not replace it: unregister it or build the model with '
                                 f'posattn.create_model({name[len(TIMM_PREFIX):]!r})')
    return [entrypoint.__name__ for entrypoint in _ENTRYPOINTS]
