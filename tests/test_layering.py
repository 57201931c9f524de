"""The packages' import graph: no cycles, and data flows one way
(trace_kernels <- megatron_trace <- sglang_rollout; docs/design.md section 7).

Imports are read from the source (module level and inside functions alike: a deferred import
is still a dependency); `if TYPE_CHECKING:` blocks do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kernels": "trace_kernels", "megatron_trace": "megatron_trace", "sglang_rollout": "sglang_rollout"}
LAYER = {"trace_kernels": 0, "megatron_trace": 1, "sglang_rollout": 2}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports (a `from pkg import sub` counts as `pkg.sub`)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` bodies
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            found |= subs if len(subs) == len(node.names) else subs | {base}
    return {m for m in found if m in modules and m != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_packages_have_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the graph was really read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", list(LAYER))
def test_imports_flow_from_the_rollout_side_down_to_the_kernels(package):
    upward = {(m, dep) for m, deps in import_graph().items() if m.split(".")[0] == package
              for dep in deps if LAYER[dep.split(".")[0]] > LAYER[package]}
    assert upward == set()
