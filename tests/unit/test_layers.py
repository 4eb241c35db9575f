"""The package graph reads bottom-up: no import cycles, no import from a higher layer (docs/architecture.md).

Every import counts, also one inside a function (a lazy import is still a dependency). Each top-level unit
of the package (a subpackage or a module) belongs to one layer, and may import only the units its layer
is allowed to depend on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_train"

#: Layer of every top-level unit of the package (subpackage or module).
LAYER_OF = {
    "errors": "foundation",
    "log": "foundation",
    "net": "foundation",
    "procs": "foundation",
    "envvars": "foundation",
    "version": "foundation",
    "etcd": "etcd",
    "rendezvous": "rendezvous",
    "checkpoint": "checkpoint",
    "train": "train",
    "elastic": "train",
    "lightning": "integration",
    "hf": "integration",
    "integrations": "integration",
    "node": "foundation",
    "straggler": "foundation",
    "metrics": "foundation",
    "torchcompat": "compat",
    "config": "config",
    "worker": "worker",
    "launch": "launch",
    "cli": "cli",
    "__main__": "cli",
    "__init__": "api",
}

#: What each layer may import (besides itself). checkpoint and train know nothing of coordination; ``compat``
#: (torchcompat) is the one module that touches torch's private names.
ALLOWED = {
    "foundation": set(),
    "compat": {"foundation"},
    "etcd": {"foundation"},
    "rendezvous": {"foundation", "compat", "etcd"},
    "checkpoint": {"foundation", "compat"},
    "train": {"foundation", "compat", "checkpoint"},
    "integration": {"foundation", "compat", "checkpoint", "train"},
    "config": {"foundation", "compat", "etcd", "rendezvous", "checkpoint", "train"},
    "worker": {"foundation", "compat", "etcd", "rendezvous", "checkpoint", "train", "config"},
    "launch": {"foundation", "compat", "etcd", "rendezvous", "checkpoint", "train", "config", "worker"},
    "cli": {
        "foundation",
        "compat",
        "etcd",
        "rendezvous",
        "checkpoint",
        "train",
        "config",
        "worker",
        "launch",
    },
    "api": {"foundation", "train"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, anywhere in it."""
    return imports_of(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py", known)


def imports_of(source: str, this: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``this`` imports in ``source``, at any depth (``from a import b``
    counts as ``a.b`` when that is a module, else as ``a``)."""
    found: set[str] = set()
    package = this if is_package else this.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) for name, path in mods.items()}


def test_every_unit_has_a_layer() -> None:
    units = {unit(m) for m in modules()}
    assert not units - set(LAYER_OF), f"give these a layer in LAYER_OF: {sorted(units - set(LAYER_OF))}"


def test_no_module_imports_from_a_higher_layer() -> None:
    wrong = []
    for module, targets in graph().items():
        layer = LAYER_OF[unit(module)]
        for target in sorted(targets):
            other = LAYER_OF[unit(target)]
            if other != layer and other not in ALLOWED[layer]:
                wrong.append(f"{module} ({layer}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, i.e. the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    g = graph()
    # A package's __init__ that re-exports its submodules is not a cycle with them.
    for module in g:
        g[module] = {t for t in g[module] if not (module.startswith(t + ".") and t != "elastic_train")}
    cycles = strongly_connected(g)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_scanner_sees_lazy_and_relative_imports() -> None:
    """Imports inside functions, relative ones and ``from package import module`` all count."""
    known = {"elastic_train", "elastic_train.cli", "elastic_train.cli.main", "elastic_train.train.loop",
             "elastic_train.etcd", "elastic_train.etcd.client"}  # fmt: skip
    source = (
        "import os\n"
        "def f():\n"
        "    from elastic_train.cli.main import main\n"
        "    from ..etcd import client\n"
        "    import elastic_train.cli\n"
    )
    found = imports_of(source, "elastic_train.train.loop", False, known)
    assert found == {"elastic_train.cli.main", "elastic_train.etcd.client", "elastic_train.cli"}


def test_cycles_are_found() -> None:
    tree = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(tree) == [["a", "b", "c"]]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_rules_are_acyclic(layer: str) -> None:
    """The allowed dependencies themselves form a DAG (a layer cannot reach itself through others)."""
    seen, todo = set(), list(ALLOWED[layer])
    while todo:
        other = todo.pop()
        assert other != layer, f"{layer} can reach itself through its allowed layers"
        if other not in seen:
            seen.add(other)
            todo.extend(ALLOWED[other])
