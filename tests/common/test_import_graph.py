"""The import graph of services/ and metal/: no cycles, metal/ (kernels and their loaders)
imports nothing from services/, and the services import neither ops nor tools. Every import counts, also those inside functions; only
imports under `if TYPE_CHECKING:` (never executed) are left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files() -> dict[str, Path]:
    modules = {}
    for package in ("services", "metal"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _executed_nodes(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        yield child
        yield from _executed_nodes(child)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` imports: `from a.b import c` names a.b.c where c
    is a module, else a.b."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in _executed_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(
                    package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                )
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_metal_imports_nothing_from_services():
    graph = import_graph()
    reaching = {
        m: sorted(t for t in graph[m] if t.startswith("services")) for m in graph if m.startswith("metal")
    }
    assert {m: t for m, t in reaching.items() if t} == {}


def test_the_services_import_neither_ops_nor_tools():
    """core, experts, gateway and common run in a request's path: the command line, cluster
    files, deploy and the offline tools (split, model builders, evaluation) stay outside it."""
    graph = import_graph()
    runtime = ("services.core", "services.experts", "services.gateway", "services.common", "metal")
    reaching = {
        m: sorted(t for t in graph[m] if t.startswith(("services.ops", "services.tools")))
        for m in graph
        if m.startswith(runtime)
    }
    assert {m: t for m, t in reaching.items() if t} == {}
    tools_reaching_ops = {m: sorted(t for t in graph[m] if t.startswith("services.ops")) for m in graph}
    assert {m: t for m, t in tools_reaching_ops.items() if t and m.startswith("services.tools")} == {}


def test_the_checker_sees_a_cycle_and_a_lazy_import(tmp_path):
    """The walk itself: a cycle closed by an import inside a function is found; one under
    TYPE_CHECKING is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import y\n\ndef f():\n    from z import w\n"
    )
    modules = {"x": source, "y": source, "z": source, "z.w": source}
    assert imports_of("x", source, modules) == {"z.w"}
