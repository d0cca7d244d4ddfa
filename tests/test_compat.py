"""Other libraries' private names (``_something`` of torch, torchvision, timm and OpenMMLab) appear in
posattn's sources (the package, its OpenMMLab adapters, tools and benchmarks) only in its two
compatibility modules, ``posattn/_compat.py`` and
``integrations/openmmlab/_compat.py``.

The check reads the sources, three ways:

* an import of a private module or name of those libraries (``import mmcv._ext``), or an
  attribute chain with a private part from a name bound to them (``torch._C``, ``nn.modules
  .batchnorm._BatchNorm``, ``CheckpointLoader._schemes``);
* a private attribute of any object (``old._non_persistent_buffers_set``), or a ``getattr`` of one,
  whose name those libraries' installed sources define and posattn's never do;
* in a class of posattn's, a method or ``self``/``super()`` attribute whose name a library class
  among its bases defines privately (overriding or reading mmengine's ``_save_best_checkpoint``).

A private name that posattn also defines for itself and reads from another library's object is out
of reach of the second way; review catches that.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Optional, Set

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = ('torch', 'torchvision', 'timm', 'mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain')
SCANNED = ('posattn', 'integrations', 'tools', 'benchmarks')
IMPORTED = ('posattn', 'integrations')  # the class check imports them
COMPAT_MODULES = ('posattn/_compat.py', 'integrations/openmmlab/_compat.py')
# namedtuple's documented methods and fields: public, whatever their underscore
PUBLIC_UNDERSCORE_NAMES = frozenset({'_replace', '_asdict', '_fields', '_make', '_field_defaults'})
_DEFINED = re.compile(r'(?:def|class)\s+(_[A-Za-z]\w*)|self\.(_[A-Za-z]\w*)\s*[:=]|^\s*(_[A-Za-z]\w*)\s*[:=]', re.M)
_SELF_ATTRIBUTE = re.compile(r'(?:def\s+|self\.)(_[A-Za-z]\w*)')


def is_private(name: str) -> bool:
    return name.startswith('_') and not name.startswith('__') and name not in PUBLIC_UNDERSCORE_NAMES


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def sources(folders) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((REPO / folder).rglob('*.py'))


@functools.lru_cache(maxsize=None)
def library_private_names() -> FrozenSet[str]:
    """Every private name the installed libraries define: functions, classes, module-level and
    ``self.`` attributes in their sources and stubs, and their private modules."""
    names: Set[str] = set()
    for library in LIBRARIES:
        spec = importlib.util.find_spec(library)
        if spec is None or spec.origin is None:
            continue
        for path in Path(spec.origin).parent.rglob('*'):
            stem = path.name.split('.')[0]
            if is_private(stem):
                names.add(stem)
            if path.suffix in ('.py', '.pyi'):
                text = path.read_text(errors='ignore')
                names.update(next(group for group in match.groups() if group) for match in _DEFINED.finditer(text))
    return frozenset(name for name in names if is_private(name))


@functools.lru_cache(maxsize=None)
def own_names() -> FrozenSet[str]:
    """The names posattn's own sources define (outside the compatibility modules)."""
    names: Set[str] = set()
    for path in sources(SCANNED):
        if relative(path) in COMPAT_MODULES:
            continue
        names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return frozenset(names)


def _root(node: ast.AST) -> Optional[str]:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _library_bindings(tree: ast.AST) -> Set[str]:
    """The names an ``import`` in ``tree`` binds to a library module or to something of one."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((alias.asname or alias.name).split('.')[0] for alias in node.names
                         if alias.name.split('.')[0] in LIBRARIES)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split('.')[0] in LIBRARIES:
            bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def private_uses(source: str, where: str) -> List[str]:
    """``where:line name`` for each private name of the libraries that ``source`` uses (module docstring)."""
    tree = ast.parse(source)
    bound, theirs, ours = _library_bindings(tree), library_private_names(), own_names()
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split('.')[0] in LIBRARIES
                     and any(is_private(part) for part in alias.name.split('.'))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split('.')[0] in LIBRARIES:
            parts = node.module.split('.') + [alias.name for alias in node.names]
            names = [f'{node.module}: {part}' for part in parts if is_private(part)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            if _root(node) in bound or (node.attr in theirs and node.attr not in ours):
                names = [node.attr]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ('getattr', 'hasattr', 'setattr', 'delattr') and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name = node.args[1].value
            if is_private(name) and (_root(node.args[0]) in bound or (name in theirs and name not in ours)):
                names = [name]
        found += [f'{where}:{node.lineno} {name}' for name in names]
    return found


def _library_class_privates(cls: type) -> Set[str]:
    """The private methods and ``self.`` attributes of the library classes among ``cls``'s bases."""
    names = set()
    for base in cls.__mro__[1:]:
        if base.__module__.split('.')[0] not in LIBRARIES:
            continue
        names.update(name for name in vars(base) if is_private(name))
        try:
            names.update(_SELF_ATTRIBUTE.findall(inspect.getsource(base)))
        except (OSError, TypeError):  # a class without Python source (a C type)
            pass
    return {name for name in names if is_private(name)}


def inherited_private_uses(cls: type, class_node: ast.ClassDef, where: str) -> List[str]:
    """``where:line name`` for each method of ``class_node`` (the source of ``cls``) named as a private
    one of a library base class, and each ``self._x`` / ``super()._x`` of one."""
    private = _library_class_privates(cls)
    found = []
    for node in ast.walk(class_node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in private:
            found.append(f'{where}:{node.lineno} {node.name}')
        elif isinstance(node, ast.Attribute) and node.attr in private and (
                (isinstance(node.value, ast.Name) and node.value.id == 'self')
                or (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == 'super')):
            found.append(f'{where}:{node.lineno} {node.attr}')
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix('').parts
    if parts[:2] == ('integrations', 'openmmlab'):
        parts = ('posattn_openmmlab',) + parts[2:]
    if parts[-1] == '__init__':
        parts = parts[:-1]
    return '.'.join(parts)


def scanned_files(folders=SCANNED) -> List[Path]:
    return [path for path in sources(folders) if relative(path) not in COMPAT_MODULES]


# What posattn's timm BEiT adapter once did: timm's private methods, called with posattn's layer.
OLD_BEIT_ADAPTER = '''
from torch import nn
from .core import imported
_BEIT = 'timm.models.beit'
class BeitAttention:
    def own_bias(self, shared):
        bias = imported(_BEIT, 'Attention')._get_rel_pos_bias(self)
        return bias if shared is None else bias + shared
    def take_index(self, old: nn.Module) -> None:
        persistent = 'relative_position_index' not in old._non_persistent_buffers_set
'''


def test_the_check_finds_private_names_of_each_kind():
    """The scan is not blind: it names timm's BEiT methods, torch's module internals, private
    modules, private attribute chains of imported names, and getattr of private names."""
    assert [use.split(' ')[1] for use in private_uses(OLD_BEIT_ADAPTER, 'old.py')] == [
        '_get_rel_pos_bias', '_non_persistent_buffers_set']
    source = textwrap.dedent('''
        import mmcv._ext as ext
        from torch._C import _functorch
        import torch
        from torch import nn
        from mmengine.runner import CheckpointLoader
        a = torch._C._functorch
        b = nn.modules.batchnorm._BatchNorm
        c = CheckpointLoader._schemes
        d = getattr(module, '_non_persistent_buffers_set')
        e = study._replace(data=None)
        f = tensor.grad
    ''')
    assert sorted(private_uses(source, 'x.py')) == [
        'x.py:10 _non_persistent_buffers_set', 'x.py:2 mmcv._ext', 'x.py:3 torch._C: _C',
        'x.py:3 torch._C: _functorch', 'x.py:7 _C', 'x.py:7 _functorch', 'x.py:8 _BatchNorm', 'x.py:9 _schemes']


def test_the_check_finds_overrides_of_private_methods():
    from mmengine.hooks import CheckpointHook

    class Hook(CheckpointHook):
        def _save_best_checkpoint(self, runner, metrics):
            return super()._save_best_checkpoint(runner, metrics)

        def save_history(self):
            return self._written

    node = ast.parse(textwrap.dedent(inspect.getsource(Hook))).body[0]
    assert inherited_private_uses(Hook, node, 'hook.py') == ['hook.py:2 _save_best_checkpoint',
                                                              'hook.py:3 _save_best_checkpoint']


def test_no_private_names_of_other_libraries_outside_the_compat_modules():
    found = []
    for path in scanned_files():
        found += private_uses(path.read_text(), relative(path))
    assert not found, ('private names of other libraries outside ' + ' and '.join(COMPAT_MODULES)
                       + ' (use a public API, or a function there):\n  ' + '\n  '.join(found))


def test_no_class_overrides_or_reads_a_library_base_class_private_name():
    pytest.importorskip('mmengine')
    found = []
    for path in scanned_files(IMPORTED):
        module = importlib.import_module(module_name(path))
        for node in ast.parse(path.read_text()).body:
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if isinstance(cls, type):
                found += inherited_private_uses(cls, node, relative(path))
    assert not found, ('private names of library base classes outside ' + ' and '.join(COMPAT_MODULES)
                       + ' (use a public API, or a function or class there):\n  ' + '\n  '.join(found))


def test_compat_docstrings_name_the_tested_versions():
    """Each function and class of a compatibility module says which releases it is tested against."""
    for path in COMPAT_MODULES:
        module = importlib.import_module(module_name(REPO / path))
        for name in module.__all__:
            assert re.search(r'Tested with\s+\w+\s+\d+\.\d+', inspect.getdoc(getattr(module, name)) or ''), (path, name)
