"""What saved weights say about the Φp they belong to, and the check that they load into the same one.

Weights of two Φp can have the same keys and shapes (``['alibi', 'rpb']`` and ``['rope', 'rpb']``;
``peg`` with and without its residual; RoPE's two axis orders), so a strict load alone cannot tell
them apart. Every Φp therefore records itself in the state dict's metadata, PyTorch's per-module
``state_dict._metadata`` (where modules keep their ``version``): under :data:`RECORD_KEY`, its
name and the settings that change what it computes (:meth:`PositionalModule.settings`)::

    {'name': 'rope', 'settings': {'frequencies': 'axial', 'axis_order': 'yx', ...}}

The record travels with the state dict through ``torch.save`` / ``torch.load`` (weights-only too)
and mmengine's checkpoints. Loading compares it with the receiving Φp and refuses a difference,
naming both; weights that carry no record (saved before Φp recorded themselves, or passed through
a plain ``dict(...)`` copy, which drops the metadata) load as they are. A layer without position
encoding (``none``) is no other Φp: its weights start any Φp, as a plain ViT's do, and any Φp's
weights load into it (their keys, where it has none, are the strict load's to report).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from .._compat import state_dict_metadata

__all__ = ['RECORD_KEY', 'PhiRecord', 'describe', 'difference', 'saved_records', 'PhiMismatch', 'mismatches']

RECORD_KEY = 'posattn_phi'
NO_POSITION = 'none'  # the name of the Φp that adds nothing

PhiRecord = Dict[str, Any]  # {'name': str, 'settings': {option: plain value}}


def _plain(value: Any) -> Any:
    """Tuples as lists, so that a record read back from JSON (a Hugging Face config) compares equal."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def describe(record: Mapping[str, Any]) -> str:
    """``rope(frequencies='axial', axis_order='xy')``: a record as the user builds it."""
    settings = ', '.join(f'{option}={value!r}' for option, value in (record.get('settings') or {}).items())
    return f'{record.get("name")}({settings})'


def difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> Optional[str]:
    """None where the Φp recorded as ``saved`` computes what the one recorded as ``current`` does: the
    same name and the same value of every setting both record (a setting one of them does not know
    is not compared), or where either is ``none``. Otherwise the difference in words."""
    if NO_POSITION in (saved.get('name'), current.get('name')):
        return None
    if saved.get('name') != current.get('name'):
        return f'the weights are those of {describe(saved)}, this Φp is {describe(current)}'
    saved_settings, current_settings = saved.get('settings') or {}, current.get('settings') or {}
    differing = [option for option in saved_settings
                 if option in current_settings and _plain(saved_settings[option]) != _plain(current_settings[option])]
    if not differing:
        return None
    return (f'the weights are those of a {saved["name"]} Φp with '
            + ', '.join(f'{option}={saved_settings[option]!r}' for option in differing)
            + ', this one has ' + ', '.join(f'{option}={current_settings[option]!r}' for option in differing))


def saved_records(state_dict: Mapping[str, Any]) -> Dict[str, PhiRecord]:
    """``{module path: record}`` of every Φp whose record ``state_dict`` carries in its metadata
    (empty for weights without metadata)."""
    return {path: dict(entry[RECORD_KEY]) for path, entry in state_dict_metadata(state_dict).items()
            if isinstance(entry, Mapping) and isinstance(entry.get(RECORD_KEY), Mapping)}


class PhiMismatch(NamedTuple):
    """A Φp of a model whose saved weights are another Φp's."""
    path: str  # the Φp's module path in the model
    problem: str  # :func:`difference`'s words


def _matching_path(path: str, saved: Mapping[str, PhiRecord]) -> Optional[str]:
    """The saved record's path for the model's Φp at ``path``: the same path, else the one path that
    ends with it (weights saved inside a wrapper: ``module.``, an OpenMMLab backbone's
    ``backbone.model.``) or that it ends with (a model inside a wrapper loading bare weights)."""
    if path in saved:
        return path
    found = [name for name in saved if path and name and (name.endswith('.' + path) or path.endswith('.' + name))]
    return found[0] if len(found) == 1 else None


def mismatches(phis: Iterable[Tuple[str, PhiRecord]], saved: Mapping[str, PhiRecord]) -> List[PhiMismatch]:
    """Those of a model's Φp, ``(module path, record)`` in module order, whose record in ``saved``
    (:func:`saved_records` of the weights) differs; a stack's members are not reported again once
    the stack is."""
    found: List[PhiMismatch] = []
    for path, record in phis:
        if any(path.startswith(reported.path + '.') for reported in found):
            continue
        match = _matching_path(path, saved)
        problem = None if match is None else difference(saved[match], record)
        if problem is not None:
            found.append(PhiMismatch(path, problem))
    return found
