"""Models built on :class:`posattn.Attention`, registered by name.

Every module of this package is imported here, so a new model file registers itself with
``@register_model('name')`` and nothing else needs to change; with timm installed, the models are
registered with timm too (:mod:`posattn.models.in_timm`).
"""
import importlib
import importlib.util
import pkgutil

from .registry import create_model, list_models, register_model

_TIMM_REGISTRATION = 'in_timm'  # registers the models with timm, when timm is installed

for _module in pkgutil.iter_modules(__path__):
    if _module.name != _TIMM_REGISTRATION:
        importlib.import_module(f'{__name__}.{_module.name}')
if importlib.util.find_spec('timm') is not None:
    importlib.import_module(f'{__name__}.{_TIMM_REGISTRATION}')

__all__ = ['create_model', 'list_models', 'register_model']
