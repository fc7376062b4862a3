"""The product's import graph, read from the source: no cycle between modules, the layers point
one way (proto <- linkf <- nodeagent, and proto <- linkf <- conformance: the kit that checks a
node never imports one), and nothing imports the tests."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Each package and the packages it may import, lowest layer first.
LAYERS = {
    "proto": set(),
    "linkf": {"proto"},
    "nodeagent": {"proto", "linkf"},
    "conformance": {"proto", "linkf"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in LAYERS for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path], name: str | None = None) -> set[str]:
    """The project modules `path` (the module `name`, by default the one its place in the tree
    names) imports, anywhere in it (a function-level import is an edge too: it only moves the
    cycle to run time)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {m for m in found if m in known or m.split(".")[0] == "tests"} - {name}


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    edges = graph()
    assert "nodeagent.agent" in edges and "linkf.driver" in edges["nodeagent.agent"]
    assert "proto.envelope" in edges["linkf.driver"] or any(m.startswith("proto") for m in edges["linkf.driver"])


def test_no_module_imports_itself_back():
    assert cycles(graph()) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def wrong_way(edges: dict[str, set[str]], package: str) -> set[tuple[str, str]]:
    """The imports out of `package` into a layer it may not use, or into the tests."""
    return {
        (name, target)
        for name, targets in edges.items()
        if name.split(".")[0] == package
        for target in targets
        if target.split(".")[0] not in LAYERS[package] | {package}
    }


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(package):
    assert wrong_way(graph(), package) == set(), "imports across the layers the wrong way, or of the tests"


def test_a_planted_import_of_the_node_by_the_kit_is_caught(tmp_path):
    planted = tmp_path / "conformance" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("from nodeagent.engine import open_engine\n")
    known = {**modules(), "conformance.planted": planted}
    edges = {**graph(), "conformance.planted": imports_of(planted, known, "conformance.planted")}
    assert ("conformance.planted", "nodeagent.engine") in wrong_way(edges, "conformance")


#: The command line's modules: the serving objects take a plain `NodeConfig` instead, so a
#: program can embed a node without argv.
COMMAND_LINE = {"nodeagent.cli", "nodeagent.main", "nodeagent.__main__"}


def test_the_serving_objects_do_not_import_the_command_line():
    edges = graph()
    serving = ("nodeagent.noded", "nodeagent.join", "nodeagent.agent")
    assert {(m, t) for m in serving for t in edges[m] if t in COMMAND_LINE} == set()
