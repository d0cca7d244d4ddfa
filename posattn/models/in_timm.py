"""posattn's models in timm's registry, imported with posattn when timm is installed.

    timm.create_model('pervit_small', num_classes=10)
    timm.create_model('pervit_tiny', features_only=True, out_indices=(1, 3, 9, 11))
    timm.create_model('vit_small', phi='peripheral', pretrained=True,
                      pretrained_cfg_overlay=dict(file='deit_small_patch16_224.pth'))

Every name of ``posattn.list_models()`` is registered under the same name, with a pretrained
config (input size, normalisation, crop, first convolution, classifier, paper) and timm's
``features_only`` through ``forward_intermediates``. No weights are hosted: ``pretrained=True``
takes a local file through ``pretrained_cfg_overlay=dict(file=...)``, in any layout
``posattn.create_model`` reads (the PerViT release's, posattn's, timm's and mmpretrain's DeiT /
ViT), with timm's convention for a classifier of another size (left out).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from .pervit import PERVIT_ARCHS, PerViT
from .registry import create_from_arch
from .vit import VIT_ARCHS, VisionTransformer

__all__ = ['default_cfgs']

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
    **{f'pervit_{arch}': _cfg(first_conv='stem.layers.0.conv', **_PERVIT) for arch in PERVIT_ARCHS},
    **{f'vit_{arch}': _cfg(first_conv='patch_embed.proj', pool_size=None, **_DEIT) for arch in VIT_ARCHS},
})


def _build(model_class: Callable[..., nn.Module], archs: Mapping[str, Mapping[str, Any]], name: str, arch: str,
           features: Mapping[str, Any], pretrained: bool, **kwargs: Any) -> nn.Module:
    if kwargs.get('pretrained_cfg_overlay'):  # a file given here is read by posattn's loader, whatever its layout
        kwargs['pretrained_cfg_overlay'] = {'custom_load': True, **kwargs['pretrained_cfg_overlay']}
    return build_model_with_cfg(functools.partial(create_from_arch, model_class, archs, name, arch), name,
                                pretrained, feature_cfg=dict(feature_cls='getter', **features), **kwargs)


_PERVIT_STAGE_ENDS = dict(out_indices=(1, 3, 9, 11))  # the blocks where each stage's width ends
_VIT_LAST_BLOCKS = dict(out_indices=3)


@register_model
def pervit_tiny(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-T (posattn): 7.6M parameters, 78.8% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'pervit_tiny', 'tiny', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


@register_model
def pervit_small(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-S (posattn): 21.3M parameters, 82.1% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'pervit_small', 'small', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


@register_model
def pervit_medium(pretrained: bool = False, **kwargs: Any) -> PerViT:
    """PerViT-M (posattn): 43.7M parameters, 82.9% ImageNet top-1 (paper)."""
    return _build(PerViT, PERVIT_ARCHS, 'pervit_medium', 'medium', _PERVIT_STAGE_ENDS, pretrained, **kwargs)


@register_model
def vit_tiny(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Tiny layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'vit_tiny', 'tiny', _VIT_LAST_BLOCKS, pretrained, **kwargs)


@register_model
def vit_small(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Small layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'vit_small', 'small', _VIT_LAST_BLOCKS, pretrained, **kwargs)


@register_model
def vit_base(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """posattn's DeiT-Base layout ViT, any Φp (``phi=``, ``phi_cfg=``)."""
    return _build(VisionTransformer, VIT_ARCHS, 'vit_base', 'base', _VIT_LAST_BLOCKS, pretrained, **kwargs)
