"""posattn's modules import one another without a cycle: data flows one way (grid -> Φp ->
attention -> block -> model -> integration), each import read from the source."""
import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / 'posattn'


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imports_of(path: Path) -> Set[str]:
    return imports_in(path.read_text(), module_name(path), path.name == '__init__.py')


def imports_in(source: str, name: str, is_package: bool) -> Set[str]:
    """The posattn modules the source of module ``name`` imports, at its top level or inside a
    function (a deferred import that goes back up the data flow is a cycle all the same)."""
    package = name if is_package else name.rpartition('.')[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition('.')[0]
            target = (f'{base}.{node.module}' if node.module else base) if node.level else (node.module or '')
            for alias in node.names:  # ``from . import x`` imports the submodule x
                candidate = f'{target}.{alias.name}'
                found.add(candidate if candidate in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in MODULES and module != name}


MODULES: Dict[str, Path] = {module_name(path): path for path in PACKAGE.rglob('*.py')}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_posattn_has_no_import_cycle():
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    assert find_cycle(graph) == []


def test_the_check_finds_a_cycle():
    assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': set()}) == ['a', 'b', 'c', 'a']
    assert 'posattn.phi.base' in imports_of(MODULES['posattn.phi.stack'])


def test_a_deferred_import_counts():
    """The cycle the cache once had: a grid-level module importing the Φp base class in a function."""
    source = (PACKAGE / '_cache.py').read_text() + '\n\ndef attach():\n    from .phi.base import PositionalModule\n'
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    graph['posattn._cache'] = imports_in(source, 'posattn._cache', False)
    assert 'posattn.phi.base' in graph['posattn._cache']
    cycle = find_cycle(graph)
    assert {'posattn._cache', 'posattn.phi.base'} <= set(cycle) and cycle[0] == cycle[-1]
