"""What a study is: its rows, read from a study file (or from config files given as rows), the data
given to every row, and the config each run of a row trains.

A study file is a Python file read by mmengine's ``Config.fromfile``, so it may inherit another
with ``_base_``::

    rows = [
        dict(name='ape', config='study/deit-t-half_ape_shapes.py', label='APE'),
        dict(name='rope', config='your_data/deit_t_image_folder.py', label='RoPE', options=dict(phi='rope')),
        dict(name='ft', config='my_finetune.py', label='APE, fine-tuned', start_from='ape',
             checkpoint_keys=['load_from']),
    ]
    options = {'optim_wrapper.clip_grad.max_norm': 1.0}  # optional: every row's, under its own
    row_changes = dict(ape=dict(config='my_ape.py'))     # optional: changes to rows of a base study
    data = 'my_data.py'              # optional: every row's data, as --data
    analyse = True                   # optional (False): tools/analyze.py on each run, Ω per layer
    test_size_factors = (0.5, 1, 2)  # optional (none): test each run at these multiples of its test size
    test_extent_factors = (1, 2)     # optional (none), PositionalRelations: on canvases these multiples wide
    equal_within = 3.0               # optional (3): points within which two rows count as equal
    work_dir = 'work_dirs/my_study'  # optional (work_dirs/compare_phis/<study file name>)

A row's ``name`` names its folder in the work dir; ``config`` is a path relative to the study file,
else to ``configs/``; ``label`` (default: the name) is what the tables and figures call it;
``options`` are the config overrides of that row alone, as Python values. A row with ``start_from``
starts from the last checkpoint of that row's run with the same seed, written into its config's
``checkpoint_keys``. Names that start with ``_`` are free for helper variables.
"""
from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from mmengine.config import Config

from ..linked_settings import has_key, merge_options

__all__ = ['Row', 'Study', 'load_study', 'study_of_configs', 'planned_rows', 'load_data', 'row_config',
           'with_options', 'config_digest', 'CHECKOUT', 'CONFIGS', 'STUDIES', 'DATA_KEYS']


def _checkout() -> Path:
    """The posattn checkout this integration runs from, whose configs/ and tools/ a study uses (the
    studies run from a clone: ``pip install -e .``, as ``make setup`` installs it)."""
    for folder in Path(__file__).resolve().parents:
        if (folder / 'configs' / 'studies').is_dir() and (folder / 'tools' / 'train.py').is_file():
            return folder
    return Path.cwd()  # an installed copy: configs/ and tools/ are read from the folder the command runs in


CHECKOUT = _checkout()
CONFIGS = CHECKOUT / 'configs'
STUDIES = CONFIGS / 'studies'  # the built-in studies
STUDY_KEYS = ('rows', 'options', 'row_changes', 'data', 'analyse', 'test_size_factors', 'test_extent_factors',
              'equal_within', 'work_dir')
ROW_KEYS = ('name', 'config', 'label', 'options', 'start_from', 'checkpoint_keys')
ROW_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]*')  # a folder name and a command-line word
# The keys of a data config that replace a row's whole; with num_classes, what every data config defines.
DATA_KEYS = ('train_dataloader', 'val_dataloader', 'test_dataloader', 'val_evaluator', 'test_evaluator')
# The inits that a fine-tune's starting checkpoint goes to by default: the swapped backbone's and the head's.
STARTING_CHECKPOINT_KEYS = ('model.backbone.backbone.init_cfg.checkpoint', 'model.head.init_cfg.checkpoint')
EQUAL_WITHIN = 3.0  # points: the default margin of "equal"


class Row(NamedTuple):
    """One model of a study: its name, its config as the study writes it and the file that is, what it
    is, its own overrides (``(key, value)`` pairs: the study's options, then the row's), and the row
    whose trained checkpoint it starts from (None: from scratch) with the config keys that take it."""
    name: str
    config: str
    path: Path
    label: str
    options: Tuple[Tuple[str, Any], ...] = ()
    start_from: Optional[str] = None
    checkpoint_keys: Tuple[str, ...] = STARTING_CHECKPOINT_KEYS


class Study(NamedTuple):
    """The rows to compare (by name, in order) and what is done with each run."""
    name: str
    rows: Dict[str, Row]
    work_dir: str
    data: Optional[Path] = None
    analyse: bool = False
    test_size_factors: Tuple[float, ...] = ()
    test_extent_factors: Tuple[float, ...] = ()
    equal_within: float = EQUAL_WITHIN


def config_file(config: str, base_dir: Path) -> Path:
    """The file ``config`` names: an absolute path, else one relative to ``base_dir``, else to configs/."""
    candidates = [Path(config)] if Path(config).is_absolute() else [base_dir / config, CONFIGS / config]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f'no config file {config}: looked for {" and ".join(map(str, candidates))}')


def load_study(path) -> Study:
    """The study a study file describes (the module's docstring), checked: every row's config exists,
    names are unique, every ``start_from`` names a row, no row starts (at any remove) from itself, and
    a fine-tune's config has the keys that take its starting checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'no study file {path}')
    settings = Config.fromfile(str(path)).to_dict()
    unknown = sorted(key for key in set(settings) - set(STUDY_KEYS) if not key.startswith('_'))
    if unknown:
        raise ValueError(f'{path} sets {", ".join(unknown)}, which a study does not know; a study sets '
                         f'{", ".join(STUDY_KEYS)} (and helper variables, whose names start with _)')
    specs = _changed_rows(settings.get('rows'), settings.get('row_changes') or {}, path)
    shared = _checked_options(settings.get('options') or {}, f'{path}: options')
    here = path.resolve().parent
    rows = {}
    for index, spec in enumerate(specs, 1):
        row = parse_row(spec, here, f'{path}, row {index}', shared)
        if row.name in rows:
            raise ValueError(f'{path}: two rows are named {row.name!r}; give each row its own name')
        rows[row.name] = row
    check_starting_rows(rows, str(path))
    data, equal_within = settings.get('data'), settings.get('equal_within', EQUAL_WITHIN)
    if isinstance(equal_within, bool) or not isinstance(equal_within, (int, float)) or equal_within < 0:
        raise ValueError(f'{path}: equal_within is a number of points >= 0, got {equal_within!r}')
    return Study(name=path.stem, rows=rows, work_dir=settings.get('work_dir') or f'work_dirs/compare_phis/{path.stem}',
                 data=config_file(data, here) if data else None, analyse=bool(settings.get('analyse', False)),
                 test_size_factors=tuple(float(factor) for factor in settings.get('test_size_factors') or ()),
                 test_extent_factors=tuple(float(factor) for factor in settings.get('test_extent_factors') or ()),
                 equal_within=float(equal_within))


def _changed_rows(specs: Any, changes: Mapping[str, Any], path: Path) -> list:
    """The study's row specs with ``row_changes`` ({row name: settings to change}) applied."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError(f"{path} has no rows: a study sets rows = [dict(name=..., config=..., label=...), ...]")
    if not isinstance(changes, Mapping):
        raise ValueError(f"{path}: row_changes is a dict of row names to the settings they change, e.g. "
                         f"dict(a=dict(config='other.py')), got {changes!r}")
    names = [spec.get('name') if isinstance(spec, dict) else None for spec in specs]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise ValueError(f'{path}: row_changes names {", ".join(unknown)}, which is no row of the study; its rows: '
                         f'{", ".join(map(str, names))}')
    return [dict(spec, **changes.get(name, {})) if isinstance(spec, dict) else spec for spec, name in zip(specs, names)]


def _checked_options(options: Any, where: str) -> Dict[str, Any]:
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise ValueError(f"{where} are config overrides as a dict, e.g. dict(phi='rope'), got {options!r}")
    return dict(options)


def parse_row(spec: Any, study_dir: Path, where: str, shared: Mapping[str, Any] = None) -> Row:
    """One row of a study file (``dict(name=..., config=..., label=..., options=..., start_from=...,
    checkpoint_keys=...)``), under the study's ``shared`` options."""
    if not isinstance(spec, dict):
        raise ValueError(f'{where}: a row is dict(name=..., config=..., label=...), got {spec!r}')
    unknown = sorted(set(spec) - set(ROW_KEYS))
    if unknown:
        raise ValueError(f'{where} sets {", ".join(unknown)}, which a row does not know; a row sets '
                         f'{", ".join(ROW_KEYS)}')
    missing = [key for key in ('name', 'config') if not spec.get(key)]
    if missing:
        raise ValueError(f'{where} has no {" and no ".join(missing)}: every row needs a name and a config')
    name = spec['name']
    if not isinstance(name, str) or not ROW_NAME.fullmatch(name):
        raise ValueError(f'{where}: the name {name!r} is no folder name; use letters, digits, _, . and -')
    keys = spec.get('checkpoint_keys', STARTING_CHECKPOINT_KEYS)
    if isinstance(keys, str) or not keys or not all(isinstance(key, str) for key in keys):
        raise ValueError(f"{where}: checkpoint_keys is a list of config keys, e.g. ['load_from'], got {keys!r}")
    options = dict(shared or {}, **_checked_options(spec.get('options') or {}, f"{where}: the row's options"))
    try:
        path = config_file(spec['config'], study_dir)
    except FileNotFoundError as error:
        raise FileNotFoundError(f'{where} ({name}): {error}') from None
    return Row(name=name, config=spec['config'], path=path, label=spec.get('label') or name,
               options=tuple(options.items()), start_from=spec.get('start_from'), checkpoint_keys=tuple(keys))


def check_starting_rows(rows: Dict[str, Row], where: str) -> None:
    """Every ``start_from`` names a row of the study, no row starts from itself at any remove, and a
    fine-tune's config has each of its ``checkpoint_keys``."""
    for row in rows.values():
        if row.start_from is not None and row.start_from not in rows:
            raise ValueError(f'{where}: row {row.name!r} starts from {row.start_from!r}, which is no row of the '
                             f'study; its rows: {", ".join(rows)}')
    for row in rows.values():  # follow each row's chain of starts: a row met twice closes a cycle
        chain = [row.name]
        while rows[chain[-1]].start_from is not None:
            start = rows[chain[-1]].start_from
            if start in chain:
                cycle = ' -> '.join(chain[chain.index(start):] + [start])
                raise ValueError(f'{where}: rows start from each other in a cycle ({cycle}, "->" reads "starts '
                                 f'from"); one of them must train from scratch, without start_from')
            chain.append(start)
    for row in rows.values():
        if row.start_from is not None:
            cfg = Config.fromfile(str(row.path))
            missing = [key for key in row.checkpoint_keys if not has_key(cfg, key)]
            if missing:
                raise ValueError(f'{where}: row {row.name!r} starts from {row.start_from!r}, but its config '
                                 f'{row.config} has no {", ".join(missing)} to take the checkpoint; set the row\'s '
                                 f"checkpoint_keys to the keys that do (e.g. ['load_from'])")


def study_of_configs(configs: Sequence[str]) -> Study:
    """A study of config files as rows (paths relative to here, else to configs/), each named and
    labelled by its file name."""
    rows = {}
    for config in configs:
        path = config_file(config, Path.cwd())
        if path.stem in rows:
            raise ValueError(f'--configs names two files called {path.stem}.py: {rows[path.stem].path} and {path}; '
                             f'a study file can give them two names')
        rows[path.stem] = Row(name=path.stem, config=config, path=path, label=path.stem)
    return Study(name='configs', rows=rows, work_dir='work_dirs/compare_phis/configs')


def planned_rows(study: Study, chosen: Optional[Sequence[str]] = None) -> list:
    """The rows to train: the chosen ones (default: all) and every row they start from, in the study's
    order except that a row comes after the one it starts from."""
    wanted = set()
    for name in chosen or study.rows:
        while name is not None and name not in wanted:
            wanted.add(name)
            name = study.rows[name].start_from
    order = []

    def place(name):
        if name not in order:
            if study.rows[name].start_from is not None:
                place(study.rows[name].start_from)
            order.append(name)
    for name in study.rows:
        if name in wanted:
            place(name)
    return order


def load_data(path: Path) -> Config:
    """A data config, checked to define what :func:`row_config` gives a row."""
    data = Config.fromfile(str(path))
    missing = [key for key in DATA_KEYS + ('num_classes',) if key not in data]
    if missing:
        raise ValueError(f'the data config {path} does not define {", ".join(missing)}; a data config defines '
                         f'{", ".join(DATA_KEYS)} and num_classes (as configs/_base_/shapes.py does)')
    return data


def _with_data(cfg: Config, data: Config, where: str) -> Config:
    """``cfg`` with the data of ``data``: its dataloaders and evaluators in place of the row's whole (a
    dataset of another type takes other arguments), every other key it sets merged in, and its
    ``num_classes`` in the model's head and data preprocessor."""
    head = cfg.model.get('head')
    if not isinstance(head, dict) or 'num_classes' not in head:
        raise ValueError(f"{where}: a data config sets the classes of a classifier's head (model.head.num_classes), "
                         f'and this config\'s model has no head with num_classes')
    settings = data.to_dict()
    for key in DATA_KEYS:
        cfg[key] = settings.pop(key)
    cfg.merge_from_dict(settings)
    cfg.model.head.num_classes = data.num_classes
    for preprocessor in (cfg.get('data_preprocessor'), cfg.model.get('data_preprocessor')):
        if preprocessor is not None:
            preprocessor.num_classes = data.num_classes
    return cfg


def row_config(row: Row, data: Optional[Config]) -> Config:
    """The config the row's runs train: the row's, with the data applied (overrides come on top)."""
    cfg = Config.fromfile(str(row.path))
    return cfg if data is None else _with_data(cfg, data, row.config)


def with_options(cfg: Config, options: Mapping[str, Any]) -> Config:
    """A copy of ``cfg`` with a run's overrides ({dotted key: Python value}) merged as tools/train.py
    merges its ``--cfg-options`` (a top-level setting of the config's ``linked_keys`` sets the keys that
    use it; a key that nothing reads is a ValueError), the values as they are, never parsed as text."""
    cfg = copy.deepcopy(cfg)
    merge_options(cfg, options)
    return cfg


def recorded_options(options: Mapping[str, Any]) -> list:
    """A run's overrides as its record names them, ``key=value`` each: what a rerun compares to reuse it."""
    return [f'{key}={value}' for key, value in options.items()]


def config_digest(cfg: Config) -> str:
    """A fingerprint of the config a run trains (its overrides merged): a run recorded with another
    one (the config file, a base it inherits or the data was edited since) is trained again."""
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]
