"""The import graph of the package: no cycles, and nothing imports upward
(connectors -> agent -> backends -> control -> byte path)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvx
from kvx.errors import ConfigError

ROOT = Path(kvx.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, package: str, paths: dict[str, Path]) -> set[str]:
    """The modules a parsed module imports, TYPE_CHECKING blocks left out; `package`
    anchors its relative imports."""
    deps: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return deps


def _graph() -> dict[str, set[str]]:
    """Module -> kvx modules it imports at run time (TYPE_CHECKING blocks left out,
    imports inside functions included: they run too)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = _imports(ast.parse(path.read_text()), package, paths)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_package_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_nothing_imports_upward():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("kvx.backends"):
            assert not {d for d in deps if d == "kvx.agent" or d.startswith("kvx.connectors")}, name
        if name.startswith("kvx.backends.control"):
            backends = {
                d
                for d in deps
                if d.startswith("kvx.backends.")
                and not d.startswith("kvx.backends.control")
                and d != "kvx.backends.base"
            }
            assert not backends, f"{name} imports a backend: {backends}"
        if name.startswith("kvx._datapath"):
            assert all(d.startswith("kvx._datapath") or d == "kvx.errors" for d in deps), (name, deps)


def test_a_backend_is_registered_by_name_and_checked():
    assert {"tcp", "shm", "cuda_ipc", "procmem"} <= set(kvx.backends.names())
    with pytest.raises(ConfigError, match="module:Class"):
        kvx.backends.register("nothing", "tests.backends.procmem")
    with pytest.raises(ConfigError, match="other than 'auto'"):
        kvx.backends.register("auto", "tests.backends.procmem:ProcMemBackend")
    with pytest.raises(ConfigError, match="backend must be one of auto, tcp"):
        kvx.Agent("x", backend="carrier-pigeon")
