"""Models built on :class:`posattn.Attention`, registered by name.

Every module of this package is imported here, so a new model file registers itself with
``@register_model('name')`` and nothing else needs to change.
"""
import importlib
import pkgutil

from .registry import create_model, list_models, register_model

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['create_model', 'list_models', 'register_model']
