"""Models built on :class:`posattn.Attention`, registered by name.

Every module of this package is imported here, so a new model file registers itself with
``@register_model('name')`` and nothing else needs to change. timm learns of the models only when
asked (:func:`register_timm_models`, :mod:`posattn.models.timm_registration`).
"""
import importlib
import importlib.util
import pkgutil
from typing import List

from .registry import create_model, list_models, register_model

_TIMM_REGISTRATION = 'timm_registration'  # imports timm; loaded by register_timm_models only

for _module in pkgutil.iter_modules(__path__):
    if _module.name != _TIMM_REGISTRATION:
        importlib.import_module(f'{__name__}.{_module.name}')


def register_timm_models() -> List[str]:
    """Register posattn's PerViT and ViT sizes with timm as ``'posattn_' + name``
    (``posattn_pervit_tiny``, ..., ``posattn_vit_base``), so that ``timm.create_model`` and timm's
    tools build them, ``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)`` and
    ``features_only=True`` included.

    Importing posattn registers nothing with timm; this call does, once (calling it again changes
    nothing). It raises an ImportError without timm, and a ValueError if timm already holds one of
    the names for another model.

    Returns:
        The timm names, those of ``timm.list_models('posattn_*')``.
    """
    if importlib.util.find_spec('timm') is None:
        raise ImportError('register_timm_models registers posattn models with timm, which is not installed: '
                          'pip install timm')
    return importlib.import_module(f'{__name__}.{_TIMM_REGISTRATION}').register()


__all__ = ['create_model', 'list_models', 'register_model', 'register_timm_models']
