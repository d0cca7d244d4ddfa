"""mmpretrain beside a ``transformers`` that its multimodal models cannot import.

mmpretrain decides once, as ``mmpretrain.utils.dependency`` is imported, whether to import its
multimodal models and datasets (BLIP, BLIP-2, OFA, RAM, ...): it checks that ``transformers`` (>=
4.28) and ``pycocotools`` are installed, not that the names it imports from ``transformers`` exist.
``transformers`` 5 removed some of them (``apply_chunking_to_forward``,
``find_pruneable_heads_and_indices``, ``prune_linear_layer`` from ``transformers.modeling_utils``),
and importing ``mmpretrain.models``, which mmengine does to build any mmpretrain model and mmdet
to build any detector, then fails (``TypeError: NoneType takes no arguments``).

:func:`import_mmpretrain_beside_transformers` reads, without running it, which names mmpretrain's
model and dataset sources import from ``transformers``. Where one is missing, it imports
``mmpretrain.models`` and ``mmpretrain.datasets`` once with the multimodal part left out (mmpretrain's
own fallback: each multimodal model is a placeholder that raises ImportError when built), restores
mmpretrain's flag, and says so in one warning naming what is missing. Everything else of mmpretrain
is as it was. Tested with mmpretrain 1.2.0 and transformers 5.18.0 and 5.24.0.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import FrozenSet, Iterable, List, Optional, Tuple

__all__ = ['import_mmpretrain_beside_transformers', 'missing_imports']

_SOURCES = ('models', 'datasets')  # the mmpretrain packages that read the flag, with their subpackages


def missing_imports(files: Iterable[Path], package: str, *, first_module: bool = False) -> List[Tuple[str, str, str]]:
    """Of the absolute ``from <package>... import <name>`` statements in ``files`` (read as source,
    not run), those whose module does not import or has no such name (nor submodule):
    (module, name, file) each, sorted. ``first_module``: only those of the first module found to
    lack a name, plain source files first and the most imported from first (whether anything is
    missing, without importing packages or reading every file where that shows it)."""
    wanted = set()
    for path in files:
        source = path.read_text(encoding='utf-8')
        if package not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split('.')[0] == package:
                wanted.update((node.module, alias.name, path.name) for alias in node.names)
    if not first_module:
        return sorted(entry for entry in wanted if not _importable(*entry[:2]))
    counts = Counter(module for module, _, _ in wanted)
    modules = sorted(counts, key=lambda module: (not _is_source_file(module), -counts[module], module))
    for module in modules:
        missing = sorted(entry for entry in wanted if entry[0] == module and not _importable(*entry[:2]))
        if missing:
            return missing
    return []


def _is_source_file(module: str) -> bool:
    """Whether ``module`` is a plain source file (not a package), whose names may be read without running it."""
    try:
        spec = importlib.util.find_spec(module)
    except Exception:
        return False
    return spec is not None and spec.submodule_search_locations is None and str(spec.origin).endswith('.py')


def _importable(module: str, name: str) -> bool:
    """Whether ``from module import name`` finds the name, without running ``module`` where it is a
    plain source file (transformers' ``modeling_utils`` takes seconds to import): its top-level
    names are read from the source. A package is imported (transformers' are lazy: listing their
    names imports nothing more), as is a module that may make names at run time (a module-level
    ``__getattr__``, a ``*`` import); a name such a module does not list is looked up."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is None:
            return False
        package = spec.submodule_search_locations is not None
        defined = None if package else _top_level_names(spec.origin)
        if defined is not None:
            return name in defined
        if name in _listed_names(module) or hasattr(importlib.import_module(module), name):
            return True
        return package and importlib.util.find_spec(f'{module}.{name}') is not None  # a submodule
    except Exception:  # a module that fails to import: mmpretrain's import of it fails too
        return False


@functools.lru_cache(maxsize=None)
def _listed_names(module: str) -> FrozenSet[str]:
    return frozenset(dir(importlib.import_module(module)))


@functools.lru_cache(maxsize=None)
def _top_level_names(origin: Optional[str]) -> Optional[FrozenSet[str]]:
    """The names a Python source file binds at module level (in its ``if`` / ``try`` blocks too);
    None where that cannot be read from the source."""
    if origin is None or not origin.endswith('.py'):
        return None
    names = set()
    pending = list(ast.parse(Path(origin).read_text(encoding='utf-8')).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == '*' for alias in node.names):
                return None
            names.update(alias.asname or alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            pending += [*node.body, *getattr(node, 'orelse', []), *getattr(node, 'finalbody', [])]
            pending += [child for handler in getattr(node, 'handlers', []) for child in handler.body]
    return None if '__getattr__' in names else frozenset(names)


def import_mmpretrain_beside_transformers() -> Optional[str]:
    """Import mmpretrain's models and datasets without their multimodal part where the installed
    ``transformers`` lacks names that part imports (module docstring); returns the reason, or None
    where nothing was left out (mmpretrain absent, already imported, or its multimodal part
    importable or already off)."""
    if importlib.util.find_spec('mmpretrain') is None or any(
            f'mmpretrain.{package}' in sys.modules for package in _SOURCES):
        return None
    dependency = importlib.import_module('mmpretrain.utils.dependency')
    if not dependency.WITH_MULTIMODAL:
        return None
    root = Path(importlib.util.find_spec('mmpretrain').origin).parent
    missing = missing_imports((path for package in _SOURCES for path in (root / package).rglob('*.py')),
                              'transformers', first_module=True)
    if not missing:
        return None
    dependency.WITH_MULTIMODAL = False
    try:
        for package in _SOURCES:
            importlib.import_module(f'mmpretrain.{package}')
    finally:
        dependency.WITH_MULTIMODAL = True
    names = sorted({f'{module}.{name}' for module, name, _ in missing})
    reason = (f"mmpretrain's multimodal models and datasets (BLIP, BLIP-2, OFA, RAM, ...) import names that "
              f"transformers {_version('transformers')} does not have (among them {', '.join(names)}): posattn imported "
              'mmpretrain without them, and building one raises ImportError. Every other mmpretrain, mmdet and '
              'mmseg model works')
    warnings.warn(reason, stacklevel=2)
    return reason


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(distribution)
    except PackageNotFoundError:
        return '(version unknown)'
