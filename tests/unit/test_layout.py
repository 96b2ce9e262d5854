"""The project's shape: imports point one way with no circles, every command-line entry point
starts."""

from __future__ import annotations

import ast
import runpy
import sys

import pytest

from tests.launch import REPO


PACKAGES = ("dtrain", "models", "parallel", "tools")
# Which packages each may import: models is pure math, parallel reads models, the rest glue.
ALLOWED = {"models": {"models"}, "parallel": {"models", "parallel"}, "dtrain": {"dtrain", "models", "parallel"},
           "tools": set(PACKAGES)}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            found[name] = (path, ast.parse(path.read_text()))
    return found


def _runtime_imports(name: str, path, tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules `name` imports when it runs (imports under `if TYPE_CHECKING:` do not)."""
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" for alias in node.names)
            targets.add(base)
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        # A package's own submodules are its contents, not an import back into it.
        if target and target != name and not (path.name == "__init__.py" and target.startswith(name + ".")):
            resolved.add(target)
    return resolved


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges[child]))))
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
                    circles.append(sorted(component))
    return circles


def test_imports_point_one_way_and_never_in_a_circle():
    modules = _modules()
    edges = {name: _runtime_imports(name, path, tree, set(modules)) for name, (path, tree) in modules.items()}
    assert _circles(edges) == []
    wrong_way = [(name, target) for name, targets in edges.items() for target in targets
                 if target.split(".")[0] not in ALLOWED[name.split(".")[0]]]
    assert wrong_way == []
    # The check itself sees a circle when there is one.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


ENTRY_POINTS = ["dtrain.run", "dtrain.launch", "tools.bench", "tools.bench_suite", "tools.compare_runs",
                "tools.hf_convert", "tools.preprocess_data", "tools.restart_time", "tools.docs"]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_line_entry_point_starts(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
