"""The private names of torch and torchvision that posattn reads, each behind one small function.

A private name (``_something``) may change in any release; it appears nowhere else in posattn, so
that a release that moves it breaks one function here, whose docstring says what it stands for
and which releases it is tested against. Where a public API does the same thing, posattn uses that
instead (``tests/test_compat.py`` checks both).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ['ConversionNotified', 'tensor_version', 'function_transform_active', 'cpu_flash_attention_op', 'roi_align_backward_op']


def tensor_version(tensor: torch.Tensor) -> int:
    """The count of in-place writes to ``tensor``'s storage (``Tensor._version``; ``.data`` writes
    and optimisers' ``foreach`` steps count too). Tested with torch 2.14.1."""
    return tensor._version


def function_transform_active() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is tracing the current call: its
    interpreter stack is not empty (``torch._C._functorch.peek_interpreter_stack``; a torch without
    it has no such transforms running). Tested with torch 2.14.1."""
    peek = getattr(torch._C._functorch, 'peek_interpreter_stack', None)
    return peek is not None and peek() is not None


def cpu_flash_attention_op() -> Any:
    """The ATen operator that ``F.scaled_dot_product_attention`` runs on CPU
    (``aten._scaled_dot_product_flash_attention_for_cpu``), e.g. to count its FLOPs. Tested with
    torch 2.14.1."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def roi_align_backward_op() -> Any:
    """torchvision's RoIAlign gradient kernel (``torch.ops.torchvision._roi_align_backward``):
    ``(grad_output, rois, spatial_scale, pooled_height, pooled_width, batch, channels, height,
    width, sampling_ratio, aligned) -> grad_input``, on the device of its inputs. Tested with
    torchvision 0.29.1."""
    import torchvision  # noqa: F401  (registers torch.ops.torchvision)
    return torch.ops.torchvision._roi_align_backward


class ConversionNotified(nn.Module):
    """A module whose :meth:`before_conversion` runs before each conversion of its tensors in place
    (``.to``, ``.half``, ``.double``, ``.cuda``, ...), all of which go through torch's
    ``Module._apply``, once per module of the tree. Tested with torch 2.14.1."""

    def before_conversion(self) -> None:
        """What a subclass does before its tensors are converted (nothing here)."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> 'ConversionNotified':
        self.before_conversion()
        return super()._apply(fn, *args, **kwargs)
