"""Model names -> builders, behind ``posattn.create_model`` (timm's entry-point pattern)."""
from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import nn

from ..attention import Attention
from ..convert import read_checkpoint, saved_phi_records, to_posattn_layout
from ..phi import PositionalModule
from ..phi.record import PhiMismatch, PhiRecord, mismatches, saved_records
from ..unreached import warn_if_unreached
from .pos_embed import resample_abs_pos_embed, square_grid

__all__ = ['register_model', 'create_model', 'create_from_arch', 'list_models', 'load_weights',
           'load_pretrained', 'load_checkpoint', 'fitting_model', 'state_dict_mismatch', 'other_phis']

_MODELS: Dict[str, Callable[..., nn.Module]] = {}
_LISTED = 8  # keys shown per kind of mismatch

Builder = TypeVar('Builder', bound=Callable[..., nn.Module])
Shapes = Dict[str, Tuple[int, ...]]


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator that makes a builder function available to :func:`create_model` as ``name``."""
    def add(builder: Builder) -> Builder:
        if name in _MODELS and _MODELS[name] is not builder:
            raise ValueError(f'model name {name!r} is already registered by {_MODELS[name].__qualname__}')
        _MODELS[name] = builder
        _default_shapes.cache_clear()
        return builder
    return add


def create_from_arch(model_class: Callable[..., nn.Module], archs: Mapping[str, Mapping[str, Any]], name: str,
                     arch: str, device: Optional[Union[str, torch.device]] = None, dtype: Optional[torch.dtype] = None,
                     **kwargs: Any) -> nn.Module:
    """``model_class(**archs[arch], **kwargs)``, the builder of the registered model ``name``.

    The sizes the arch sets cannot be passed again; a different size is a different model.

    Args:
        device: where the parameters and buffers are created (timm's ``device``): the model is
            built under ``torch.device(device)``, so ``'meta'`` allocates nothing and ``'cuda'``
            nothing on the CPU first. None: PyTorch's default device.
        dtype: the floating dtype of the parameters and buffers (timm's ``dtype``), cast to once
            the model is built on ``device``. None: PyTorch's default dtype.
    """
    fixed = sorted(set(kwargs) & set(archs[arch]))
    if fixed:
        raise TypeError(f'{", ".join(fixed)}: set by the model name {name!r}; build {model_class.__name__} '
                        f'directly to change it')
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = model_class(**archs[arch], **kwargs)
    return model if dtype is None else model.to(dtype=dtype)


def list_models() -> List[str]:
    """Names of the registered models, sorted."""
    return sorted(_MODELS)


def create_model(name: str, checkpoint: Optional[Union[str, os.PathLike]] = None, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` with the builder's keyword arguments.

    Args:
        name: a registered model (``posattn.list_models()``).
        checkpoint: path of weights to load (a PyTorch file or a safetensors one), in posattn's
            layout (timm's, for ViT / DeiT) or one that :func:`posattn.convert.to_posattn_layout`
            recognises (the PerViT release's, mmpretrain's ViT / DeiT, and the classifiers that
            ``tools/train.py`` writes through mmengine), as a state_dict or a training checkpoint
            holding it. Read weights-only
            (:func:`posattn.convert.read_checkpoint`) and loaded strictly by :func:`load_pretrained`:
            weights without the model's Φp (a plain ViT / DeiT's) leave the Φp at its own
            initialisation, with a warning naming those keys; any other key that does not fit
            raises a ValueError listing the missing, unexpected and mis-shaped keys and naming the
            registered model the weights fit.
        **kwargs: the builder's options (``num_classes``, ``phi``, ``drop_path_rate``, ...).

    A model that classifies from its class token with a Φp in its last block that no gradient
    reaches there (:mod:`posattn.unreached`) is built, with one :class:`~posattn.unreached.UnreachedPhiWarning`.
    """
    try:
        builder = _MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f'unknown model {name!r}; known: {", ".join(list_models()) or "none"}') from None
    contents = read_checkpoint(checkpoint) if checkpoint is not None else None
    model = builder(**kwargs)
    if contents is not None:
        _load_read_checkpoint(model, contents, os.fspath(checkpoint), target=name)
    layers = [(path, module) for path, module in model.named_modules() if isinstance(module, Attention)]
    if layers and getattr(model, 'global_pool', None) == 'token':
        warn_if_unreached(*layers[-1], "the model classifies from its class token (global_pool='token')",
                          "Pool the tokens to train it, global_pool='avg'; or give that block no Φp, "
                          'phi_blocks=range(depth - 1)')
    return model


def load_checkpoint(model: nn.Module, checkpoint: Union[str, os.PathLike], *, target: str,
                    classifier_may_differ: bool = False) -> None:
    """Load a checkpoint file into ``model`` as :func:`create_model` does (any layout it reads,
    weights-only, strictly, a plain ViT's weights leaving the Φp fresh, with a warning).

    With ``classifier_may_differ`` (timm's convention for pretrained weights) a classifier whose
    size is not the model's is left out, with a warning that gives both sizes, instead of failing.
    """
    _load_read_checkpoint(model, read_checkpoint(checkpoint), os.fspath(checkpoint), target=target,
                          classifier_may_differ=classifier_may_differ)


def _load_read_checkpoint(model: nn.Module, contents: Any, path: str, *, target: str,
                          classifier_may_differ: bool = False) -> None:
    """Load ``contents``, the checkpoint read from ``path`` (any layout
    :func:`posattn.convert.to_posattn_layout` recognises), into ``model``."""
    state_dict, layout = to_posattn_layout(contents)
    source = f'checkpoint {path} ({layout} layout)'
    ignore: Tuple[str, ...] = ()
    head = getattr(model, 'head', None)
    found = tuple(state_dict['head.weight'].shape) if 'head.weight' in state_dict else None
    if classifier_may_differ and found is not None and (
            not isinstance(head, nn.Linear) or tuple(head.weight.shape) != found):
        ignore = ('head.',)
        theirs, ours = _classifier_sizes(found, head)
        warnings.warn(f'{target}: the classifier of {source} ({theirs}) is not loaded: the model has {ours}',
                      stacklevel=3)
    _, report = load_pretrained(model, state_dict, source=source, target=target, ignore=ignore,
                                saved_phis=saved_phi_records(contents))
    if report is not None:
        warnings.warn(report, stacklevel=3)


def _classifier_sizes(found: Tuple[int, ...], head: Optional[nn.Module]) -> Tuple[str, str]:
    """(a checkpoint's classifier, whose weight has the shape ``found``, the model's ``head``) in
    words: '1000 classes' and '10 classes'; with the weights' shapes where the numbers of classes are
    the same; 'no classifier (num_classes=0)' for a model without one."""
    classes = found[0]
    if head is None or isinstance(head, nn.Identity):
        return f'{classes} classes', 'no classifier (num_classes=0)'
    if not isinstance(head, nn.Linear):
        return f'{classes} classes', f'a {type(head).__name__} as its head, not a linear classifier'
    if head.out_features != classes:
        return f'{classes} classes', f'{head.out_features} classes'
    return f'{classes} classes, weight {found}', f'{head.out_features} classes, weight {tuple(head.weight.shape)}'


@functools.lru_cache(maxsize=None)
def _default_shapes(name: str) -> Optional[Shapes]:
    try:
        with torch.device('meta'):  # shapes only: no memory, no initialisation cost
            model = _MODELS[name]()
    except Exception:  # a builder that needs arguments cannot be recognised from a checkpoint
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def fitting_model(state_dict: Mapping[str, Any]) -> Optional[str]:
    """The registered model (default options) whose keys and shapes are ``state_dict``'s (in
    posattn's layout) outside the classifier, or None. Weights without a classifier (a backbone's)
    fit too."""
    def body(shapes: Shapes) -> Shapes:
        return {k: v for k, v in shapes.items() if not k.startswith('head.')}
    found = body({k: tuple(getattr(v, 'shape', ())) for k, v in state_dict.items()})
    for name in list_models():
        expected = _default_shapes(name)
        if expected is not None and body(expected) == found:
            return name
    return None


def _listed(label: str, items: List[str]) -> str:
    more = f'; ... ({len(items) - _LISTED} more)' if len(items) > _LISTED else ''
    return f'  {label} ({len(items)}): {"; ".join(items[:_LISTED])}{more}'


def state_dict_mismatch(model: nn.Module, state_dict: Mapping[str, Any],
                        ignore: Sequence[str] = ()) -> Tuple[List[str], List[str], List[str]]:
    """(missing, unexpected, wrong-shape) keys of ``state_dict`` against ``model``'s, leaving out
    keys that start with any prefix in ``ignore``."""
    def kept(key: str) -> bool:
        return not any(key.startswith(prefix) for prefix in ignore)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if kept(k)}
    found = {k: tuple(getattr(v, 'shape', ())) for k, v in state_dict.items() if kept(k)}
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    wrong = [k for k in expected if k in found and found[k] != expected[k]]
    return missing, unexpected, wrong


def _create_model_remedy(name: str) -> str:
    return f'create_model({name!r}, checkpoint=...)'


_LAYER_SCALE = re.compile(r'\.ls[12]\.gamma$')


def _deit3_hint(model: nn.Module, state_dict: Mapping[str, Any], missing: Sequence[str],
                unexpected: Sequence[str]) -> Optional[str]:
    """What to build when DeiT III's options (layer scale, no position embedding for the class
    token) differ between the weights and the model; None when they do not."""
    layer_scale = any(_LAYER_SCALE.search(k) for k in unexpected)
    target = getattr(model, 'pos_embed', None)
    found = state_dict.get('pos_embed')
    no_class_entry = (isinstance(target, torch.Tensor) and isinstance(found, torch.Tensor) and found.dim() == 3
                      and found.shape != target.shape and not getattr(model, 'no_embed_class', False)
                      and getattr(model, 'num_prefix_tokens', 0) > 0 and square_grid(found.shape[1]) is not None)
    if layer_scale and no_class_entry:
        return ("these weights have layer scale (ls1.gamma, ls2.gamma) and a position embedding without the class "
                "token: DeiT III's; build the model with init_values=1e-6 (or any value: the weights set it) and "
                'no_embed_class=True')
    if layer_scale:
        return ('these weights have layer scale (ls1.gamma, ls2.gamma): build the model with init_values=1e-6 '
                '(or any value: the weights set it)')
    if no_class_entry:
        return (f'their pos_embed {tuple(found.shape)} has no entry for the class token (DeiT III\'s layout): build '
                f'the model with no_embed_class=True')
    if any(_LAYER_SCALE.search(k) for k in missing):
        return 'the model has layer scale (init_values) and these weights do not: build it without init_values'
    return None


def other_phis(model: nn.Module, saved_phis: Mapping[str, PhiRecord]) -> List[PhiMismatch]:
    """The Φp of ``model`` whose weights, as ``saved_phis`` records them, are another Φp's (another
    name, or settings that compute otherwise): :mod:`posattn.phi.record`."""
    return mismatches(((path, module.state_dict_record()) for path, module in model.named_modules()
                       if isinstance(module, PositionalModule)), saved_phis)


def load_weights(model: nn.Module, state_dict: Mapping[str, Any], *, source: str, target: str,
                 strict: bool = True, ignore: Sequence[str] = (),
                 remedy: Optional[Callable[[str], str]] = _create_model_remedy,
                 saved_phis: Optional[Mapping[str, PhiRecord]] = None) -> List[str]:
    """Load ``state_dict`` (posattn's layout) into ``model``; the one place posattn checks a fit.

    Args:
        source: what the weights are, for messages (e.g. 'checkpoint x.pth (posattn layout)').
        target: what receives them, for messages (a model name or a class).
        strict: with True, any missing, unexpected or mis-shaped key raises a ValueError that
            lists them and names the registered model the weights fit, if one does. With False,
            every key that fits is loaded and the others are skipped.
        ignore: key prefixes left out on both sides (e.g. ``('head.',)``: not loaded, not checked).
        remedy: given the registered model the weights fit, what to do instead, for the error
            (default: the ``create_model`` call that loads them); None leaves that line out.
        saved_phis: what the weights' Φp are (:func:`posattn.convert.saved_phi_records` of the
            checkpoint as saved, before its keys were converted); by default ``state_dict``'s own
            records. A Φp of ``model`` whose weights are another Φp's is an error with ``strict``;
            without, its weights are skipped.

    Returns:
        The keys that were not loaded, each with the reason ('missing: ...', 'unexpected: ...',
        'wrong shape: ...', 'other Φp: ...'); empty when everything fit.
    """
    others = other_phis(model, saved_records(state_dict) if saved_phis is None else saved_phis)
    if not strict:  # the weights of another Φp are not loaded into this one
        ignore = (*ignore, *(other.path + '.' for other in others))
    missing, unexpected, wrong = state_dict_mismatch(model, state_dict, ignore)
    model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f'{k}: checkpoint {tuple(state_dict[k].shape)}, model {model_shapes[k]}' for k in wrong]
    if strict and (missing or unexpected or wrong or others):
        lines = [f'{source} does not fit {target}:']
        fitting = fitting_model(state_dict) if remedy is not None else None
        if fitting is not None and fitting != target:
            lines.append(f'  this is a {fitting} checkpoint: {remedy(fitting)}')
        elif wrong and not (missing or unexpected or others) and all(k.startswith('head.') for k in wrong) \
                and 'head.weight' in state_dict:
            lines.append(f'  only the classifier differs: pass num_classes={state_dict["head.weight"].shape[0]}')
        elif 'dist_token' in unexpected:
            lines.append("  these are a distilled DeiT's weights (dist_token, head_dist): posattn's ViT has a class "
                         'token only; start from the DeiT weights without distillation')
        elif (hint := _deit3_hint(model, state_dict, missing, unexpected)) is not None:
            lines.append('  ' + hint)
        elif others and not (missing or unexpected or wrong):
            lines.append('  its Φp are others than the model\'s: build the model with the Φp (and options) the weights '
                         'were saved with')
        mismatched_phis = [f'{other.path}: {other.problem}' for other in others]
        for label, items in (('missing keys', missing), ('unexpected keys', unexpected), ('wrong shapes', wrong),
                             ('other Φp', mismatched_phis)):
            if items:
                lines.append(_listed(label, items))
        raise ValueError('\n'.join(lines))
    loadable = {k: v for k, v in state_dict.items()
                if k in model_shapes and tuple(v.shape) == model_shapes[k] and not any(k.startswith(p) for p in ignore)}
    model.load_state_dict(loadable, strict=False)
    return ([f'missing: {k}' for k in missing] + [f'unexpected: {k}' for k in unexpected]
            + [f'wrong shape: {entry}' for entry in wrong] + [f'other Φp: {o.path}: {o.problem}' for o in others])


def _positional_prefixes(model: nn.Module) -> List[str]:
    """``'name.'`` of each of ``model``'s outermost positional modules that holds parameters or
    buffers: each attention layer's Φp (``blocks.{i}.attn.phi.``), a ViT's PEGs (``pegs.{i}.``),
    PerViT's CPEs (any :class:`posattn.PositionalModule`)."""
    prefixes: List[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(prefix) for prefix in prefixes)
        if name and not inside and isinstance(module, PositionalModule) and module.state_dict():
            prefixes.append(name + '.')
    return prefixes


def _index_range(indices: Sequence[int]) -> str:
    """[3] -> '3'; [0, ..., 11] -> '{0..11}'; [0, 2, 5] -> '{0,2,5}'."""
    if len(indices) == 1:
        return str(indices[0])
    if list(indices) == list(range(indices[0], indices[-1] + 1)):
        return f'{{{indices[0]}..{indices[-1]}}}'
    return '{' + ','.join(map(str, indices)) + '}'


def _compact_keys(keys: Sequence[str], prefixes: Sequence[str]) -> str:
    """``keys``, each under one of ``prefixes``, written once per kind of module: modules that
    differ only in their first index and hold the same keys share one entry,
    e.g. 'blocks.{0..11}.attn.phi.{proj1_weight, proj1_bias}, pegs.0.{proj.weight, proj.bias}'."""
    groups: Dict[Tuple[str, str, Tuple[str, ...]], List[int]] = {}
    for prefix in prefixes:
        names = tuple(k[len(prefix):] for k in keys if k.startswith(prefix))
        indexed = re.fullmatch(r'(.*?\.)?(\d+)(\..*)', prefix)
        if indexed is None:
            groups[(prefix, '', names)] = []
            continue
        head, index, tail = indexed.groups(default='')
        groups.setdefault((head, tail, names), []).append(int(index))
    return ', '.join(head + (_index_range(sorted(indices)) if indices else '') + tail
                     + (names[0] if len(names) == 1 else '{' + ', '.join(names) + '}')
                     for (head, tail, names), indices in groups.items())


def _resampled_pos_embed(model: nn.Module, state_dict: Mapping[str, Any]) -> Tuple[Mapping[str, Any], Optional[str]]:
    """``state_dict`` with its learned position embedding resampled to ``model``'s grid when it was
    learned on another one (timm's ``checkpoint_filter_fn``: the checkpoint's grid taken square,
    bicubic, the prefix tokens' embeddings kept), and a note saying so; unchanged, and None, when
    it fits already or cannot be resampled (another width, a grid that is not square), which
    loading then reports as a wrong shape."""
    target = getattr(model, 'pos_embed', None)
    found = state_dict.get('pos_embed')
    if not (isinstance(target, torch.Tensor) and isinstance(found, torch.Tensor) and hasattr(model, 'grid_size')):
        return state_dict, None
    if found.shape == target.shape or found.dim() != 3 or found.shape[0] != 1 or found.shape[2] != target.shape[2]:
        return state_dict, None
    num_prefix_tokens = 0 if getattr(model, 'no_embed_class', False) else getattr(model, 'num_prefix_tokens', 0)
    old_size = square_grid(found.shape[1] - num_prefix_tokens)
    if old_size is None:
        return state_dict, None
    new_size = tuple(model.grid_size)
    resampled = resample_abs_pos_embed(found, new_size, old_size, num_prefix_tokens)
    kept = f', {num_prefix_tokens} prefix token{"s" * (num_prefix_tokens != 1)} kept' if num_prefix_tokens else ''
    note = (f'its pos_embed {tuple(found.shape)} is resampled from a {old_size[0]}x{old_size[1]} grid to the '
            f'model\'s {new_size[0]}x{new_size[1]} {tuple(resampled.shape)} (bicubic{kept})')
    return {**state_dict, 'pos_embed': resampled}, note


def load_pretrained(model: nn.Module, state_dict: Mapping[str, Any], *, source: str, target: str,
                    strict: bool = True, ignore: Sequence[str] = (),
                    remedy: Optional[Callable[[str], str]] = _create_model_remedy,
                    saved_phis: Optional[Mapping[str, PhiRecord]] = None) -> Tuple[List[str], Optional[str]]:
    """:func:`load_weights` for starting a model from weights of one without its position encoding:
    a plain ViT / DeiT's (timm's or mmpretrain's, converted) into a ViT with any Φp.

    Two differences are allowed, each reported:

    - weights that hold no key of the model's positional modules (each attention layer's Φp,
      under ``blocks.{i}.attn.phi.``, and a ViT's PEGs, under ``pegs.{i}.``: every
      :class:`posattn.PositionalModule` with parameters or buffers) leave all of them at their
      own initialisation; where the weights record their Φp, it is ``none``. Weights that hold some (those of another Φp, or of some layers only)
      are not a plain ViT's and load strictly, so that the other Φp's keys, or the ones left out,
      are an error.
    - a model built without a learned position embedding (``pos_embed`` is None, as in posattn's
      ViT with ``pos_embed=False``, CPVT's setting) drops the weights' ``pos_embed``.
    - a learned position embedding of another grid (weights trained at 224 in a model built for
      384 or (384, 256)) is resampled to the model's ``grid_size`` as timm and mmpretrain do when
      they load weights: the weights' grid taken square, bicubic with antialiasing, the prefix
      tokens' embeddings kept (:func:`posattn.models.pos_embed.resample_abs_pos_embed`). One of
      another width stays a wrong shape.

    Everything else is :func:`load_weights` with the same arguments: with ``strict``, any other
    missing, unexpected or mis-shaped key raises.

    Returns:
        (the keys not loaded, as :func:`load_weights` returns them; one line that names the keys
        that started fresh, the dropped ``pos_embed`` and the resampled one, or None when there are
        none).
    """
    prefixes = _positional_prefixes(model)
    has_positional = any(key.startswith(tuple(prefixes)) for key in state_dict)
    fresh_prefixes = [] if has_positional else prefixes
    dropped = 'pos_embed' in state_dict and hasattr(model, 'pos_embed') and model.pos_embed is None
    kept = {k: v for k, v in state_dict.items() if not (dropped and k == 'pos_embed')}
    kept, resampled = _resampled_pos_embed(model, kept)
    skipped = load_weights(model, kept, source=source, target=target, strict=strict,
                           ignore=(*ignore, *fresh_prefixes), remedy=remedy,
                           saved_phis=saved_records(state_dict) if saved_phis is None else saved_phis)
    fresh = [k for k in model.state_dict() if k.startswith(tuple(fresh_prefixes))]
    parts = []
    if fresh:
        parts.append(f'{len(fresh)} Φp keys are not in it and start from their own initialisation: '
                     f'{_compact_keys(fresh, fresh_prefixes)}')
    if dropped:
        parts.append('its pos_embed is not loaded: the model has no learned position embedding (pos_embed=False)')
    if resampled is not None:
        parts.append(resampled)
    return skipped, (f'{target} from {source}: ' + '; '.join(parts)) if parts else None
