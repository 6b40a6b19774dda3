"""No import cycles inside ``worker/``, counting every import statement: top level, under
``TYPE_CHECKING`` and inside functions. A cycle hides which module is the lower layer; the
records (``core.handler``, ``sql.rows``) are leaves so that nothing needs one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "worker"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, each resolved to the module itself (``from
    worker.sql import inbox`` depends on ``worker.sql.inbox``, not on ``worker.sql``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_type_checking_and_function_level_imports_count() -> None:
    graph = import_graph()
    # router imports the context under TYPE_CHECKING only, the CLI imports runner in functions
    assert "worker.core.context" in graph["worker.core.router"]
    assert "worker.ops.runner" in graph["worker.ops.cli.run"]


def test_the_hot_path_depends_on_no_settings_metrics_or_operator_tools() -> None:
    graph = import_graph()
    core = [name for name in graph if name.startswith(("worker.core", "worker.sql"))]
    reached = set(core)
    frontier = list(core)
    while frontier:
        for other in graph[frontier.pop()] - reached:
            reached.add(other)
            frontier.append(other)
    assert not {
        name
        for name in reached
        if name.startswith("worker.ops")
        or name in {"worker.settings", "worker.transport"}
        or name.startswith("worker.transport")
    }


def test_nothing_on_the_message_path_imports_the_operator_tools() -> None:
    graph = import_graph()
    below = [
        name for name in graph if name.startswith(("worker.core", "worker.sql", "worker.transport"))
    ]
    assert {
        (name, other)
        for name in below
        for other in graph[name]
        if other == "worker.ops" or other.startswith("worker.ops.")
    } == set()
