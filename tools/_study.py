"""The study model of tools/compare_phis.py: a study file (or the configs of ``--configs``) read and
checked, the config and data files its rows name, the data of ``--data`` put in place of a row's, and
the config a row's runs train and the model it builds. tools/compare_phis.py's docstring gives the
format of a study file and of a data config."""
import copy
import re
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from _common import REPO_ROOT, config_value, merge_options
from mmengine.config import Config
from mmengine.registry import init_default_scope

CONFIGS = REPO_ROOT / 'configs'
STUDIES = CONFIGS / 'studies'  # the built-in studies, which --experiment names
STUDY_KEYS = ('rows', 'data', 'analyse', 'test_size_factors', 'test_extent_factors', 'work_dir')
ROW_KEYS = ('name', 'config', 'label', 'options', 'start_from', 'checkpoint_keys')
ROW_NAME = re.compile(r'[A-Za-z0-9_][A-Za-z0-9_.-]*')  # a folder name and a command-line word
# The keys of a data config that replace a row's whole; with num_classes, what every data config defines.
DATA_KEYS = ('train_dataloader', 'val_dataloader', 'test_dataloader', 'val_evaluator', 'test_evaluator')
# The inits that a fine-tune's starting checkpoint goes to by default: the swapped backbone's and the head's.
STARTING_CHECKPOINT_KEYS = ('model.backbone.backbone.init_cfg.checkpoint', 'model.head.init_cfg.checkpoint')


class Row(NamedTuple):
    """One model of a study: its name, its config as the study writes it and the file that is, what it
    is, the ``--cfg-options`` of this row alone (``(key, value)`` pairs, e.g. ``(('phi', 'rope'),)``),
    and the row whose trained checkpoint it starts from (None: from scratch) with the config keys
    that take that checkpoint."""
    name: str
    config: str
    path: Path
    label: str
    options: Tuple[Tuple[str, Any], ...] = ()
    start_from: Optional[str] = None
    checkpoint_keys: Tuple[str, ...] = STARTING_CHECKPOINT_KEYS


class Study(NamedTuple):
    """The rows to compare (by name, in order) and what is done with each run: see
    tools/compare_phis.py's docstring."""
    name: str
    rows: Dict[str, Row]
    work_dir: str
    data: Optional[Path] = None
    analyse: bool = False
    test_size_factors: Tuple[float, ...] = ()
    test_extent_factors: Tuple[float, ...] = ()


def builtin_studies() -> list:
    return sorted(path.stem for path in STUDIES.glob('*.py'))


def config_file(config: str, base_dir: Path) -> Path:
    """The file ``config`` names: an absolute path, else one relative to ``base_dir``, else to configs/."""
    candidates = [Path(config)] if Path(config).is_absolute() else [base_dir / config, CONFIGS / config]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f'no config file {config}: looked for {" and ".join(map(str, candidates))}')


def load_study(path) -> Study:
    """The study a study file describes (see tools/compare_phis.py's docstring), checked: every row's config
    exists, names are unique, every ``start_from`` names a row, no row starts (at any remove) from
    itself, and a fine-tune's config has the keys that take its starting checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'no study file {path}')
    settings = Config.fromfile(str(path)).to_dict()
    unknown = sorted(key for key in set(settings) - set(STUDY_KEYS) if not key.startswith('_'))
    if unknown:
        raise ValueError(f'{path} sets {", ".join(unknown)}, which a study does not know; a study sets '
                         f'{", ".join(STUDY_KEYS)} (and helper variables, whose names start with _)')
    specs = settings.get('rows')
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError(f"{path} has no rows: a study sets rows = [dict(name=..., config=..., label=...), ...]")
    rows = {}
    for index, spec in enumerate(specs, 1):
        row = parse_row(spec, path.resolve().parent, f'{path}, row {index}')
        if row.name in rows:
            raise ValueError(f'{path}: two rows are named {row.name!r}; give each row its own name')
        rows[row.name] = row
    check_starting_rows(rows, str(path))
    data = settings.get('data')
    return Study(name=path.stem, rows=rows, work_dir=settings.get('work_dir') or f'work_dirs/compare_phis/{path.stem}',
                 data=config_file(data, path.resolve().parent) if data else None,
                 analyse=bool(settings.get('analyse', False)),
                 test_size_factors=tuple(float(factor) for factor in settings.get('test_size_factors') or ()),
                 test_extent_factors=tuple(float(factor) for factor in settings.get('test_extent_factors') or ()))


def parse_row(spec, study_dir: Path, where: str) -> Row:
    """One row of a study file (``dict(name=..., config=..., label=..., options=..., start_from=...,
    checkpoint_keys=...)``)."""
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
        raise ValueError(f'{where}: checkpoint_keys is a list of config keys, e.g. '
                         f"['load_from'], got {keys!r}")
    options = spec.get('options') or {}
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise ValueError(f"{where}: options are the row's --cfg-options as a dict, e.g. dict(phi='rope'), "
                         f'got {options!r}')
    return Row(name=name, config=spec['config'], path=config_file(spec['config'], study_dir),
               label=spec.get('label') or name, options=tuple(options.items()), start_from=spec.get('start_from'),
               checkpoint_keys=tuple(keys))


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
            missing = [key for key in row.checkpoint_keys if not _has_key(cfg, key)]
            if missing:
                raise ValueError(f'{where}: row {row.name!r} starts from {row.start_from!r}, but its config '
                                 f'{row.config} has no {", ".join(missing)} to take the checkpoint; set the row\'s '
                                 f"checkpoint_keys to the keys that do (e.g. ['load_from'])")


def _has_key(cfg: Config, key: str) -> bool:
    """Whether ``cfg`` has the dotted ``key`` (list items by their index, as --cfg-options writes them)."""
    try:
        config_value(cfg, key)
    except KeyError:
        return False
    return True


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


def planned_rows(study: Study, chosen=None) -> list:
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
    """A data config, checked to define what ``with_data`` gives a row."""
    data = Config.fromfile(str(path))
    missing = [key for key in DATA_KEYS + ('num_classes',) if key not in data]
    if missing:
        raise ValueError(f'the data config {path} does not define {", ".join(missing)}; a data config defines '
                         f'{", ".join(DATA_KEYS)} and num_classes (as configs/_base_/shapes.py does)')
    return data


def with_data(cfg: Config, data: Config, where: str) -> Config:
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
    """The config the row's runs train: the row's, with the data applied (--cfg-options come on top)."""
    cfg = Config.fromfile(str(row.path))
    return cfg if data is None else with_data(cfg, data, row.config)


def with_options(cfg: Config, options: Mapping[str, Any]) -> Config:
    """A copy of ``cfg`` with a run's overrides ({dotted key: Python value}) merged as tools/train.py
    merges its ``--cfg-options`` (a top-level setting of the config's ``linked_keys`` sets the keys that
    use it; a key that nothing reads is a ValueError), the values as they are, never parsed as text."""
    cfg = copy.deepcopy(cfg)
    merge_options(cfg, options)
    return cfg


def build_model(cfg: Config):
    """The model of ``cfg`` (with its data preprocessor, as mmengine's runner builds it), not initialised."""
    from mmpretrain.registry import MODELS
    from posattn_openmmlab import posattn_checkpoint_loading
    init_default_scope(cfg.get('default_scope', 'mmpretrain'))
    model_cfg = copy.deepcopy(cfg.model)
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with posattn_checkpoint_loading():  # a swap row starts from a checkpoint of our own training
        return MODELS.build(model_cfg)
