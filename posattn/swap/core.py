"""The machinery every attention family shares: the layer that replaces a model's attention
(:class:`SwappedAttention`), and :func:`swap_attention`, which plans, builds, installs and
finishes a swap from what the families (:mod:`posattn.swap.spec`) find in a model.
"""
from __future__ import annotations

import functools
import sys
import warnings
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from ..attention import Attention, Where
from ..grid import TokenGrid
from ..layout import ImageLayout
from ..phi import PhiStack, PositionalModule, build_layer_phi
from ..phi.registry import PhiSpec, checked_phi_list
from ..unreached import warn_if_unreached
from .originals import Detached, Original, carried_keys
from .spec import (AFTER_SWAP, AttentionSite, GridSource, OwnScheme, SwapPlan, described, plans_of, refusal,
                   register_after_swap, register_family, register_refusal, register_refusal_hint)
from .token_grids import GridTracker

__all__ = ['AttentionSite', 'GridSource', 'OwnScheme', 'SwapPlan', 'SwappedAttention', 'GridTracker',
           'register_family', 'register_refusal',
           'register_refusal_hint', 'register_after_swap', 'swap_attention',
           'parameters_added_by_swap', 'load_original_weights', 'AddedParametersWarning', 'described', 'imported',
           'packs_self_attention', 'check_padding_mask']


def imported(module: str, name: str) -> Optional[Any]:
    """``module.name`` if that module is already imported, else None: a model can only be an
    instance of a class whose module is loaded, so families never import their libraries."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def packs_self_attention(mha: nn.MultiheadAttention) -> bool:
    """Whether ``mha`` holds what :meth:`SwappedAttention.take_multihead` moves into a posattn attention:
    one packed [q; k; v] projection of the embedding width, and no added key/value biases or zero
    attention, which posattn's attention does not have."""
    return mha.in_proj_weight is not None and mha.bias_k is None and not mha.add_zero_attn


class SwappedAttention(Attention):
    """:class:`posattn.Attention` inside another model, called as the module it replaced was.

    A subclass implements ``forward`` with the replaced module's signature and :meth:`take_over`,
    which moves the replaced module's submodules and parameters in (the same objects: an optimiser
    built before the swap still updates them).

    Between its arguments and its return value (a residual, layer scale, an ``(out, None)``
    pair), each forward calls :meth:`attention_output`, which computes what
    :class:`posattn.Attention` computes with the replaced module's extras at fixed places::

        q, k, v = split_heads(project_qkv(Φp.tokens(x)))        BEiT / EVA: separate q and v biases
        out     = attend(q, k, v, attn_mask, given)              Swin's shift mask
        out     = proj_drop(proj(before_projection(out, x)))     timm / EVA: sub-LN and gate

    A subclass overrides only the hooks where its model differs. The model's own relative
    positional scheme, where it is kept, is the first member of the layer's
    :class:`~posattn.phi.PhiStack` (the plan's ``own.kept``); what the model or the adapter
    computes for it each call (EVA's ``rope``, a relative position bias from the model's own
    table) is offered to :meth:`attention_output`, which passes it to the Φp that declare it.

    ``added_parameter_names``: the names (in this layer) of the parameters that the swap created,
    which the model did not hold before it (a named Φp's); see :func:`parameters_added_by_swap`.
    ``original``, ``detached``, ``frozen_by_swap``: what :func:`posattn.swap.unswap` puts back: the
    module this layer replaced, the modules beside it that a conversion detached, and the model's
    parameters that dropping its own positions froze.
    """
    grid_tracker: Optional[GridTracker] = None
    added_parameter_names: Tuple[str, ...] = ()
    original: Optional[Original] = None
    detached: Tuple[Detached, ...] = ()
    frozen_by_swap: Tuple[nn.Parameter, ...] = ()

    @classmethod
    def replacing(cls, old: nn.Module, phi: PositionalModule, site: AttentionSite) -> 'SwappedAttention':
        with torch.device('meta'):  # the layer's own projections are replaced by the old module's
            layer = cls(site.dim, site.num_heads, phi=phi, num_prefix_tokens=site.num_prefix_tokens)
        in_phi = {id(param) for param in phi.parameters()}
        placeholders = [param for param in layer.parameters() if id(param) not in in_phi]  # held: ids stay unique
        layer.take_over(old)
        left = [name for name, tensor in layer.named_parameters() if any(tensor is p for p in placeholders)]
        if left:
            raise RuntimeError(f'{cls.__name__} did not take over {", ".join(left)} from {described(old)}')
        return layer.train(old.training)

    def take_over(self, old: nn.Module) -> None:
        raise NotImplementedError

    def take(self, old: nn.Module, *names: str) -> None:
        """The same-named submodules and parameters of ``old`` become this layer's."""
        for name in names:
            setattr(self, name, getattr(old, name))

    def current_grid(self, *tensors: Optional[torch.Tensor]) -> Union[TokenGrid, ImageLayout]:
        """The grid of this call's tokens, from the model's patch embedding (:class:`GridTracker`),
        or the layout of a batch whose images each have their own grid; ``tensors``: what this call
        was given besides its input tokens (the block's input, where the model passes it), by which
        an activation-checkpointing recompute finds its grid."""
        return self.grid_tracker.grid(self.num_prefix_tokens, *tensors)

    def attention_output(self, x: torch.Tensor, *tensors: Optional[torch.Tensor],
                         attn_mask: Optional[torch.Tensor] = None, **offered: Any) -> torch.Tensor:
        """x (B, N, C) -> the layer's output (B, N, C), after the output projection and its dropout.

        Args:
            x: the tokens of this call, on :meth:`current_grid`'s grid.
            *tensors: what the call was given besides ``x`` (the block's input), passed on to
                :meth:`current_grid`.
            attn_mask: an additive mask of the logits that is not positional (Swin's shift mask),
                broadcastable to (B, heads, N, N), or None.
            **offered: what the model hands this call (EVA's ``rope``, BEiT's ``shared_rel_pos_bias``)
                or the adapter computes from the model's own parameters: the Φp receives those it
                declares as its ``call_inputs``.
        """
        where = self.current_grid(*tensors)
        if isinstance(where, ImageLayout):
            if attn_mask is not None or any(self.reads(name) for name in offered):
                raise ValueError('a swapped attention on images of different grids takes no attention mask '
                                 'and no per-call positional input: each image attends within its own grid')
            # The layout says which tokens attend to which, so the family's adapter has checked or dropped
            # the model's padding mask.
            return self.forward_layout(x, where, None, self.phi.given({}))
        return self.forward_tokens(x, self.grid_of(x, where), None, self.phi.given(self.taking(offered)),
                                   attn_mask=attn_mask)

    def forward_tokens(self, x: torch.Tensor, where: Where, key_mask: Optional[torch.Tensor],
                       given: Mapping[str, Any], attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        tokens = self.phi.tokens(x, where, **given) if self.phi.contributes('tokens') else x
        q, k, v = self.split_heads(self.project_qkv(tokens))
        out = self.attend(q, k, v, where, key_mask, attn_mask=attn_mask, given=given)
        return self.proj_drop(self.output_projection()(self.before_projection(out, x)))

    def reads(self, name: str) -> bool:
        """Whether the layer's Φp reads ``name`` given with the call: an adapter computes a term of the
        model's own scheme (a relative position bias from its table) only where one does."""
        return name in self.phi.call_inputs

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, N, C) -> (B, N, 3 * heads * d), laid out as (three, heads, d)."""
        return self.qkv(x)

    def before_projection(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output (B, N, heads * d) as ``proj`` takes it; ``x``: the layer's input."""
        return out

    def take_multihead(self, mha: nn.MultiheadAttention) -> None:
        """An ``nn.MultiheadAttention``'s projections become ``qkv`` and ``proj``: the same tensors,
        ``in_proj_weight``'s rows [q; k; v] with the heads inside, as posattn splits them (see
        :func:`packs_self_attention`); its dropout probability becomes the attention dropout's."""
        self.qkv.weight, self.qkv.bias = mha.in_proj_weight, mha.in_proj_bias
        self.proj.weight, self.proj.bias = mha.out_proj.weight, mha.out_proj.bias
        self.attn_drop.p = mha.dropout


# The latest mask found to be a layout's padding mask, in this thread or task (a dead reference: none).
_CHECKED_MASK: ContextVar[weakref.ref] = ContextVar('posattn_checked_padding_mask', default=weakref.ref(torch.empty(0)))


def check_padding_mask(attn_mask: torch.Tensor, layout: ImageLayout) -> None:
    """Raise a ValueError unless ``attn_mask`` (B, 1, L or 1, L; additive, or bool True = attend) lets
    every token of an image of the padded ``layout`` (one image a row) attend to exactly the tokens
    of its image, as a NaFlex model's padding mask does (rows of padding may hold anything). Each
    mask tensor is checked once in a thread: a model hands every layer the same one."""
    if _CHECKED_MASK.get()() is attn_mask or torch.compiler.is_compiling():
        return
    batch, length = attn_mask.shape[0], attn_mask.shape[-1]
    if len(set(layout.rows)) != layout.num_images:
        raise ValueError(f'a padding mask holds one image a row; this {layout} packs several in a row')
    if (attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] not in (1, length)
            or length != layout.length or batch < layout.num_rows):
        raise ValueError(f'a padding mask of shape {tuple(attn_mask.shape)} does not fit the {layout}')
    if attn_mask.dtype == torch.bool:
        attend, blocked = attn_mask, ~attn_mask
    else:
        attend, blocked = attn_mask == 0, attn_mask <= torch.finfo(attn_mask.dtype).min / 2
    valid = layout.valid(batch, attn_mask.device)
    keys = valid[:, None, None, :]
    queries = valid[:, None, :, None] if attn_mask.shape[2] == length else valid.new_ones(())  # (B, 1, L, 1) or all
    if not torch.where(queries, torch.where(keys, attend, blocked), True).all():
        raise ValueError('the attention mask is not the padding mask of the NaFlex batch: a swapped NaFlex model '
                         'attends within each image of its batch, and takes no other mask')
    _CHECKED_MASK.set(weakref.ref(attn_mask))


def swap_attention(model: nn.Module, phi: PhiSpec = 'peripheral', *, own_positions: bool = True,
                   **phi_cfg: Any) -> nn.Module:
    """Replace every attention module of ``model`` by :class:`posattn.Attention` with Φp ``phi``.

    The model is searched from the top: each outermost submodule that a family recognises (a timm
    model inside ``features_only`` wrappers or an OpenMMLab backbone inside a classifier,
    detector or segmentor) is swapped. Each replacement holds the very same q/k/v and projection
    parameters and a fresh Φp per layer; the token grid comes from the model's patch embedding
    at run time (any input size the model accepts), or, for window attention, from the window.

    Args:
        model: changed in place.
        phi: the Φp of every layer, by registered name; 'none' changes no output. ``'own'``
            converts the model's own relative positional scheme into the equivalent Φp, which
            takes over its weights and gives the model's outputs (EVA's and the RoPE ViTs' rotary
            embeddings -> ``rope``, Swin's and BEiT's tables -> ``rpb``, SAM's decomposed
            embeddings -> ``decomposed_rpb``, ConViT's gated attention -> ``gpsa``; docs/swap.md
            lists them); it takes no options.
        own_positions: keep the model's own positional terms (absolute embeddings, RoPE, relative
            position tables and biases) beside the Φp. With False they are dropped: absolute
            embeddings are zeroed and frozen, RoPE and relative biases no longer applied, for a
            comparison of positional schemes on equal terms. Swin's shift mask is not positional
            and is always kept. With ``phi='own'`` it applies to the absolute embeddings only.
        **phi_cfg: the Φp's options; what each layer knows (``dim``, ``num_heads``, ``head_dim``,
            ``num_prefix_tokens``, ``layer_index``, ``num_layers``) is filled in where the Φp
            takes it (:func:`posattn.phi.build_layer_phi`).

    Returns:
        ``model``. Its state dict is that of ``model`` before the swap plus each Φp's keys
        (``...attn.phi.``), and ``load_state_dict`` is torch's: weights saved after the swap load
        strictly, and weights of the model before the swap fail a strict load for want of the Φp
        keys. :func:`load_original_weights` loads those, every Φp keeping its initialisation.
        (With ``phi='own'`` the Φp holds the model's own tables under new names, and weights of
        the model before the swap load strictly: their keys are renamed on load.)

    Fine-tuning: the carried-over weights are the same ``Parameter`` objects as before, so an
    optimiser built before the swap still updates them, but the Φp's parameters are new, and
    such an optimiser never trains them. Build the optimiser after the swap, or add them with
    ``optimizer.add_param_group({'params': posattn.parameters_added_by_swap(model)})``. A swap
    that adds trainable parameters says so in one :class:`AddedParametersWarning` (a Φp
    without parameters, ``'none'`` or ``'own'`` adds none).
    """
    plans = _planned(model, own_positions)
    names, configs = _phi_names(phi, phi_cfg)
    built = _built(model, plans, names, configs, own_positions)
    _install(built)
    _finish(model, built, phi, phi_cfg, own_positions)
    return model


@dataclass(frozen=True)
class _Built:
    """What a swap builds before the model changes, so that a bad option leaves the model as it was."""
    plans: Tuple[SwapPlan, ...]
    phi_names: Tuple[str, ...]
    layers: Tuple[Tuple[AttentionSite, 'SwappedAttention'], ...]  # each site and the layer that replaces it
    trackers: Tuple[Tuple[SwapPlan, GridTracker], ...]  # each plan's grid tracker, where it has a patch projection
    installs: Tuple[Callable[[], None], ...]  # the plans' steps once every layer is in place
    converting: bool  # phi='own'


def _planned(model: nn.Module, own_positions: bool) -> List[SwapPlan]:
    """The plans of ``model``'s swappable parts, or the error that says why there are none."""
    if any(isinstance(m, SwappedAttention) for m in model.modules()):
        raise ValueError(f'the attention of {described(model)} is already swapped; posattn.unswap(model) '
                         'puts the original back, to swap in another Φp')
    plans = plans_of(model)
    if not plans:
        raise TypeError(refusal(model))
    fixed = [plan for plan in plans if plan.own.fixed is not None]
    if fixed and not own_positions:
        raise ValueError(f'own_positions=False cannot drop the positions of {fixed[0].family}: '
                         f'{fixed[0].own.fixed}; keep them (own_positions=True)')
    return plans


def _built(model: nn.Module, plans: Sequence[SwapPlan], names: Sequence[str], configs: Sequence[Any],
           own_positions: bool) -> _Built:
    """Every replacing layer, with its Φp, and each plan's grid tracker: nothing of the model changed."""
    converting = OWN in names
    if converting:
        _check_own(plans, [config for name, config in zip(names, configs) if name == OWN])
    held_before = {id(param) for param in model.parameters()}
    layers, trackers, installs = [], [], []
    for plan in plans:
        tracker = GridTracker() if plan.grid is not None else None
        for index, site in enumerate(plan.sites):
            layer = _built_layer(plan, site, index, names, configs, own_positions and not converting, held_before)
            layer.grid_tracker = tracker
            layers.append((site, layer))
            if plan.own.installed is not None:
                installs.append(functools.partial(plan.own.installed, site, layer))
        if tracker is not None:
            trackers.append((plan, tracker))
    return _Built(tuple(plans), tuple(names), tuple(layers), tuple(trackers), tuple(installs), converting)


def _built_layer(plan: SwapPlan, site: AttentionSite, index: int, names: Sequence[str], configs: Sequence[Any],
                 keep_own: bool, held_before: Set[int]) -> 'SwappedAttention':
    """The layer that replaces ``site``, the ``index``-th of ``plan``: the named Φp (or the model's own
    converted), after the model's own relative scheme where it is kept (``keep_own``)."""
    old = site.module
    reference = next(old.parameters())
    members = [plan.own.converted(site, index) if name == OWN else
               build_layer_phi(name, config, dim=site.dim, num_heads=site.num_heads,
                               num_prefix_tokens=site.num_prefix_tokens, layer_index=index,
                               num_layers=len(plan.sites)).to(reference.device, reference.dtype)
               for name, config in zip(names, configs)]
    # the model's own relative scheme, kept beside the named Φp, comes first ('none' adds nothing to it)
    kept = plan.own.kept(site, index) if keep_own else []
    if kept:
        members = kept + [member for name, member in zip(names, members) if name != NONE]
    layer = plan.adapter.replacing(old, members[0] if len(members) == 1 else PhiStack(members), site)
    _hand_own_parameters_to_phi(layer)
    if kept and len(members) > len(kept):
        _rename_named_phi_keys(layer, members[len(kept):], len(kept))
    layer.added_parameter_names = tuple(name for name, param in layer.named_parameters()
                                        if id(param) not in held_before)
    layer.original = Original(old, carried_keys(old, layer))
    return layer


def _install(built: _Built) -> None:
    """The layers in place of the sites, the trackers on the patch projections, then the plans' steps."""
    for site, layer in built.layers:
        setattr(site.parent, site.name, layer)
    for plan, tracker in built.trackers:
        tracker.attach(plan.grid.module, [site.parent for site in plan.sites], plan.grid.read)
    for install in built.installs:
        install()


def _finish(model: nn.Module, built: _Built, phi: PhiSpec, phi_cfg: Mapping[str, Any], own_positions: bool) -> None:
    """After the layers are in place: the model's own positions dropped where asked, the registered
    after-swap steps, and the warnings (parameters added, a Φp no gradient reaches)."""
    layers = [layer for _, layer in built.layers]
    if not own_positions:
        frozen = _drop_own_positions(built.plans, relative=not built.converting)
        for layer in layers:
            layer.frozen_by_swap = frozen
    for step, _ in AFTER_SWAP:
        step(model, phi, phi_cfg, own_positions)
    added = [param for param in _added_parameters(layers) if param.requires_grad]
    if added:
        warnings.warn(_added_parameters_message(model, ' + '.join(built.phi_names), added, len(layers)),
                      AddedParametersWarning, stacklevel=3)
    _warn_unreached_readouts(model, built.plans)


def _warn_unreached_readouts(model: nn.Module, plans: Sequence[SwapPlan]) -> None:
    """For each swapped model whose output reads its prefix tokens alone after its last site, a
    :class:`~posattn.UnreachedPhiWarning` where that site's Φp cannot reach them."""
    paths = {id(module): path for path, module in model.named_modules()}
    for plan in plans:
        if plan.prefix_readout is not None and plan.sites:
            readout, pooling = plan.prefix_readout
            last = plan.sites[-1]
            warn_if_unreached(paths[id(last.parent)] + ('.' if paths[id(last.parent)] else '') + last.name,
                              getattr(last.parent, last.name), readout,
                              f'Pool the grid tokens to train it ({pooling}).' if pooling else
                              'Freeze it (requires_grad_(False)) so that no optimiser moves it.', stacklevel=5)


class AddedParametersWarning(UserWarning):
    """:func:`swap_attention` added trainable parameters to a model: an optimiser built before the
    swap does not hold them. Silenced where the optimiser is always built after the swap::

        warnings.filterwarnings('ignore', category=posattn.swap.AddedParametersWarning)
    """


def parameters_added_by_swap(model: nn.Module) -> List[nn.Parameter]:
    """The parameters that :func:`swap_attention` created in ``model`` (or in its submodules,
    where they were swapped), each once, in module order: those of every named Φp, none of the
    weights the swap carried over (q/k/v, projections, and with ``phi='own'`` the model's own
    position tables and frequencies, which the Φp then holds).

    An optimiser built before the swap holds every parameter of the model but these::

        optimizer.add_param_group({'params': posattn.parameters_added_by_swap(model)})

    An empty list for a model without a swapped attention. Found by name in each swapped layer,
    so it holds for a copy of the model (``copy.deepcopy``) and after ``model.to(...)``.
    """
    return _added_parameters(module for module in model.modules() if isinstance(module, SwappedAttention))


def _added_parameters(layers: Iterable[SwappedAttention]) -> List[nn.Parameter]:
    added: Dict[int, nn.Parameter] = {}  # by id: a parameter shared among layers is listed once
    for layer in layers:
        for name in layer.added_parameter_names:
            param = layer.get_parameter(name)
            added.setdefault(id(param), param)
    return list(added.values())


def _added_parameters_message(model: nn.Module, phi: str, added: Sequence[nn.Parameter], num_layers: int) -> str:
    values = sum(param.numel() for param in added)
    parameters = 'parameter' if len(added) == 1 else 'parameters'
    layers = 'attention layer' if num_layers == 1 else f'{num_layers} attention layers'
    return (f'swap_attention added {len(added)} trainable {parameters} ({values:,} values) to {described(model)}: '
            f"the '{phi}' Φp of its {layers}. An optimizer built after the swap holds them; one built before "
            'holds the weights the swap carried over (the same parameters) but never trains these: add them with '
            "optimizer.add_param_group({'params': posattn.parameters_added_by_swap(model)})")


OWN = 'own'  # swap_attention's Φp name for the model's own positional scheme, converted
NONE = 'none'  # the Φp that adds nothing


def _phi_names(phi: PhiSpec, phi_cfg: Dict[str, Any]) -> Tuple[List[str], List[Optional[Mapping[str, Any]]]]:
    """The Φp names of every layer and their options: ``phi`` and ``**phi_cfg``, or a list of names and
    ``phi_cfg=[...]``, one option dict (or None) per name."""
    if isinstance(phi, str):
        return [phi], [phi_cfg]
    options = dict(phi_cfg)
    listed = options.pop('phi_cfg', None)
    if options:
        raise TypeError(f'options of a list of Φp go in phi_cfg=[...], one dict (or None) per Φp in order; got '
                        f'{sorted(options)} as keywords for phi={phi!r}')
    return checked_phi_list(phi, listed)


def _check_own(plans: Sequence[SwapPlan], own_configs: Sequence[Optional[Mapping[str, Any]]]) -> None:
    for plan in plans:
        if plan.own.converted is None:
            raise TypeError(f"phi='own' converts a model's own relative positional scheme into a Φp; {plan.family} "
                            'has none that posattn converts: pick a Φp by name (posattn.list_phis())')
    if len(own_configs) > 1:
        raise ValueError("phi lists 'own' more than once: the model's own scheme is converted once")
    if own_configs[0]:
        raise TypeError(f"phi='own' takes no Φp options (got {sorted(own_configs[0])}): the Φp takes the model's own "
                        'settings and weights')


def _hand_own_parameters_to_phi(layer: 'SwappedAttention') -> None:
    """After a conversion the model's own positional parameters belong to the layer's Φp alone.

    A parameter that the adapter took over from the replaced module (a relative position table)
    and that the Φp now holds leaves the adapter, so that it is saved once, under the Φp's name;
    weights saved before the swap still load: a pre-hook renames their keys. A submodule of the
    adapter all of whose state the Φp holds (a module of the model's around a table) leaves it too
    (:func:`hand_held_modules_to_phi`).
    """
    phi_names = {id(param): name for name, param in layer.phi.named_parameters()}
    renames = {}
    for name, param in list(layer.named_parameters(recurse=False)):
        if id(param) in phi_names:
            layer.register_parameter(name, None)
            renames[name] = f'phi.{phi_names[id(param)]}'
    if renames:
        layer.register_load_state_dict_pre_hook(functools.partial(_rename_keys, renames=renames))
    hand_held_modules_to_phi(layer, layer)


def hand_held_modules_to_phi(owner: nn.Module, layer: 'SwappedAttention', layer_path: str = '') -> None:
    """Detach every submodule of ``owner`` whose whole saved state is parameters that ``layer``'s Φp
    holds (set to None where it was): after ``phi='own'`` the Φp computes what the module did, from
    the same parameters, saved once under the Φp's name. Weights saved before the swap still load
    into ``owner``: a pre-hook renames the module's keys onto the Φp's (``layer_path``: the path of
    ``layer`` in ``owner``, '' where it is ``owner``). For a family whose scheme lives beside the
    attention, in the block around it (a BEiT's), call it from ``OwnScheme.installed``.
    """
    phi_names = {id(param): name for name, param in layer.phi.named_parameters()}
    inside_phi = {id(module) for module in layer.phi.modules()}
    target = f'{layer_path}.phi.' if layer_path else 'phi.'
    renames, detached = {}, {}
    for path, module in list(owner.named_modules()):
        if not path or id(module) in inside_phi or any(path.startswith(f'{done}.') for done in detached):
            continue
        params = dict(module.named_parameters())
        if not params or set(module.state_dict(keep_vars=True)) != set(params) \
                or any(id(param) not in phi_names for param in params.values()):
            continue
        parent, _, name = path.rpartition('.')
        setattr(owner.get_submodule(parent), name, None)
        detached[path] = (owner.get_submodule(parent), name, module)
        renames.update({f'{path}.{key}': target + phi_names[id(param)] for key, param in params.items()})
    handle = owner.register_load_state_dict_pre_hook(functools.partial(_rename_keys, renames=renames)) \
        if renames else None
    # unswap puts them back: their parent may be a module the layer took over, which the original holds too
    layer.detached += tuple(Detached(parent, name, Original(module, carried_keys(module, layer)), handle)
                            for parent, name, module in detached.values())


def _rename_named_phi_keys(layer: 'SwappedAttention', named: Sequence[PositionalModule], offset: int) -> None:
    """Weights saved where the named Φp were the layer's whole Φp (``phi.<key>`` for one,
    ``phi.<i>.<key>`` for a list) load into the stack that puts the model's own scheme first, where
    they are members ``offset``, ``offset + 1``, ... (``phi.<offset + i>.<key>``). Renamed from the
    last member down, so that no key is moved onto one not yet moved."""
    if len(named) == 1:
        renames = {f'phi.{key}': f'phi.{offset}.{key}' for key in named[0].state_dict()}
    else:
        renames = {f'phi.{i}.{key}': f'phi.{offset + i}.{key}'
                   for i in reversed(range(len(named))) for key in named[i].state_dict()}
    if renames:
        layer.register_load_state_dict_pre_hook(functools.partial(_rename_keys, renames=renames))


def _rename_keys(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any,
                 renames: Mapping[str, str]) -> None:
    """``load_state_dict`` pre-hook: the model's own names of what a converted Φp holds become the Φp's."""
    for old, new in renames.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


def _drop_own_positions(plans: Sequence[SwapPlan], relative: bool = True) -> Tuple[nn.Parameter, ...]:
    """Zero and freeze the absolute embeddings and, with ``relative``, freeze the relative position
    parameters (not after a conversion: the converted Φp uses and trains them); returns the
    parameters so frozen that were trainable."""
    params = [p for plan in plans for p in plan.own.absolute]
    with torch.no_grad():
        for embedding in params:
            embedding.zero_()
    if relative:
        params += [p for plan in plans for p in plan.own.relative]
    frozen = tuple({id(p): p for p in params if p.requires_grad}.values())
    for param in params:
        param.requires_grad_(False)
    return frozen


_LISTED = 5  # keys named in an error, of each kind


def load_original_weights(model: nn.Module, state_dict: Mapping[str, Any]) -> List[str]:
    """Load weights of ``model`` as it was before :func:`swap_attention` into the swapped ``model``,
    every Φp keeping its initialisation; returns the Φp keys so left, and one warning names them.

    ``model.load_state_dict(weights)`` is torch's, strict: such weights fail it for want of the Φp
    keys. This is ``model.load_state_dict(weights, strict=False)`` with one difference allowed:
    the weights hold no key of the Φp state that the swap created (``...attn.phi.``, in every
    swapped layer of ``model``, which may hold swapped models anywhere inside it) and every other
    key of ``model``, and no key besides (keys of the model before the swap for what a converted
    Φp holds are renamed on load, as ``load_state_dict`` renames them). Anything else, weights
    with some Φp keys (another Φp's, some layers', a checkpoint saved after the swap), a missing
    key outside the Φp or an unexpected key, raises a ValueError that lists them; as with torch's
    strict load the weights that fit are copied before it, and a wrong shape, or weights that record
    another Φp (:mod:`posattn.phi.record`), raises torch's RuntimeError.
    """
    fresh_by_layer = _phi_keys_added_by_swap(model)
    fresh = [key for keys in fresh_by_layer.values() for key in keys]
    result = model.load_state_dict(state_dict, strict=False)
    missing = set(result.missing_keys)
    given = [key for key in fresh if key not in missing]
    others = [key for key in result.missing_keys if key not in set(fresh)]
    if given or others or result.unexpected_keys:
        lines = [f'{described(model)}: these are not the weights of the model before its attention was swapped, '
                 'which hold every key but the Φp\'s:']
        for label, keys, count in (('Φp keys given', given, f'{len(given)} of {len(fresh)}'),
                                   ('missing keys outside the Φp', others, len(others)),
                                   ('unexpected keys', result.unexpected_keys, len(result.unexpected_keys))):
            if keys:
                lines.append(f'  {label} ({count}): {", ".join(keys[:_LISTED])}'
                             + (f', ... ({len(keys) - _LISTED} more)' if len(keys) > _LISTED else ''))
        if given == fresh and not others and not result.unexpected_keys:  # every Φp key: saved after the swap
            lines.append('  weights saved after the swap load with model.load_state_dict(weights)')
        raise ValueError('\n'.join(lines))
    if fresh:
        warnings.warn(_fresh_phis_message(model, [prefix for prefix, keys in fresh_by_layer.items() if keys],
                                          len(fresh)), stacklevel=2)
    return fresh


def _phi_keys_added_by_swap(model: nn.Module) -> Dict[str, List[str]]:
    """Each swapped attention layer's Φp in ``model`` by its key prefix ('blocks.0.attn.phi.'):
    the keys of its state that the model before the swap did not hold, relative to ``model``
    (all its parameters and buffers, but those a converted Φp took over from the model)."""
    found = {}
    for name, layer in model.named_modules():
        if isinstance(layer, SwappedAttention):
            added = {id(layer.get_parameter(added_name)) for added_name in layer.added_parameter_names}
            prefix = f'{name}.phi.' if name else 'phi.'
            found[prefix] = [prefix + key for key, tensor in layer.phi.state_dict(keep_vars=True).items()
                             if not isinstance(tensor, nn.Parameter) or id(tensor) in added]
    return found


def _fresh_phis_message(model: nn.Module, phi_prefixes: Sequence[str], num_keys: int) -> str:
    """One line naming the Φp that weights without their keys left at their initialisation."""
    names = [prefix.rstrip('.') for prefix in phi_prefixes]
    where = names[0] if len(names) == 1 else f'{names[0]} ... {names[-1]}'
    layers = 'swapped attention layer' if len(names) == 1 else f'{len(names)} swapped attention layers'
    return (f'{described(model)}: the loaded weights hold no Φp keys; the Φp of its {layers} '
            f'({where}: {num_keys} keys) keep their initialisation')
