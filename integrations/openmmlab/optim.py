"""mmengine's default optimiser-wrapper constructor with a log that states ``paramwise_cfg`` in a few lines.

Whenever a config sets ``paramwise_cfg``, mmengine's ``DefaultOptimWrapperConstructor`` logs one
INFO line per parameter and option (``paramwise_options -- backbone.model.blocks.3.norm1.bias:
weight_decay=0.0``) and one warning per frozen parameter: for PerViT-T, some 190 lines before the
first iteration. ``ParamwiseSummaryOptimWrapperConstructor`` (registered in mmengine's root
``OPTIM_WRAPPER_CONSTRUCTORS``, so every toolbox finds it) builds the same optimiser and logs
instead, at INFO, one line per distinct set of options: how many parameters get it, the multiplier
of the optimiser's ``lr`` / ``weight_decay`` it amounts to, and the parameters' names with block
numbers as ``*``; frozen parameters are one warning. mmengine's per-parameter lines still reach
the log at DEBUG (``log_level='DEBUG'`` in the config shows them)::

    optim_wrapper = dict(optimizer=dict(type='AdamW', lr=3e-4, weight_decay=0.05),
                         constructor='ParamwiseSummaryOptimWrapperConstructor',
                         paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0))
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, Iterable, List

from mmengine.logging import MMLogger, print_log
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

__all__ = ['ParamwiseSummaryOptimWrapperConstructor']

# mmengine's per-parameter records: one per option of each parameter, one per frozen parameter.
_PER_PARAMETER_RECORD = re.compile(r'^paramwise_options -- |is skipped since its requires_grad=False$')
# Options a custom key copies into the group beside the lr / weight_decay they already set.
_MULTIPLIER_KEYS = ('lr_mult', 'decay_mult')


class _PerParameterToDebug(logging.Filter):
    """Makes mmengine's per-parameter records DEBUG ones, which handlers at INFO drop."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _PER_PARAMETER_RECORD.search(record.getMessage()):
            record.levelno, record.levelname = logging.DEBUG, 'DEBUG'
        return True


def name_patterns(names: Iterable[str]) -> str:
    """Parameter names with their numbered parts as ``*``, those that differ only in the last part
    merged, in first-seen order: ``blocks.*.norm1.{weight, bias}, blocks.*.attn.qkv.bias``."""
    leaves: Dict[str, List[str]] = {}
    for name in names:
        parent, _, leaf = re.sub(r'(?<=\.)\d+(?=\.)', '*', name).rpartition('.')
        siblings = leaves.setdefault(parent, [])
        if leaf not in siblings:
            siblings.append(leaf)
    merged = (leaf[0] if len(leaf) == 1 else '{' + ', '.join(leaf) + '}' for leaf in leaves.values())
    return ', '.join(f'{parent}.{leaf}' if parent else leaf for parent, leaf in zip(leaves, merged))


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class ParamwiseSummaryOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """``DefaultOptimWrapperConstructor``, the same parameter groups, with the per-parameter log
    lines at DEBUG and a summary at INFO (see the module docstring)."""

    def add_params(self, params: List[dict], module: nn.Module, prefix: str = '', **kwargs: Any) -> None:
        if prefix:  # mmengine's recursion into the submodules
            super().add_params(params, module, prefix, **kwargs)
            return
        logger = MMLogger.get_current_instance()
        to_debug = _PerParameterToDebug()
        logger.addFilter(to_debug)
        try:
            super().add_params(params, module, prefix, **kwargs)
        finally:
            logger.removeFilter(to_debug)
        names = {id(param): name for name, param in module.named_parameters()}
        print_log(self._summary(params, names), logger='current', level=logging.INFO)
        frozen = [name for name, param in module.named_parameters() if not param.requires_grad]
        if frozen:
            print_log(f'{len(frozen)} parameters have requires_grad=False and are not optimised: '
                      f'{name_patterns(frozen)}', logger='current', level=logging.WARNING)

    def _summary(self, params: List[dict], names: Dict[int, str]) -> str:
        """One line for the config, then one per distinct set of options, largest first."""
        groups: Dict[str, List[str]] = {}
        for group in params:
            options = {k: v for k, v in group.items() if k != 'params' and k not in _MULTIPLIER_KEYS}
            groups.setdefault(self._describe(options), []).extend(names[id(p)] for p in group['params'])
        settings = ', '.join(f'{k}={v}' for k, v in sorted(self.paramwise_cfg.items()))
        lines = [f'paramwise_cfg ({settings}) on {sum(map(len, groups.values()))} parameters '
                 f'(optimizer lr={self.base_lr}, weight_decay={self.base_wd}):']
        for description, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            lines.append(f'  {len(members)} with {description}: {name_patterns(members)}')
        return '\n'.join(lines)

    def _describe(self, options: Dict[str, Any]) -> str:
        """``lr=3e-05 (x0.1), weight_decay=0 (x0)``: each option, with its multiplier of the
        optimiser's value for ``lr`` and ``weight_decay``."""
        if not options:
            return "the optimizer's settings"
        base = {'lr': self.base_lr, 'weight_decay': self.base_wd}
        parts = []
        for key, value in sorted(options.items()):
            multiplier = f' (x{value / base[key]:g})' if base.get(key) else ''
            parts.append(f'{key}={value:g}{multiplier}' if isinstance(value, float) else f'{key}={value}{multiplier}')
        return ', '.join(parts)
