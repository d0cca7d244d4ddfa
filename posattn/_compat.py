"""The private names of torch and torchvision that posattn reads, each behind one small function.

A private name (``_something``) may change in any release; it appears nowhere else in posattn, so
that a release that moves it breaks one function here, whose docstring says what it stands for
and which releases it is tested against. Where a public API does the same thing, posattn uses that
instead (``tests/test_compat.py`` checks both).
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional

import torch
from torch import nn

__all__ = ['ConversionNotified', 'RecordedInStateDict', 'state_dict_metadata', 'tensor_version', 'function_transform_active', 'cpu_flash_attention_op', 'roi_align_backward_op']


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


def state_dict_metadata(state_dict: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    """The per-module metadata a state dict carries, ``{module path: {'version': ..., ...}}``
    (``state_dict._metadata``, which ``nn.Module.state_dict`` writes, ``torch.save`` and
    ``torch.load(weights_only=True)`` keep, and a plain ``dict(...)`` copy drops); empty where it has
    none. Tested with torch 2.14.1."""
    return getattr(state_dict, '_metadata', None) or {}


class RecordedInStateDict(nn.Module):
    """A module that writes :meth:`state_dict_record` into its entry of the state dict's per-module
    metadata (:func:`state_dict_metadata`, under :attr:`record_key`) and, loading, reports what
    :meth:`record_problem` finds in the record it was given there as an error of
    ``load_state_dict``, strict or not (as torch reports a wrong shape). Through torch's
    ``Module._save_to_state_dict`` and ``Module._load_from_state_dict``, which mmengine 0.10.7's
    ``get_state_dict`` and ``load_state_dict`` call too. Tested with torch 2.14.1."""

    record_key: ClassVar[str] = 'record'

    def state_dict_record(self) -> Optional[Dict[str, Any]]:
        """What the module's saved weights record of it (None: nothing)."""
        return None

    def record_problem(self, record: Mapping[str, Any]) -> Optional[str]:
        """Why weights recorded as ``record`` must not load into this module; None where they may."""
        return None

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata, record = getattr(destination, '_metadata', None), self.state_dict_record()
        if metadata is not None and record is not None:  # the entry state_dict() made for this module
            metadata.setdefault(prefix[:-1], {})[self.record_key] = record

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Mapping[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        record = local_metadata.get(self.record_key)
        problem = self.record_problem(record) if isinstance(record, Mapping) else None
        if problem is not None:
            error_msgs.append(f'{prefix[:-1] or type(self).__name__}: {problem}')
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
