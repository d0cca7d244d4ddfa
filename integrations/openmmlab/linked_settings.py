"""A config's linked settings, and config overrides applied through them.

A config's ``linked_keys`` ({top-level setting: [the keys that use its value]}) names, for each
setting a user sets, the keys that take its value: mmengine substitutes ``{{_base_.num_classes}}``
once, when it parses a config, so a setting given as an override alone would leave the keys that
use it as they were. :func:`merge_options` applies overrides (``--cfg-options``, a study row's) the
tools' way: checked against what reads them, the linked keys set from their settings, and a config
whose linked keys disagree with their settings refused, naming the setting to give instead.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional

from mmengine.config import Config

from .config_checks import option_key_problems

__all__ = ['LINKED_KEYS', 'TOOL_KEYS', 'RUN_LENGTHS', 'config_value', 'has_key', 'merge_options',
           'linked_key_problems']

LINKED_KEYS = 'linked_keys'
# Top-level keys that the tools read besides the runner's: the linked keys above, and the data's name
# in a study's figures.
RECIPE, RECIPES = 'recipe', 'recipes'  # a config's recipe, by name, and its recipes: {name: overrides}
# The recipe a config holds applied (a run's saved config): loading it again applies it no more, so that
# what was set on top of it (the run's length, its batch) stays.
RECIPE_APPLIED = 'recipe_applied'
TOOL_KEYS = (LINKED_KEYS, 'dataset_name', RECIPE, RECIPES, RECIPE_APPLIED)
# The keys of a run's length, in epochs or iterations, which the schedulers that end with the run follow.
RUN_LENGTHS = ('train_cfg.max_epochs', 'train_cfg.max_iters')


def _item_type(item: Any) -> Optional[str]:
    """A list item's ``type`` without its scope ('mmpretrain.ResizeEdge' -> 'ResizeEdge'), or None."""
    return str(item.get('type')).split('.')[-1] if isinstance(item, Mapping) and 'type' in item else None


def resolved_key(cfg: Config, key: str) -> Optional[str]:
    """``key`` as ``--cfg-options`` writes it: each part that names a list item by its type
    (``'test_dataloader.dataset.pipeline.Resize.scale'``) as that item's index
    (``'...pipeline.1.scale'``); None where the list holds no item of that type. A KeyError names a
    part that is missing otherwise."""
    value, parts = cfg, []
    for part in key.split('.'):
        if isinstance(value, (list, tuple)) and not part.isdigit():
            index = next((i for i, item in enumerate(value) if _item_type(item) == part), None)
            if index is None:
                return None
            part = str(index)
        if isinstance(value, (list, tuple)) and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, (Mapping, Config)) and part in value:
            value = value[part]
        else:
            raise KeyError(f'{key}: the config has no {part!r} there')
        parts.append(part)
    return '.'.join(parts)


def config_value(cfg: Config, key: str) -> Any:
    """The value at a dotted ``--cfg-options`` key, list items by their index or their type
    (:func:`resolved_key`); a KeyError names the part that is missing."""
    resolved = resolved_key(cfg, key)
    if resolved is None:
        raise KeyError(f'{key}: the config has no item of that type there')
    value = cfg
    for part in resolved.split('.'):
        value = value[int(part)] if isinstance(value, (list, tuple)) else value[part]
    return value


def has_key(cfg: Config, key: str) -> bool:
    """Whether ``cfg`` has the dotted ``key`` (list items by their index, as --cfg-options writes them)."""
    try:
        config_value(cfg, key)
    except KeyError:
        return False
    return True


def merge_options(cfg: Config, options: Optional[Mapping[str, Any]]) -> None:
    """Applies ``--cfg-options`` (dotted keys with Python values, as mmengine's DictAction parses them
    or a study row gives them) to ``cfg``, then sets the keys that use a top-level setting given
    there, as the config's ``linked_keys`` lists them: ``num_classes=5`` sets
    ``model.head.num_classes`` and ``data_preprocessor.num_classes`` too.

    * A ValueError, before anything is changed, names each key that nothing would read (a misspelt
      one: ``phii=rope``), with the nearest key that something does
      (:func:`posattn_openmmlab.config_checks.option_key_problems`).
    * The config's ``recipe`` (given here, or set in the config) applies that entry of its
      ``recipes``, overrides of its own, first: every linked key then takes its setting, and the
      options come on top. The config records it applied (``recipe_applied``): a run's saved config,
      loaded again, keeps what was set on top of the recipe.
    * A new length of the run (``train_cfg.max_epochs``, ``train_cfg.max_iters``) moves the end of each
      parameter scheduler that ended with the run, unless the overrides set those ends themselves.
    * Then every linked key must hold its setting's value (:func:`linked_key_problems`); a ValueError
      names those that do not, and the setting to give instead.
    """
    options = copy.deepcopy(dict(options or {}))  # merging takes _delete_ out of the dicts it merges
    unread = option_key_problems(cfg, options, TOOL_KEYS)
    if unread:
        raise ValueError(f'{cfg.filename}: nothing reads these keys of the overrides, so a run would ignore them '
                         f'(a misspelt key?):\n  ' + '\n  '.join(unread))
    recipe = _recipe(cfg, options)
    if recipe:
        cfg.merge_from_dict(recipe)
        cfg[RECIPE_APPLIED] = options.get(RECIPE, cfg.get(RECIPE))
        _set_linked_keys(cfg, cfg.get(LINKED_KEYS) or {})
    lengths = {key: _run_length(cfg, key) for key in RUN_LENGTHS if key in options}
    cfg.merge_from_dict(options)
    for key, length in lengths.items():
        _schedules_end_with_the_run(cfg, key, length, options)
    linked = cfg.get(LINKED_KEYS) or {}
    _set_linked_keys(cfg, [setting for setting in options if setting in linked])
    problems = linked_key_problems(cfg)
    if problems:
        raise ValueError(f'{cfg.filename}: keys that take their value from a top-level setting ({LINKED_KEYS}) '
                         f'disagree with it:\n  ' + '\n  '.join(problems))


def _recipe(cfg: Config, options: Mapping[str, Any]) -> Dict[str, Any]:
    """The overrides of the recipe ``options`` or the config names (``recipe``, an entry of the
    config's ``recipes``); {} where it names none, or where the config holds it applied already."""
    name = options.get(RECIPE, cfg.get(RECIPE))
    if name is None or name == cfg.get(RECIPE_APPLIED):
        return {}
    recipes = cfg.get(RECIPES) or {}
    if name not in recipes:
        known = ', '.join(map(repr, recipes)) or 'none'
        raise ValueError(f'{cfg.filename}: recipe={name!r} is none of the config\'s recipes ({known})')
    return copy.deepcopy(dict(recipes[name]))


def _set_linked_keys(cfg: Config, settings) -> None:
    """Sets the keys each of ``settings`` is linked to (where the config has them) to its value."""
    linked = cfg.get(LINKED_KEYS) or {}
    for setting in settings:
        keys = [resolved_key(cfg, key) for key in linked[setting]]
        cfg.merge_from_dict({key: copy.deepcopy(cfg[setting]) for key in keys if key is not None})


def linked_key_problems(cfg: Config) -> List[str]:
    """Each key of the config's ``linked_keys`` that is missing or differs from its setting, with the
    fix. A key that names a list item by its type (``pipeline.Resize.scale``) where the list holds
    none of that type is not missing: another recipe's transforms are linked beside this one's."""
    problems = []
    for setting, keys in (cfg.get(LINKED_KEYS) or {}).items():
        if setting not in cfg:
            problems.append(f'{setting} is not set, and {LINKED_KEYS} lists the keys that use it: set it')
            continue
        for key in keys:
            try:
                resolved = resolved_key(cfg, key)
            except KeyError as error:
                problems.append(f'{error.args[0]}; {LINKED_KEYS}[{setting!r}] lists it: remove it there')
                continue
            if resolved is not None and config_value(cfg, resolved) != cfg[setting]:
                value = config_value(cfg, resolved)
                test_size = ' (to test at another size, tools/test.py --img-size N)' if (
                    key.startswith('test_dataloader') and setting == 'img_size') else ''
                problems.append(f'{key} is {value!r}, but {setting} is {cfg[setting]!r}: change {setting}, which '
                                f'sets {key} too (--cfg-options {setting}={value!r}){test_size}')
    return problems


def _run_length(cfg: Config, key: str) -> Optional[Any]:
    try:
        return config_value(cfg, key)
    except KeyError:
        return None


def _schedules_end_with_the_run(cfg: Config, key: str, length: Optional[Any], options: Mapping[str, Any]) -> None:
    """Each parameter scheduler that ended with the run (its ``end`` was the run's ``length`` before
    ``options`` changed ``key``) ends with it again, unless ``options`` set its end. One that would
    then end where it begins (a cosine after a warmup as long as the new run) keeps its end: it never
    starts within the run."""
    schedulers = cfg.get('param_scheduler')
    schedulers = [schedulers] if isinstance(schedulers, Mapping) else list(schedulers or ())
    new_length = config_value(cfg, key)
    for index, scheduler in enumerate(schedulers):
        if (length is not None and isinstance(scheduler, Mapping) and scheduler.get('end') == length
                and f'param_scheduler.{index}.end' not in options and new_length > scheduler.get('begin', 0)):
            scheduler['end'] = new_length
