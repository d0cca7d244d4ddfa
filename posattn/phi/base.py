"""The Φp contract: what a positional module may contribute to multi-head attention, declared.

Every positional module ("Φp", after PerViT's notation) is a function of the token grid that
touches attention in up to five places, its hooks. Think of it like FlexAttention's ``score_mod``:
one interface, no special cases in the attention layer.

    x    <- tokens(x, grid)                       token mixing before qkv (PEG / CPE)
    q, k <- queries_keys(q, k, grid)              rotation of queries and keys (RoPE)
    A    =  softmax(q k^T / sqrt(d) + logits_bias(q, k, grid))
    A    <- mix_probabilities(A, grid, key_mask)  probabilities mixed with positional ones (ConViT's GPSA)
    out  =  A v + value_term(A, grid)             contextual terms on values (iRPE-V)

A mixture A <- (1 - g) A + g P, affine in A, may also be given on the outputs,
``mix_outputs(A v, v, grid, key_mask) = (1 - g) A v + g P v``: where nothing else reads the
probabilities (no value term, no attention dropout while training), the layer then keeps its fused
kernel and the Φp computes P v its own way (GPSA: two 1D attentions, P being separable).

A Φp declares, in its constructor, which hooks it contributes (``hooks``), whether its logits
bias depends on the tokens (``bias_per_image``) and what it reads that another module owns
(``call_inputs``); the attention layer and its memory check read that declaration and call each
declared hook by its name, nothing else. The declaration belongs to the instance, so options can
change it (iRPE on the values alone gives no logits bias).

State a Φp shares with other modules is never an unregistered reference: it is given with each
call, as timm's Eva gives its blocks ``rope=`` and BEiT ``shared_rel_pos_bias=``. A Φp that declares
``call_inputs=('distance_embedding',)`` receives ``distance_embedding=...`` in every hook it declares,
from ``layer(x, hw, distance_embedding=...)``; its ``.to()``, ``state_dict()`` and deep copies are
then those of what it owns, which is all that its hooks read besides their arguments.

A bias that depends on the grid and the Φp's weights alone is written as :meth:`position_bias`;
the default :meth:`logits_bias` serves it through :func:`posattn.cache_positions` where a user
opened one, so that no Φp handles caching itself. What such a value is computed from, the Φp's
position inputs, is by default every parameter and buffer it holds (:meth:`position_inputs`).
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import (TYPE_CHECKING, Any, Callable, ClassVar, Dict, FrozenSet, Hashable, Iterable, Iterator, List,
                    Mapping, Optional, Tuple, Union)

import torch
from torch import nn
from torch.nn.utils import prune

from .._cache import cacheable_context
from .._compat import ConversionNotified, RecordedInStateDict
from ..grid import TokenGrid
from .cache import PositionCache, attach, attached_cache, detach
from .record import RECORD_KEY, PhiRecord, difference

if TYPE_CHECKING:
    from ..positions import TokenPositions

__all__ = ['PositionalModule', 'HOOKS', 'cache_positions']

# The hooks a Φp may contribute, in the order the attention layer calls them.
HOOKS = ('tokens', 'queries_keys', 'logits_bias', 'mix_probabilities', 'value_term')


class PositionalModule(ConversionNotified, RecordedInStateDict):
    """Base class of every Φp; subclasses register with :func:`posattn.register_phi`.

    Args:
        hooks: the hooks this Φp contributes, a subset of :data:`HOOKS`; the layer calls these and
            no others. None (not declared) is refused by the attention layer, so that a Φp whose
            declaration was forgotten fails loudly instead of contributing nothing.
        bias_per_image: its logits bias depends on the tokens, (B, heads, N, N) rather than
            (1, heads, N, N): the layer's memory check counts it once per image, and it is never cached.
        call_inputs: names of what its hooks read that it does not own (a model's shared embedding,
            a bias the model computes once for all layers), given with each call of the layer as
            keyword arguments and passed on to each declared hook.
        reaches_prefix_queries: whether what it contributes can change the output of a prefix-token
            query (a class token's); False for a bias zero, or constant along, every prefix row, and a
            mixture that leaves prefix rows as they are. Where a model reads only its prefix tokens
            after its last layer, that layer's Φp gets a gradient only if this holds
            (:mod:`posattn.unreached`).

    The hooks are called by name, not through ``forward``: module forward hooks never run on a Φp
    (tools that hook every module, such as FLOP counters, may register them), and
    ``torch.nn.utils.prune``, which recomputes its weight in one, is refused. To observe what the
    softmax sees, hook the layer's ``logits_probe``; to reparametrize a weight, use
    ``torch.nn.utils.parametrize``, which applies at every read.

    A Φp states the options that change what it computes in :meth:`settings`; its saved weights
    record them with its name (:mod:`posattn.phi.record`), and loading weights recorded for another
    Φp or other settings is refused, both named.
    """

    registered_name: ClassVar[Optional[str]] = None  # set by register_phi on the class it registers
    record_key = RECORD_KEY

    def __init__(self, hooks: Optional[Iterable[str]] = None, *, bias_per_image: bool = False,
                 call_inputs: Iterable[str] = (), reaches_prefix_queries: bool = True):
        super().__init__()
        self.reaches_prefix_queries = bool(reaches_prefix_queries)
        self.hooks: Optional[FrozenSet[str]] = None if hooks is None else self._checked_hooks(hooks)
        if not isinstance(bias_per_image, bool):
            raise TypeError(f'bias_per_image must be True or False, got {bias_per_image!r}')
        self.bias_per_image = bias_per_image
        names = (call_inputs,) if isinstance(call_inputs, str) else tuple(call_inputs)
        if isinstance(call_inputs, str) or not all(isinstance(name, str) and name.isidentifier() for name in names):
            raise TypeError(f'call_inputs is a collection of keyword names, e.g. ("distance_embedding",), '
                            f'got {call_inputs!r}')
        self.call_inputs: Tuple[str, ...] = tuple(dict.fromkeys(names))
        self._check_hooks_defined()

    def _check_hooks_defined(self) -> None:
        """A TypeError where a declared hook is not overridden (it would contribute nothing), or where
        one of its forms does not take the declared call inputs (it would fail at the first call)."""
        cls = type(self)
        for hook in sorted(self.hooks or ()):
            defined = [form for form in (hook, f'{hook}_at') if _overrides(cls, form)]
            if hook == 'logits_bias' and _overrides(cls, 'position_bias') and hook not in defined:
                defined.append('position_bias')  # the default logits_bias reads it
            if not any(form in (hook, 'position_bias') for form in defined):
                raise TypeError(f'{cls.__name__} declares the hook {hook!r} but does not define it: override '
                                f'{hook}(...)' + (' (or position_bias)' if hook == 'logits_bias' else '')
                                + ', or leave it out of hooks')
            if hook == 'mix_probabilities':  # its optional form on the outputs is called with them too
                defined += [form for form in ('mix_outputs', 'mix_outputs_at') if _overrides(cls, form)]
            for form in defined:
                missing = _not_taken(getattr(cls, form), self.call_inputs)
                if missing:
                    raise TypeError(f'{cls.__name__}.{form} does not take {", ".join(missing)}, which it declares '
                                    f'in call_inputs: every declared hook is called with them; add them as '
                                    f'keyword arguments, or **given')

    @staticmethod
    def _checked_hooks(hooks: Iterable[str]) -> FrozenSet[str]:
        if isinstance(hooks, str):
            raise TypeError(f'hooks is a collection of hook names, e.g. ({hooks!r},), not the string {hooks!r}')
        declared = frozenset(hooks)
        unknown = sorted(declared - set(HOOKS))
        if unknown:
            raise ValueError(f'unknown Φp hook(s) {unknown}; the hooks are {", ".join(HOOKS)}')
        return declared

    def given(self, inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The declared call inputs among ``inputs`` (what the layer was called with), or a TypeError
        naming the one that is missing."""
        missing = [name for name in self.call_inputs if name not in inputs]
        if missing:
            raise TypeError(f'{type(self).__name__} reads {", ".join(missing)} given with each call: pass it to '
                            f'the layer, layer(x, hw, {missing[0]}=...) (its model does)')
        return {name: inputs[name] for name in self.call_inputs}

    def contributes(self, hook: str) -> bool:
        """Whether this Φp declared ``hook`` (one of :data:`HOOKS`)."""
        return hook in self.declared_hooks()

    def declared_hooks(self) -> FrozenSet[str]:
        """The declared hooks, or a TypeError naming the fix where the Φp declared none."""
        if self.hooks is None:
            raise TypeError(f'{type(self).__name__} declares no hooks: pass the hooks it contributes to '
                            f'PositionalModule.__init__, e.g. super().__init__(hooks=("logits_bias",)); '
                            f'the hooks are {", ".join(HOOKS)}')
        return self.hooks

    @property
    def gives_logits_bias(self) -> bool:
        """Whether this Φp declared a logits bias."""
        return self.contributes('logits_bias')

    @property
    def transforms_queries_keys(self) -> bool:
        """Whether this Φp declared a transform of the queries and keys."""
        return self.contributes('queries_keys')

    @property
    def mixes_probabilities(self) -> bool:
        """Whether this Φp declared a mixture of the attention probabilities."""
        return self.contributes('mix_probabilities')

    @property
    def mixes_outputs(self) -> bool:
        """Whether this Φp's mixture has its form on the attention outputs, :meth:`mix_outputs` (and
        :meth:`mix_outputs_at` where it runs on a layout in one call)."""
        cls = type(self)
        forms = ('mix_outputs', 'mix_outputs_at') if _overrides(cls, 'mix_probabilities_at') else ('mix_outputs',)
        return self.mixes_probabilities and all(_overrides(cls, form) for form in forms)

    @property
    def needs_probabilities(self) -> bool:
        """Whether a declared hook reads the (B, heads, N, N) probabilities (a value term, or a mixture
        with no form on the outputs), which the layer then materialises (no fused kernel)."""
        return self.contributes('value_term') or (self.mixes_probabilities and not self.mixes_outputs)

    # What this Φp is: shown in its repr, recorded with its weights, checked when weights load.

    @property
    def phi_name(self) -> str:
        """The name this Φp's class is registered under (``'rope'``), or its class name if it is not."""
        return type(self).__dict__.get('registered_name') or type(self).__name__

    def settings(self) -> Dict[str, Any]:
        """The options that change what this Φp computes for given weights (not those that only
        initialise them), as plain values (str, int, float, bool, None, tuples of them)."""
        return {}

    def state_dict_record(self) -> PhiRecord:
        """What this Φp's saved weights say it is: ``{'name': phi_name, 'settings': settings()}``."""
        return {'name': self.phi_name, 'settings': self.settings()}

    def extra_repr(self) -> str:
        return ', '.join(f'{option}={value!r}' for option, value in self.settings().items())

    def record_problem(self, record: Mapping[str, Any]) -> Optional[str]:
        problem = difference(record, self.state_dict_record())
        return None if problem is None else (
            f'{problem}. Build the model with the Φp the weights were saved with; to load them into this one '
            'deliberately, load a plain copy, load_state_dict(dict(state_dict)), which carries no record')

    # The hooks: each the identity or nothing, for the Φp to override where it declares one.

    def tokens(self, x: torch.Tensor, grid: TokenGrid, **given: Any) -> torch.Tensor:
        """Transform the layer's input tokens ``x`` (B, N, C) before the qkv projection."""
        return x

    def queries_keys(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid,
                     **given: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys the logits are formed from, given the projected ones.

        Args:
            q, k: (B, heads, N, head_dim), after the layer's q/k norms, not yet scaled.
            grid: the layout of the N tokens.

        Returns:
            (q, k) of the same shapes and dtype; what the logits bias, the softmax and the analyses
            then see. A fused attention kernel still runs.
        """
        return q, k

    def logits_bias(self, q: torch.Tensor, k: torch.Tensor, grid: TokenGrid,
                    **given: Any) -> Optional[torch.Tensor]:
        """Additive bias on the attention logits.

        Args:
            q, k: (B, heads, N, head_dim), not yet scaled by head_dim ** -0.5.
            grid: the layout of the N tokens.

        Returns:
            None, or a tensor broadcastable to (B, heads, N, N) in q's dtype: (1, heads, N, N)
            for a content-independent bias, which lets kernels sum its gradient over the batch.

        By default :meth:`position_bias` in q's dtype on q's device, served by
        :func:`posattn.cache_positions` inside its block; ``given``: the declared call inputs.
        """
        return self.cached(('logits_bias', grid, q.dtype, q.device),
                           lambda: self.position_bias(grid, q.dtype, q.device, **given), given)

    def position_bias(self, grid: TokenGrid, dtype: torch.dtype, device: torch.device,
                      **given: Any) -> torch.Tensor:
        """A bias that depends on the grid, this module's position inputs and its call inputs alone,
        (1, heads, N, N) in ``dtype`` on ``device``: what the default :meth:`logits_bias` gives."""
        raise NotImplementedError(f'{type(self).__name__} declares a logits bias: override logits_bias, '
                                  'or position_bias for one that does not depend on the tokens')

    def mix_probabilities(self, attn: torch.Tensor, grid: TokenGrid,
                          key_mask: Optional[torch.Tensor] = None, **given: Any) -> torch.Tensor:
        """The attention probabilities, given the content ones ``attn`` (B, heads, N, N), rows summing
        to 1 (0 for a query with no key left); ``key_mask``: None, or a bool (B, N), False for keys
        no query may attend to, which the result must leave at 0. Rows of the result sum to 1."""
        return attn

    def mix_outputs(self, out: torch.Tensor, v: torch.Tensor, grid: TokenGrid,
                    key_mask: Optional[torch.Tensor] = None, **given: Any) -> torch.Tensor:
        """:meth:`mix_probabilities` on the outputs, for a mixture affine in the probabilities: given
        ``out`` = A v (B, heads, N, d) of the content probabilities A and the values ``v`` (B, heads,
        N, d), ``mix_probabilities(A) @ v``, computed without A. Optional (module docstring)."""
        raise NotImplementedError

    def value_term(self, attn: torch.Tensor, grid: TokenGrid, **given: Any) -> Optional[torch.Tensor]:
        """Term added to ``attn @ v``, given the probabilities ``attn`` (B, heads, N, N)."""
        return None

    # The same hooks on images of different grids in one call (:mod:`posattn.positions`): the tokens are
    # (I, M) rows, one image each, and ``positions`` says where each token lies in its image. A Φp
    # that overrides the ``_at`` form of every hook it declares (and declares no token hook, which
    # needs a 2D canvas) runs on a layout in one call; any other runs once per distinct grid.

    def queries_keys_at(self, q: torch.Tensor, k: torch.Tensor, positions: 'TokenPositions',
                        **given: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`queries_keys` on rows of images, q and k (I, heads, M, head_dim): each token as on its
        image's grid alone; what it gives at padding does not matter."""
        raise NotImplementedError

    def logits_bias_at(self, q: torch.Tensor, k: torch.Tensor, positions: 'TokenPositions',
                       **given: Any) -> Optional[torch.Tensor]:
        """:meth:`logits_bias` on rows of images: broadcastable to (I, heads, M, M), each pair of tokens
        of an image as on its grid alone, finite or -inf at every other pair (which the key mask
        removes). The layer writes -inf into a bias of every image at its padding keys: return a tensor
        of this call's own, or one kept for the layout that is -inf there already."""
        raise NotImplementedError

    def mix_probabilities_at(self, attn: torch.Tensor, positions: 'TokenPositions', key_mask: torch.Tensor,
                             **given: Any) -> torch.Tensor:
        """:meth:`mix_probabilities` on rows of images: ``attn`` (I, heads, M, M), ``key_mask`` (I, M)
        False at padding and at keys the caller masked, which the result must leave at 0."""
        raise NotImplementedError

    def mix_outputs_at(self, out: torch.Tensor, v: torch.Tensor, positions: 'TokenPositions', key_mask: torch.Tensor,
                       **given: Any) -> torch.Tensor:
        """:meth:`mix_outputs` on rows of images, ``out`` and ``v`` (I, heads, M, d), ``key_mask`` as
        :meth:`mix_probabilities_at`'s."""
        raise NotImplementedError

    def value_term_at(self, attn: torch.Tensor, positions: 'TokenPositions', **given: Any) -> Optional[torch.Tensor]:
        """:meth:`value_term` on rows of images, ``attn`` (I, heads, M, M), zero at padding keys."""
        raise NotImplementedError

    @property
    def runs_on_token_positions(self) -> bool:
        """Whether this Φp computes every hook it declares from per-token positions (the ``_at`` hooks),
        so that a layer runs a layout's images in one call; False where it needs each image's grid as a
        2D canvas (a token hook: PEG's convolution; the peripheral Φp)."""
        hooks = self.declared_hooks()
        return 'tokens' not in hooks and all(
            getattr(type(self), f'{hook}_at') is not getattr(PositionalModule, f'{hook}_at') for hook in hooks)

    def hook(self, name: str, where: Union[TokenGrid, 'TokenPositions']) -> Callable[..., Any]:
        """The declared hook ``name`` for tokens on one grid, or its ``_at`` form for rows of images."""
        return getattr(self, name if isinstance(where, TokenGrid) else f'{name}_at')

    def mixture_parts(self, grid: TokenGrid) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """For the analyses, where :meth:`mix_probabilities` mixes a positional attention in: that
        attention over the grid pairs (heads, P, P), rows summing to 1, and each head's share of it
        (heads,); None (the default) where the Φp has no such parts."""
        return None

    # Caching, owned here: a Φp states what its positions are computed from, never how to cache.

    def position_inputs(self) -> Tuple[torch.Tensor, ...]:
        """The tensors this Φp's cached position terms are computed from, as read for this call:
        every parameter and buffer it holds (a parametrized weight's original and the
        parametrization's own). A Φp that reads other tensors adds them here."""
        return (*self.parameters(), *self.buffers())

    @property
    def position_cache(self) -> Optional[PositionCache]:
        """The cache of the :func:`posattn.cache_positions` block this module is in, or None."""
        return attached_cache(self)

    def cached(self, key: Hashable, compute: Callable[[], torch.Tensor],
               given: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
        """``compute()``, a function of the grid, of :meth:`position_inputs` and of the call inputs
        ``given`` (tensors, or modules: their parameters and buffers) alone, that ``key`` (hashable:
        the grid, dtype, device and what else it depends on) tells apart, served from the cache of
        the enclosing :func:`posattn.cache_positions` block while those inputs are unchanged;
        computed at every call outside such a block."""
        if not cacheable_context():  # a compiler records the computation, never a cached value
            return compute()
        cache = attached_cache(self)
        if cache is None:
            return compute()
        inputs = self.position_inputs() + tuple(t for value in (given or {}).values() for t in _tensors_of(value))
        return cache.get(self, key, inputs, compute)

    def before_conversion(self) -> None:
        # A dtype or device conversion (.to, .half, .double, ...) may keep each weight's identity and
        # version while changing its values: nothing cached before it is served after it.
        cache = attached_cache(self)
        if cache is not None:
            cache.forget(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f'{type(self).__name__} is a Φp: the attention layer calls its hooks by name '
                        f'({", ".join(HOOKS)}), not the module; call the hook you want, e.g. '
                        'phi.logits_bias(q, k, grid) or phi.tokens(x, grid)')

    def register_forward_pre_hook(self, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # torch.nn.utils.prune recomputes the pruned weight in a forward pre-hook, which never runs on
        # a Φp: the weight would stay as it was when pruned, however training changed it.
        if isinstance(hook, prune.BasePruningMethod):
            raise TypeError(_NOT_CALLED.format(name=type(self).__name__))
        return super().register_forward_pre_hook(hook, *args, **kwargs)


def _tensors_of(value: Any) -> Tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, nn.Module):
        return (*value.parameters(), *value.buffers())
    raise TypeError(f'a cached position term reads tensors or modules, got {type(value).__name__}')


_NOT_CALLED = ('{name} is a Φp, whose hooks the attention layer calls by name: torch.nn.utils.prune recomputes '
               'its weight in a forward pre-hook, which would never run. Reparametrize the weight with '
               'torch.nn.utils.parametrize, which applies at every read (a mask is a parametrization).')


@contextmanager
def cache_positions(model: nn.Module, max_bytes: int = 1 << 30) -> Iterator[PositionCache]:
    """Reuse the position terms of ``model``'s Φp modules across calls, within ``max_bytes``.

        with posattn.cache_positions(model.eval()) as cache:
            for images in loader:
                logits = model(images)

    Inside the block, a Φp whose bias does not depend on the tokens (``peripheral``, ``rpb``,
    ``alibi``, ``irpe`` in bias mode; ``gpsa``'s positional attention, ``rope``'s learned rotation)
    computes it once per grid, dtype and device and serves it again while its position inputs are
    unchanged (:class:`~posattn.phi.cache.PositionCache` says what it checks). Leaving the block
    detaches and empties the cache, freeing its memory; ``cache.clear()`` empties it inside. Outside
    such a block nothing is cached: every call computes its bias. The modules of ``model`` as they
    are when the block opens are served; a copy made inside the block is not. Blocks on one model may
    overlap and close in any order, from any thread: the newest block still open serves, and once
    the last one closes nothing is cached for the model.
    """
    cache = PositionCache(max_bytes)
    phis = [module for module in model.modules() if isinstance(module, PositionalModule)]
    attach(phis, cache)
    try:
        yield cache
    finally:
        detach(phis, cache)
        cache.clear()


def _overrides(cls: type, name: str) -> bool:
    """Whether ``cls`` defines ``name`` (a hook or its ``_at`` form) other than PositionalModule's."""
    return getattr(cls, name, None) is not getattr(PositionalModule, name, None)


def _not_taken(hook: Callable[..., Any], call_inputs: Iterable[str]) -> List[str]:
    """The call inputs that ``hook`` takes neither by name nor through ``**kwargs``."""
    parameters = inspect.signature(hook).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return []
    named = {parameter.name for parameter in parameters
             if parameter.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return [name for name in call_inputs if name not in named]
