"""The keys a set of config overrides (``--cfg-options``, a study row's ``options``) sets, checked
against what reads them.

mmengine merges any key into a config: a misspelt one (``phii=rope``, ``train_cfg.max_epoch=1``)
is added beside the key it meant, nothing reads it, and the run trains the config's default.
:func:`option_key_problems` names each key that nothing would read, with the nearest key that
something does (difflib). A key is read when

* its whole dotted path is in the config (list items by their index: ``pipeline.1.scale``);
* it is new in a dict with a ``type`` (an object a registry builds) whose registered class takes it
  as a keyword, or takes ``**kwargs``; or the builder takes it out before calling the class
  (:data:`BUILDER_KEYS`). The class is looked up in the registries of the dict's ``_scope_``, else
  the config's ``default_scope`` (``mmpretrain``, ``mmdet``, ``mmseg``), as mmengine builds it;
* it is new in one of the Runner's dicts without a type, whose reader is known: the loops of
  ``train_cfg``, ``val_cfg`` and ``test_cfg``, the data loaders, ``optim_wrapper``,
  ``log_processor``, ``randomness``, ``env_cfg``, ``auto_scale_lr``, and ``default_hooks`` (where a
  new name is one of mmengine's default hooks, or a hook given whole, with its type);
* it is a new top-level key that mmengine's Runner or ``PosattnRunner`` reads
  (:data:`RUNNER_KEYS`), or one the caller names (the tools' own).

Not checked, for want of a reader to ask: a new key in any other dict without a type (``phi_cfg``,
``paramwise_cfg``, ``model.train_cfg``: the class that takes the dict reads it), the keys inside a
new dict without a type, and any key of a class that takes ``**kwargs`` (``PosattnViT`` hands
them to posattn's ``VisionTransformer``, which refuses an unknown one when the model is built).
A ``type`` that no registry of the scope holds is left to the build, which names it.
"""
from __future__ import annotations

import ast
import copy
import difflib
import functools
import importlib
import inspect
import textwrap
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Set, Tuple

from mmengine.config import Config
from mmengine.registry import Registry

__all__ = ['option_key_problems', 'merged_options', 'RUNNER_KEYS']

KeyPath = Tuple[str, ...]

# Top-level keys that mmengine 0.10.7's Runner reads besides its constructor's arguments
# (Runner.from_cfg, wrap_model, the compile and activation-checkpointing steps), that mmengine's
# Config reads, that the tools of mmengine, mmpretrain, mmdet, mmseg and posattn read to pick the
# runner, and that PosattnRunner reads (posattn_openmmlab.runner).
RUNNER_CFG_KEYS = ('model_wrapper_cfg', 'sync_bn', 'find_unused_parameters', 'activation_checkpointing',
                   'efficient_conv_bn_eval', 'compile')
CONFIG_KEYS = ('_base_', 'custom_imports', 'runner_type')
POSATTN_RUNNER_KEYS = ('partial_load', 'mmcv_ops_to_torchvision')
# Keys that the builders of mmengine 0.10.7 and mmcv 2.1 take out of a dict before they call its class.
BUILDER_KEYS = {
    'any': ('type', '_scope_'),  # Registry.build
    'optim_wrapper': ('constructor', 'paramwise_cfg'),  # build_optim_wrapper
    'hook': ('priority',),  # Runner.register_hook
    'param_scheduler': ('convert_to_iter_based',),  # build_scheduler_from_cfg
    'init_cfg': ('override',),  # mmengine.model.initialize
    'override': ('name',),  # the same, for the inits of named submodules
    'norm_cfg': ('requires_grad',),  # mmcv.cnn.build_norm_layer
}
# What mmengine 0.10.7's Runner reads of two of its dicts (setup_env, scale_lr), and the hooks it
# registers by default (register_default_hooks).
ENV_CFG_KEYS = ('cudnn_benchmark', 'mp_cfg', 'dist_cfg', 'resource_limit')
AUTO_SCALE_LR_KEYS = ('enable', 'base_batch_size')
DEFAULT_HOOKS = ('runtime_info', 'timer', 'sampler_seed', 'logger', 'param_scheduler', 'checkpoint')
DATA_LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')
PASSED_BY_RUNNER = {'self', 'runner', 'dataloader', 'evaluator'}  # the loops' arguments that are not settings


def _signature(func) -> Optional[Tuple[Set[str], Optional[str]]]:
    """The keywords ``func`` takes and the name of its ``**kwargs`` (None: it has none); None where
    its signature cannot be read."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    keywords = {parameter.name for parameter in parameters
                if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    var_keyword = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    return keywords - {'self'}, var_keyword


def _passes_only_to_super(init, var_keyword: str) -> bool:
    """Whether every use of ``**var_keyword`` in the constructor ``init`` hands it on whole to
    ``super().__init__``, as most OpenMMLab classes do with theirs."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(init))))
    except (OSError, TypeError, SyntaxError):
        return False
    uses = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == var_keyword]
    handed_on = [keyword.value for call in ast.walk(tree) if isinstance(call, ast.Call)
                 and isinstance(call.func, ast.Attribute) and call.func.attr == '__init__'
                 and isinstance(call.func.value, ast.Call) and isinstance(call.func.value.func, ast.Name)
                 and call.func.value.func.id == 'super'
                 for keyword in call.keywords if keyword.arg is None]
    return bool(uses) and all(any(use is value for value in handed_on) for use in uses)


@functools.lru_cache(maxsize=None)
def _keywords(obj, after: Optional[type] = None) -> Optional[FrozenSet[str]]:
    """The keywords a class's constructor (or a function) takes; None where it takes any (``**kwargs``
    that go anywhere but to ``super().__init__``) or its signature cannot be read. A constructor that
    hands its ``**kwargs`` to ``super().__init__`` takes those of the next constructor in the class's
    MRO too. ``after``: start the search for the constructor after this class of the MRO."""
    if not inspect.isclass(obj):
        found = _signature(obj)
        return None if found is None or found[1] is not None else frozenset(found[0])
    mro = obj.__mro__[obj.__mro__.index(after) + 1:] if after is not None else obj.__mro__
    owner = next(cls for cls in mro if '__init__' in vars(cls))
    if owner is object:
        return frozenset()
    init = vars(owner)['__init__']
    found = _signature(init)
    if found is None:
        return None
    keywords, var_keyword = found
    if var_keyword is None:
        return frozenset(keywords)
    if not _passes_only_to_super(init, var_keyword):
        return None
    inherited = _keywords(obj, owner)
    return None if inherited is None else frozenset(keywords) | inherited


def _runner_keys() -> Set[str]:
    from mmengine.runner import Runner
    return (_keywords(Runner.__init__) - {'self', 'cfg'}) | set(RUNNER_CFG_KEYS + CONFIG_KEYS + POSATTN_RUNNER_KEYS)


RUNNER_KEYS = frozenset(_runner_keys())


def _registered(type_name: Any, scope: str) -> list:
    """The objects that the registries of ``scope`` (``<scope>.registry``, else mmengine's) hold under
    ``type_name`` (a scoped ``'mmdet.MaskRCNN'`` included), as mmengine's build would find them."""
    if not isinstance(type_name, str):
        return [type_name] if callable(type_name) else []
    try:
        registries = importlib.import_module(f'{scope}.registry')
    except ImportError:
        registries = importlib.import_module('mmengine.registry')
    found = []
    for registry in vars(registries).values():
        if isinstance(registry, Registry):
            obj = registry.get(type_name)
            if obj is not None and obj not in found:
                found.append(obj)
    return found


def _builder_kind(path: KeyPath) -> Optional[str]:
    """The entry of :data:`BUILDER_KEYS` whose builder builds the dict at ``path``, if any."""
    if path == ('optim_wrapper',):
        return 'optim_wrapper'
    if len(path) == 2 and path[0] in ('default_hooks', 'custom_hooks'):
        return 'hook'
    if path[:1] == ('param_scheduler',) and len(path) <= 2:
        return 'param_scheduler'
    if 'override' in path[-2:]:  # a dict, or an item of a list of them
        return 'override'
    if 'init_cfg' in path[-2:]:
        return 'init_cfg'
    if path and path[-1].endswith('norm_cfg'):
        return 'norm_cfg'
    return None


def _reader(path: KeyPath, node: Mapping, scope: str) -> Optional[Tuple[str, Set[str]]]:
    """What reads the dict at ``path`` (``node``, overrides applied) and the keys it takes; None where
    that is not known here or it takes any key."""
    builder_keys = set(BUILDER_KEYS['any'] + BUILDER_KEYS.get(_builder_kind(path), ()))
    if 'type' in node:
        classes = _registered(node['type'], node.get('_scope_') or scope)
        keywords = [_keywords(cls) for cls in classes]
        if not classes or None in keywords:
            return None
        names = ' or '.join(getattr(cls, '__name__', repr(cls)) for cls in classes)
        if names != node['type']:
            names += f' (type={node["type"]!r})'
        return f'{".".join(path)} builds {names}, which', set().union(*keywords) | builder_keys
    if len(path) != 1:
        return None
    from mmengine.optim import OptimWrapper
    from mmengine.runner import (EpochBasedTrainLoop, IterBasedTrainLoop, LogProcessor, Runner, TestLoop,
                                 ValLoop)
    from torch.utils.data import DataLoader
    key = path[0]
    if key == 'train_cfg':
        loop = EpochBasedTrainLoop if node.get('by_epoch') else IterBasedTrainLoop
        return (f"train_cfg is read by mmengine's {loop.__name__}, which",
                (_keywords(loop) - PASSED_BY_RUNNER) | {'by_epoch', 'type'})
    readers = {
        'val_cfg': ("mmengine's ValLoop", _keywords(ValLoop) - PASSED_BY_RUNNER),
        'test_cfg': ("mmengine's TestLoop", _keywords(TestLoop) - PASSED_BY_RUNNER),
        'optim_wrapper': ("mmengine's OptimWrapper", _keywords(OptimWrapper) | set(BUILDER_KEYS['optim_wrapper'])),
        'log_processor': ("mmengine's LogProcessor", _keywords(LogProcessor)),
        'randomness': ("mmengine's Runner.set_randomness", _keywords(Runner.set_randomness) - {'self'}),
        'env_cfg': ("mmengine's Runner.setup_env", set(ENV_CFG_KEYS)),
        'auto_scale_lr': ("mmengine's Runner.scale_lr", set(AUTO_SCALE_LR_KEYS)),
        **dict.fromkeys(DATA_LOADERS, ("mmengine's Runner.build_dataloader (torch's DataLoader)",
                                       _keywords(DataLoader) | {'num_batch_per_epoch', 'disable_subprocess_warning'})),
    }
    if key not in readers:
        return None
    what, keys = readers[key]
    return f'{key} is read by {what}, which', keys | {'type'}


def _nodes(value: Any, path: KeyPath = ()) -> Dict[KeyPath, Any]:
    """Every key path of a config's dict (list items by their index) and the value there, in order."""
    nodes = {path: value}
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        items = ()
    for key, item in items:
        nodes.update(_nodes(item, path + (str(key),)))
    return nodes


def merged_options(cfg: Config, options: Mapping[str, Any]) -> Config:
    """A copy of ``cfg`` with ``options`` merged in as ``Config.merge_from_dict`` merges them (which
    takes ``_delete_`` out of the dicts it merges: it is given copies). A ValueError names an option
    that cannot be merged (an index past a list's end, a key below a value that is not a dict) and
    mmengine's reason."""
    merged = copy.deepcopy(cfg)
    try:
        merged.merge_from_dict(copy.deepcopy(dict(options)))
    except (KeyError, TypeError) as error:
        reason = error.args[0] if isinstance(error, KeyError) and error.args else error
        for key, value in options.items():  # the option that does not merge alone
            try:
                copy.deepcopy(cfg).merge_from_dict({key: copy.deepcopy(value)})
            except (KeyError, TypeError):
                raise ValueError(f'{key}={value!r} cannot be merged into the config: {reason}') from None
        raise ValueError(f'the overrides cannot be merged into the config: {reason}') from None
    return merged


def _suggestion(name: str, path: KeyPath, candidates: Iterable[str], nodes: Mapping[KeyPath, Any],
                listed: Optional[Iterable[str]] = None) -> str:
    """'did you mean ...?' with the candidate nearest to ``name``, else with the key of the config whose
    last part is nearest to it, wherever it is; where nothing is close, the keys ``listed`` (if any)."""
    close = difflib.get_close_matches(name, sorted(set(candidates) - {name}), n=1)
    if close:
        return f'; did you mean {".".join(path + (close[0],))}?'
    keys = {}  # last part -> the first dotted key that ends with it
    for key_path in nodes:
        if key_path and not key_path[-1].isdigit():
            keys.setdefault(key_path[-1], key_path)
    close = difflib.get_close_matches(name, [key for key in keys if key != name], n=1)
    if close:
        return f'; did you mean {".".join(keys[close[0]])}?'
    listed = sorted(set(listed or ()) - set(BUILDER_KEYS['any']))
    return f'; it takes {", ".join(listed)}' if listed else ''


def _option_index(path: KeyPath, options: Mapping[str, Any]) -> int:
    """The place in ``options`` of the first option that sets the key at ``path`` or a dict around it
    (problems are named in the order of the options)."""
    for index, key in enumerate(options):
        parts = tuple(key.split('.'))
        if path[:len(parts)] == parts or parts[:len(path)] == path:
            return index
    return len(options)


def option_key_problems(cfg: Config, options: Mapping[str, Any], known_top_level: Iterable[str] = ()) -> List[str]:
    """One line per key that ``options`` (dotted keys, as ``--cfg-options`` gives them, with Python
    values) would add to ``cfg`` and that nothing reads (see the module's docstring), naming the
    nearest key that something does; [] when every key is read. ``known_top_level``: the top-level
    keys the caller reads besides the Runner's. A ValueError names an option that cannot be merged."""
    merged = merged_options(cfg, options)
    before = _nodes(cfg.to_dict())
    after = _nodes(merged.to_dict())
    scope = merged.get('default_scope') or 'mmengine'
    top_level = RUNNER_KEYS | set(known_top_level)
    problems = []
    for path in sorted(after, key=lambda path: _option_index(path, options)):
        if path in before:
            continue
        parent, name = path[:-1], path[-1]
        node = after[parent]
        if not isinstance(node, Mapping) or name in ('type', '_scope_'):
            continue  # an item of a list given whole, or the type of a dict
        siblings = set(before.get(parent) or ()) if isinstance(before.get(parent), Mapping) else set()
        if not parent:
            if name not in top_level:
                problems.append(f'{name}: the config has no {name}, and neither the runner nor the tools read one'
                                + _suggestion(name, parent, siblings | top_level, before))
            continue
        if parent == ('default_hooks',):
            hook = after[path]
            if name not in DEFAULT_HOOKS and not (isinstance(hook, Mapping) and 'type' in hook):
                problems.append(f"{'.'.join(path)}: the config has no hook {name}, and mmengine's default hooks are "
                                f"{', '.join(DEFAULT_HOOKS)} (a hook of your own is dict(type=...))"
                                + _suggestion(name, parent, siblings | set(DEFAULT_HOOKS), before))
            continue
        reader = _reader(parent, node, scope)
        if reader is not None and name not in reader[1]:
            what, keys = reader
            problems.append(f'{".".join(path)}: {what} takes no {name}'
                            + _suggestion(name, parent, siblings | keys, before, keys))
    return problems
