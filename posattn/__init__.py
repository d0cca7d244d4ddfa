"""posattn: position-aware multi-head attention for vision transformers.

One attention layer (:class:`Attention`) with a pluggable positional module Φp chosen by name
from one registry (:func:`list_phis`, :func:`register_phi`, :func:`build_phi`).
"""
from . import functional
from .attention import Attention
from .grid import TokenGrid
from .layout import ImageLayout
from .positions import TokenPositions
from .models import create_model, list_models, register_model, register_timm_models
from .swap import load_original_weights, parameters_added_by_swap, swap_attention, unswap
from .phi import PhiStack, PositionalModule, build_phi, cache_positions, list_phis, register_phi
from .unreached import UnreachedPhiWarning

__version__ = '0.1.0'

__all__ = ['Attention', 'TokenGrid', 'ImageLayout', 'TokenPositions', 'PositionalModule', 'PhiStack', 'register_phi',
           'build_phi', 'list_phis',
           'create_model', 'list_models', 'register_model', 'register_timm_models', 'swap_attention', 'unswap',
           'parameters_added_by_swap', 'load_original_weights', 'cache_positions', 'UnreachedPhiWarning', 'functional',
           '__version__']
