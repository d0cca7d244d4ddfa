"""``none``: no positional module, plain multi-head self-attention."""
from .base import PositionalModule
from .record import NO_POSITION
from .registry import register_phi

__all__ = ['NoPosition']


@register_phi(NO_POSITION)
class NoPosition(PositionalModule):
    """Contributes nothing: attention is softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017)."""

    def __init__(self):
        super().__init__(hooks=())
