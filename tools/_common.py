"""What the tools share: the config handling common to tools/train.py, tools/test.py and
tools/analyze.py (``--cfg-options``, checked against what reads them, with the config's linked
settings), the runner they build (``PosattnRunner``, with the classes checked against the data),
and the scalars mmengine logs in a work dir."""
import argparse
import copy
import json
import os
import os.path as osp
from pathlib import Path
from typing import Any, List, Mapping, Optional

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS

import posattn_openmmlab  # noqa: F401  (the registrations)
from posattn_openmmlab.class_checks import ClassCountCheck
from posattn_openmmlab.config_checks import option_key_problems
from posattn_openmmlab.runner import PosattnRunner

REPO_ROOT = Path(__file__).resolve().parents[1]
# Keys of a logged validation row that are not metrics: its timing, and where it was logged
LOGGED_NON_METRICS = ('data_time', 'time', 'step')
# A config's {top-level setting: [the keys that use its value]}: mmengine substitutes
# ``{{_base_.num_classes}}`` once, when it parses a config, so a setting given with --cfg-options
# alone would leave the keys that use it as they were.
LINKED_KEYS = 'linked_keys'
# Top-level keys that the tools read besides the runner's: the linked keys above, and the data's name
# in tools/compare_phis.py's figures.
TOOL_KEYS = (LINKED_KEYS, 'dataset_name')


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments tools/train.py and tools/test.py share, as OpenMMLab's tools name them."""
    parser.add_argument('--work-dir', help='where logs (and checkpoints) go (default: work_dirs/<config name>)')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, key=value (e.g. train_cfg.max_epochs=1)')
    parser.add_argument('--partial-load', action='store_true',
                        help='load the weights of a checkpoint that fit the model and log every key skipped '
                             '(load_from, --resume, the checkpoint of tools/test.py); without it a checkpoint '
                             'that does not fit is an error. The same as partial_load=True in the config')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
                        help='job launcher; torchrun needs pytorch')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def parse_runner_arguments(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def load_config(args) -> Config:
    """The config with ``--cfg-options``, ``--partial-load``, ``--launcher`` and ``--work-dir`` applied.

    Distributed ranks without GPUs (torchrun on CPU) get the gloo backend and a DDP wrapper
    without device ids, which CPU modules need; GPU runs keep the config's nccl. For torchrun on
    CPU the process group is started here: mmengine 0.10.7's pytorch launcher calls
    ``torch.cuda.set_device`` first, which fails without a GPU, and skips that when a group exists.
    """
    cfg = Config.fromfile(args.config)
    merge_options(cfg, args.cfg_options)
    cfg.launcher = args.launcher
    if args.partial_load:
        cfg.partial_load = True
    cfg.work_dir = args.work_dir or cfg.get('work_dir') or osp.join(
        'work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.launcher != 'none' and not torch.cuda.is_available():
        cfg.env_cfg.dist_cfg = dict(backend='gloo')
        cfg.model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False)
        if args.launcher == 'pytorch' and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend='gloo')
    return cfg


def config_value(cfg: Config, key: str) -> Any:
    """The value at a dotted ``--cfg-options`` key, list indices included
    (``'train_dataloader.dataset.pipeline.1.scale'``); a KeyError names the part that is missing."""
    value = cfg
    for part in key.split('.'):
        if isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, (Mapping, Config)) and part in value:
            value = value[part]
        else:
            raise KeyError(f'{key}: the config has no {part!r} there')
    return value


def merge_options(cfg: Config, options: Optional[Mapping[str, Any]]) -> None:
    """Applies ``--cfg-options`` (dotted keys with Python values, as mmengine's DictAction parses them
    or a study row gives them) to ``cfg``, then sets the keys that use a top-level setting given
    there, as the config's ``linked_keys`` lists them: ``num_classes=5`` sets
    ``model.head.num_classes`` and ``data_preprocessor.num_classes`` too. A ValueError, before
    anything is changed, names each key that nothing would read (a misspelt one: ``phii=rope``),
    with the nearest key that something does (:func:`posattn_openmmlab.config_checks.option_key_problems`).
    Then checks that every linked key holds its setting's value (:func:`linked_key_problems`); a
    ValueError names those that do not, and the setting to give instead."""
    options = copy.deepcopy(dict(options or {}))  # merging takes _delete_ out of the dicts it merges
    unread = option_key_problems(cfg, options, TOOL_KEYS)
    if unread:
        raise ValueError(f'{cfg.filename}: nothing reads these keys of the overrides, so a run would ignore them '
                         f'(a misspelt key?):\n  ' + '\n  '.join(unread))
    cfg.merge_from_dict(options)
    linked = cfg.get(LINKED_KEYS) or {}
    for setting in [key for key in options if key in linked]:
        cfg.merge_from_dict({key: cfg[setting] for key in linked[setting]})
    problems = linked_key_problems(cfg)
    if problems:
        raise ValueError(f'{cfg.filename}: keys that take their value from a top-level setting ({LINKED_KEYS}) '
                         f'disagree with it:\n  ' + '\n  '.join(problems))


def linked_key_problems(cfg: Config) -> List[str]:
    """Each key of the config's ``linked_keys`` that is missing or differs from its setting, with the fix."""
    problems = []
    for setting, keys in (cfg.get(LINKED_KEYS) or {}).items():
        if setting not in cfg:
            problems.append(f'{setting} is not set, and {LINKED_KEYS} lists the keys that use it: set it')
            continue
        for key in keys:
            try:
                value = config_value(cfg, key)
            except KeyError as error:
                problems.append(f'{error.args[0]}; {LINKED_KEYS}[{setting!r}] lists it: remove it there')
                continue
            if value != cfg[setting]:
                problems.append(f'{key} is {value!r}, but {setting} is {cfg[setting]!r}: change {setting}, which '
                                f'sets {key} too (--cfg-options {setting}={value!r})')
    return problems


def build_runner(cfg: Config) -> PosattnRunner:
    """The config's ``runner_type`` (``PosattnRunner`` when it names none), which must be
    ``PosattnRunner`` or derive from it: the tools rely on its strict, weights-only loading, atomic
    saves, exact resume and work_dir lock. With :class:`~posattn_openmmlab.class_checks.ClassCountCheck`
    registered: a classifier with fewer outputs than its data has classes, or (a config whose
    ``linked_keys`` set ``num_classes``) with another number, stops before its first training step
    or test batch."""
    name = cfg.get('runner_type', 'PosattnRunner')
    runner_cls = RUNNERS.get(name)
    if not (isinstance(runner_cls, type) and issubclass(runner_cls, PosattnRunner)):
        raise ValueError(f"runner_type={name!r} in the config is not a PosattnRunner (posattn_openmmlab."
                         f"runner), which tools/train.py and tools/test.py need: use runner_type='PosattnRunner' "
                         f"or a subclass of it")
    runner = runner_cls.from_cfg(cfg)
    if 'num_classes' in (cfg.get(LINKED_KEYS) or {}):  # the number of class folders: exactly
        runner.register_hook(ClassCountCheck('num_classes={n}', exact=True))
    else:  # perhaps a subset of a larger label set
        runner.register_hook(ClassCountCheck('model.head.num_classes={n} data_preprocessor.num_classes={n}',
                                             exact=False))
    return runner


def leave_process_group() -> None:
    """End a torchrun process's part in the run: every rank waits for the others (rank 0 prints its
    summary first), then the process group is destroyed before the interpreter exits. Left to the
    interpreter's exit, gloo's threads can abort the process (SIGABRT) after its work is done."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def logged_scalars(work_dir) -> List[dict]:
    """The rows mmengine logged in ``work_dir`` (``<timestamp>/vis_data/scalars.json``), every run's in
    the order the runs started: a training resumed has a folder per start."""
    rows = []
    for log in sorted(Path(work_dir).glob('*/vis_data/scalars.json')):
        rows += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return rows


def is_validation(row: dict) -> bool:
    """Whether a logged row holds a validation's metrics (training rows hold the loss and the lr)."""
    return 'loss' not in row and 'lr' not in row
