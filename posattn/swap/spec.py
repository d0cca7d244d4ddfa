"""What a family of models tells :func:`~posattn.swap.swap_attention`, and the registry of families.

A family is one function, registered with :func:`register_family`, that looks at one module and
returns a :class:`SwapPlan` when the module is a model of its family (None otherwise, or an error
that says why such a model cannot be swapped). The plan is a frozen, keyword-only record of what
the family found: the attention modules to replace (:class:`AttentionSite`) and the adapter class
that replaces them, where the token grid comes from (:class:`GridSource`), and what the model
carries of its own positions (:class:`OwnScheme`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..phi import PositionalModule
from .token_grids import PatchGrid

__all__ = ['AttentionSite', 'GridSource', 'OwnScheme', 'SwapPlan', 'register_family', 'register_refusal',
           'register_refusal_hint', 'register_after_swap', 'described']


def described(obj: Any) -> str:
    """``module.QualName`` of an object's class, for messages."""
    return f'{type(obj).__module__}.{type(obj).__qualname__}'


@dataclass
class AttentionSite:
    """One attention module to replace: ``getattr(parent, name)``, what it attends over and how wide."""
    parent: nn.Module
    name: str
    dim: int
    num_heads: int
    num_prefix_tokens: int = 0

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.name)


@dataclass(frozen=True, kw_only=True)
class GridSource:
    """Where every site's token grid comes from: ``module``, called once per forward of the model
    (its patch projection), hooked with each site's parent block by a
    :class:`~posattn.swap.token_grids.GridTracker`.

    ``read``: how a call of ``module`` gives the grid where its output is not (B, C, H, W):
    ``read(module, args, kwargs, output)`` returns (H, W), or an :class:`~posattn.layout.ImageLayout`
    for a batch whose images each have their own grid (timm's NaFlexViT).
    """
    module: nn.Module
    read: Optional[PatchGrid] = None


def _nothing_kept(site: AttentionSite, index: int) -> List[PositionalModule]:
    return []


@dataclass(frozen=True, kw_only=True)
class OwnScheme:
    """What a model carries of its own positions, and what the swap may do with it.

    Attributes:
        absolute: the model's absolute position embeddings, zeroed and frozen when the model's own
            positions are dropped (``own_positions=False``).
        relative: the parameters of its relative position tables and bias networks, frozen when its
            own positions are dropped (kept, no longer used: no optimiser or DistributedDataParallel
            sees them as trainable).
        fixed: where the model adds absolute positions that are no parameter (a sinusoidal embedding
            computed in its forward), what they are: ``own_positions=False`` cannot drop them and is
            refused with it; None where every absolute embedding is listed in ``absolute``.
        converted: ``converted(site, index)``, the Φp that computes what the model's own relative
            scheme computes at the ``index``-th site, holding the very parameters of it (a table,
            learned frequencies), for ``phi='own'``; None where the family has no such conversion.
        kept: ``kept(site, index)``, the model's own relative scheme at the ``index``-th site as the Φp
            that apply it beside a named Φp, first in the layer's :class:`~posattn.phi.PhiStack`: most
            hold nothing and apply what the model or the adapter computes from its own parameters and
            gives with the call (:mod:`posattn.swap.given`). An empty list where there is none.
        installed: ``installed(site, layer)``, called for every site once all the layers are in place,
            for a family whose own scheme lives beside the attention (a BEiT whose table sits in the
            layer around it, handed to the layer's Φp by ``phi='own'``); None for none.
    """
    absolute: Tuple[nn.Parameter, ...] = ()
    relative: Tuple[nn.Parameter, ...] = ()
    fixed: Optional[str] = None
    converted: Optional[Callable[[AttentionSite, int], PositionalModule]] = None
    kept: Callable[[AttentionSite, int], List[PositionalModule]] = _nothing_kept
    installed: Optional[Callable[[AttentionSite, nn.Module], None]] = None  # (site, the swapped layer)

    def __post_init__(self) -> None:  # lists are taken, and absent parameters (None) left out
        object.__setattr__(self, 'absolute', tuple(p for p in self.absolute if p is not None))
        object.__setattr__(self, 'relative', tuple(p for p in self.relative if p is not None))


@dataclass(frozen=True, kw_only=True)
class SwapPlan:
    """What a family found in a model.

    Attributes:
        family: the family's name, for messages.
        sites: the attention modules, in depth order (Φp layer schedules follow it).
        adapter: the :class:`~posattn.swap.core.SwappedAttention` subclass that replaces each of them.
        grid: where the sites' token grid comes from; None where each replacement knows its grid
            (window attention).
        own: what the model carries of its own positions.
        prefix_readout: where the model's output reads its prefix tokens alone after the last site (a
            classifier of the class token): how it does, and how the model pools the grid tokens instead
            ('' where it cannot), the words of the :class:`~posattn.UnreachedPhiWarning` that names the
            last site's Φp where it gets no gradient; None where the output reads the grid tokens too.
    """
    family: str
    sites: Tuple[AttentionSite, ...]
    adapter: type
    grid: Optional[GridSource] = None
    own: OwnScheme = field(default_factory=OwnScheme)
    prefix_readout: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, 'sites', tuple(self.sites))


Family = Callable[[nn.Module], Optional[SwapPlan]]
_FAMILIES: Dict[Family, Tuple[str, ...]] = {}  # each family and the models it covers, in words
_REFUSED: Dict[str, str] = {}  # 'module.Class' of a model that cannot be swapped: why
_HINTS: List[Callable[[Sequence[str]], Optional[str]]] = []  # what to do for a model no family knows
# steps of every swap once the layers are in place, each with the step that undoes it (or None)
AFTER_SWAP: List[Tuple[Callable[..., None], Optional[Callable[[nn.Module], None]]]] = []


def register_family(find: Optional[Family] = None, *, covers: Sequence[str] = ()) -> Any:
    """Add an attention family: ``find(module)`` returns a :class:`SwapPlan` for a model of the
    family, None for any other module, and raises an error naming the reason for a model of the
    family that cannot be swapped; ``covers``: the models it swaps, in words, listed when a model
    is refused. Used as ``@register_family`` or ``@register_family(covers=(...))``."""
    def register(function: Family) -> Family:
        _FAMILIES[function] = tuple(covers)
        return function
    return register if find is None else register(find)


def register_refusal(model_class: str, reason: str) -> None:
    """A model of ``model_class`` (``'module.Class'``, matched against the classes of a model's
    modules and their bases) cannot be swapped, for ``reason``."""
    _REFUSED[model_class] = reason


def register_refusal_hint(hint: Callable[[Sequence[str]], Optional[str]]) -> None:
    """``hint(classes)``: for a model no family knows, given the ``'module.Class'`` of its modules and
    their bases, what would make it swappable (a package to import), or None."""
    _HINTS.append(hint)


def register_after_swap(step: Callable[..., None], undo: Optional[Callable[[nn.Module], None]] = None) -> None:
    """``step(model, phi, phi_cfg, own_positions)`` runs after every swap, once its layers are in
    place (a library whose models carry a config records the swap in it); ``undo(model)`` runs in
    :func:`~posattn.swap.unswap` once the original modules are back."""
    AFTER_SWAP.append((step, undo))


def plans_of(model: nn.Module) -> List[SwapPlan]:
    """The plans of the outermost modules of ``model`` that a family recognises."""
    found = [plan for plan in (find(model) for find in _FAMILIES) if plan is not None]
    if found:
        return found[:1]
    return [plan for child in model.children() for plan in plans_of(child)]


def refusal(model: nn.Module) -> str:
    """Why no family swaps ``model``: a registered refusal, a hint, or the families there are."""
    classes = {f'{cls.__module__}.{cls.__qualname__}' for m in model.modules() for cls in type(m).__mro__}
    for name, reason in _REFUSED.items():
        if name in classes:
            return f'cannot swap {name}: {reason}'
    for hint in _HINTS:
        found = hint(sorted(classes))
        if found is not None:
            return f'no supported attention in {described(model)}: {found}'
    attentions = sorted({type(m).__name__ for m in model.modules() if 'attention' in type(m).__name__.lower()})
    seen = (f' (its attention modules, {", ".join(attentions[:4])}{", ..." if len(attentions) > 4 else ""}, are '
            'of no family swap_attention knows)' if attentions else ' (it has no module named as an attention)')
    return f'no supported attention in {described(model)}{seen}; swap_attention knows {_known_models()}'


def _known_models() -> str:
    """What the registered families cover, by library: "timm's VisionTransformer, Eva; torchvision's ..."."""
    by_library: Dict[str, List[str]] = {}
    for covered in _FAMILIES.values():
        for words in covered:
            library, _, name = words.partition(' ')
            by_library.setdefault(library, []).append(name)
    return '; '.join(f'{library} {", ".join(names)}' for library, names in sorted(by_library.items()))
