"""Everything about a study that can be wrong, checked before its first run trains.

For every planned row, with the data and the overrides its runs get: the config loads and takes
the overrides (a key nothing reads is named with the nearest one, :mod:`..config_checks`); each Φp
it names is registered; its tests at other sizes apply to its test data; and each dataset's
``data_root`` is read from the folder the command ran in, as ``tools/train.py`` reads it, and exists.
No model is built and no data is read, so a study with a broken row fails in seconds, naming the row.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from mmengine.config import Config

import posattn

from ..linked_settings import LINKED_KEYS
from .spec import Study, row_config, with_options

__all__ = ['StudyError', 'checked_run_configs', 'test_sides', 'absolute_data_roots']

DATA_LOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')
PHI_OWN = 'own'  # a swap's name for the model's own scheme


class StudyError(ValueError):
    """What is wrong with a study, one line per problem, each naming its row."""


def checked_run_configs(study: Study, planned: Sequence[str], data: Optional[Config],
                        options: Mapping[str, Mapping[str, Any]], cwd: Path) -> Dict[str, Config]:
    """Each planned row's config as its runs train it (data applied, ``options[row]`` merged, data
    folders absolute), after every check of the module's docstring; a :class:`StudyError` lists every
    problem of every row at once."""
    configs, problems = {}, []
    for name in planned:
        row = study.rows[name]
        try:
            cfg = with_options(row_config(row, data), options[name])
        except (ValueError, KeyError, TypeError, FileNotFoundError) as error:
            problems.append(f'row {name} ({row.config}): {error}')
            continue
        row_problems = [*_unknown_phis(cfg), *_size_test_problems(cfg, study), *absolute_data_roots(cfg, cwd)]
        problems += [f'row {name} ({row.config}): {problem}' for problem in row_problems]
        configs[name] = cfg
    if problems:
        raise StudyError('the study cannot run as it is; nothing was trained:\n  ' + '\n  '.join(problems))
    return configs


def _walk(value: Any, path: str = '') -> Iterator[Tuple[str, Any]]:
    """Every (dotted key, value) of a config's nested dicts and lists."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            inner = f'{path}.{key}' if path else str(key)
            yield inner, item
            yield from _walk(item, inner)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f'{path}.{index}')


def _unknown_phis(cfg: Config) -> List[str]:
    """The Φp names under the config's ``phi`` keys that are not registered, each value once with
    every key that holds it (a setting and the keys linked to it)."""
    known = set(posattn.list_phis()) | {PHI_OWN}
    holding: Dict[str, Tuple[Any, List[str]]] = {}
    for key, value in _walk({k: v for k, v in cfg.to_dict().items() if k != LINKED_KEYS}):
        if key.split('.')[-1] == 'phi' and isinstance(value, (str, list, tuple)):
            holding.setdefault(repr(value), (value, []))[1].append(key)
    problems = []
    for value, keys in holding.values():
        unknown = [name for name in ([value] if isinstance(value, str) else value) if name not in known]
        if unknown:
            problems.append(f'{", ".join(keys)} = {value!r} names no registered Φp ({", ".join(map(repr, unknown))}); '
                            f'known: {", ".join(sorted(known))}')
    return problems


def test_sides(cfg: Config, factors: Sequence[float]) -> List[int]:
    """The image sides a row is tested at: its config's (square) test size times each of ``factors``,
    which must give whole pixels; a ValueError says which does not hold."""
    from ..sizes import config_test_size
    trained = config_test_size(cfg)
    if trained is None or trained[0] != trained[1]:
        raise ValueError(f'testing at other sizes needs a square test size in the config, got '
                         f'{"an unknown one" if trained is None else f"{trained[0]} x {trained[1]}"}')
    sides = [trained[0] * factor for factor in factors]
    if any(side != int(side) for side in sides):
        raise ValueError(f'a test size of {trained[0]} pixels times {tuple(factors)} is not a whole number of '
                         'pixels each time')
    return [int(side) for side in sides]


def _size_test_problems(cfg: Config, study: Study) -> List[str]:
    problems = []
    for factors in (study.test_size_factors, study.test_extent_factors):
        if factors:
            try:
                test_sides(cfg, factors)
            except ValueError as error:
                problems.append(str(error))
    dataset = cfg.test_dataloader.dataset.get('type')
    if study.test_extent_factors and dataset != 'PositionalRelations':
        problems.append(f'test_extent_factors draw PositionalRelations scenes on larger canvases; this row tests '
                        f'on {dataset}')
    return problems


def _datasets(cfg: Config) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(key, dataset config) of each dataloader's dataset and of the datasets it wraps."""
    for loader in DATA_LOADERS:
        dataset, key = (cfg.get(loader) or {}).get('dataset'), f'{loader}.dataset'
        while isinstance(dataset, Mapping):
            yield key, dataset
            dataset, key = dataset.get('dataset'), f'{key}.dataset'


def absolute_data_roots(cfg: Config, cwd: Path) -> List[str]:
    """Makes each dataset's relative ``data_root`` absolute, read from ``cwd`` (the runs start
    elsewhere); the problems where one does not exist, each folder once with the keys that name it."""
    from ..sizes import GENERATED
    missing: Dict[Path, List[str]] = {}
    for key, dataset in _datasets(cfg):
        root = dataset.get('data_root')
        if not root or not isinstance(root, str) or '://' in root or dataset.get('type') in GENERATED:
            continue
        path = Path(root).expanduser()
        absolute = path if path.is_absolute() else cwd / path
        if not absolute.exists():
            missing.setdefault(absolute, []).append(f'{key}.data_root' + ('' if path.is_absolute() else f'={root!r}'))
        dataset['data_root'] = str(absolute)
        for setting in (cfg.get(LINKED_KEYS) or {}):  # the setting the key takes its value from, alike
            if cfg.get(setting) == root:
                cfg[setting] = str(absolute)
    return [f'{", ".join(keys)}: {folder} does not exist (a relative data_root is read from the folder the command '
            'runs in, as tools/train.py reads it)' for folder, keys in missing.items()]
