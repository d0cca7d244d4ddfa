"""Swap posattn's attention, with any Φp, into Vision Transformers people already have, keeping
their weights.

    model = timm.create_model('deit_small_patch16_224', pretrained=True)
    swap_attention(model, phi='peripheral')          # then build the optimiser and fine-tune
    unswap(model, drop_phi=True)                     # timm's own classes again, with the tuned weights

One family a module (``timm_vit``, ``torchvision_vit``, ...), each a small
:class:`~posattn.swap.core.SwappedAttention` subclass called as the module it replaces (it supplies
what its model does around posattn's attention), and a function registered with
:func:`register_family` that finds those modules in a model. The OpenMMLab families register from
``posattn_openmmlab``.
"""
import importlib
import pkgutil

from .core import (AddedParametersWarning, AttentionSite, GridSource, OwnScheme, SwapPlan, SwappedAttention,
                   load_original_weights, parameters_added_by_swap, register_family, register_refusal, swap_attention)
from .hf_pretrained import from_pretrained  # a swapped Hugging Face model, saved and back
from .unswap import unswap

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ('core', 'spec', 'originals', 'unswap'):
        importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['swap_attention', 'unswap', 'parameters_added_by_swap', 'load_original_weights', 'AddedParametersWarning',
           'from_pretrained', 'register_family', 'register_refusal', 'SwapPlan', 'GridSource', 'OwnScheme',
           'AttentionSite', 'SwappedAttention']
