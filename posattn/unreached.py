"""A Φp that can never learn, said when the model is made.

A model that classifies from its class token alone (``global_pool='token'``, timm's and posattn's
ViTs) reads, of its last attention layer, only what the prefix-token queries see. A Φp there that
changes only what the grid tokens' queries see (``reaches_prefix_queries`` False: the peripheral Φp,
whose bias leaves prefix pairs out; GPSA; a bias table without prefix entries; iRPE on the keys)
then gets exactly no gradient, while weight decay still moves its parameters, so a "did it change?"
check passes. :func:`warn_if_unreached` says so once per model, naming the layer and the fix.
"""
from __future__ import annotations

import warnings
from torch import nn

__all__ = ['UnreachedPhiWarning', 'warn_if_unreached']


class UnreachedPhiWarning(UserWarning):
    """A Φp with parameters that no gradient reaches in the model as built (module docstring)."""


def warn_if_unreached(path: str, layer: nn.Module, readout: str, fix: str, stacklevel: int = 3) -> None:
    """One :class:`UnreachedPhiWarning` where the Φp of ``layer`` (at ``path``), the last attention
    layer of a model whose output then reads its prefix tokens alone (``readout``: how, in words),
    has trainable parameters and does not reach prefix-token queries; ``fix``: what to do, in words."""
    phi = layer.phi
    if phi.reaches_prefix_queries or not any(param.requires_grad for param in phi.parameters()):
        return
    warnings.warn(f'{path}.phi ({phi.phi_name}) gets no gradient: {readout}, and in the last attention layer this '
                  "Φp changes only what the grid tokens' queries see, which reach no output (weight decay still "
                  f'moves its parameters). {fix}', UnreachedPhiWarning, stacklevel=stacklevel)
