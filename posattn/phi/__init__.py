"""Positional modules (Φp), one file each, registered by name.

Every module of this package is imported here, so a new Φp is one new file with a
``@register_phi('name')`` class: nothing else needs to change.
"""
import importlib
import pkgutil

from .base import HOOKS, PositionalModule, cache_positions
from .registry import build_layer_phi, build_phi, list_phis, phi_class, register_phi
from .stack import PhiStack

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['PositionalModule', 'HOOKS', 'PhiStack', 'cache_positions', 'register_phi', 'build_phi',
           'build_layer_phi', 'list_phis', 'phi_class']
