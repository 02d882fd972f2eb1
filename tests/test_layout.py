"""The layout's rules, read off the source with ``ast``: no import cycles (function-level imports included),
applications are leaves, private names stay home, files stay small, the solver never needs torch, and the three
activation-checkpointing subsystems live in their own packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "torchckpt"
MAX_LINES = 460  # "no source file over ~450 lines without a stated reason"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``path``, relative ones resolved."""
    found: list[tuple[str, str | None, int]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.extend((base, alias.name, node.lineno) for alias in node.names)
    return found


MODULES = _modules()


def _graph() -> dict[str, set[str]]:
    """Module -> the torchckpt modules it imports anywhere (module level, in functions, under TYPE_CHECKING).

    ``from package import name`` counts as an import of ``package.name`` when that is a module, else of
    ``package``; a package's ``__init__`` run on the way to a submodule is not an edge (it would make every
    module depend on ``torchckpt/__init__.py``)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = set()
        for imported, name, _ in _imports(path, module):
            target = f"{imported}.{name}" if name and f"{imported}.{name}" in MODULES else imported
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles (each line one strongly connected set of modules; break the edge that " \
                         "points up the layers):\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # a function-level import is an edge too
    assert _imports(Path(__file__), "tests.test_layout").count(("torchckpt.planner", "solve", _LATE_IMPORT_LINE)) == 1


def test_the_solver_needs_no_torch() -> None:
    """Everything ``planner/solve`` imports, followed to the end, imports no torch (the subprocess test in
    tests/planner/test_solve.py runs it with torch blocked)."""
    graph = _graph()
    seen, todo = set(), [m for m in MODULES if _inside(m, "torchckpt.planner.solve")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    torch_users = sorted(m for m in seen for imported, _, _ in _imports(MODULES[m], m)
                         if imported.split(".")[0] == "torch")
    assert "torchckpt.planner.costs" in seen and torch_users == []


def _late_import() -> object:
    from torchckpt.planner import solve  # read by test_the_cycle_check_can_fail, never called

    return solve


_LATE_IMPORT_LINE = _late_import.__code__.co_firstlineno + 1


def _violations(rule) -> list[str]:  # noqa: ANN001 - a predicate over (module, imported, name)
    out = []
    for module, path in MODULES.items():
        for imported, name, line in _imports(path, module):
            if rule(module, imported, name):
                out.append(f"{path.relative_to(SRC.parent)}:{line}: {module} imports {imported}"
                           + (f".{name}" if name else ""))
    return out


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_only_cli_imports_cli() -> None:
    # ``python -m torchckpt`` (torchrun's ``-m torchckpt train``) is the command line's second entry point
    entry_points = ("torchckpt.cli", "torchckpt.__main__")
    assert _violations(lambda m, i, n: _inside(i, "torchckpt.cli")
                       and not any(_inside(m, e) for e in entry_points)) == []


def test_only_cli_and_train_import_train() -> None:
    def rule(module: str, imported: str, name: str | None) -> bool:
        return _inside(imported, "torchckpt.train") and not (_inside(module, "torchckpt.cli")
                                                             or _inside(module, "torchckpt.train"))
    assert _violations(rule) == []


def test_no_private_name_crosses_modules() -> None:
    def rule(module: str, imported: str, name: str | None) -> bool:
        private = name is not None and name.startswith("_") and not name.startswith("__")
        return private and imported.startswith("torchckpt") and imported != module
    assert _violations(rule) == []


def test_the_rules_above_can_fail() -> None:
    """The checks read real imports: this file's own imports are found, with their line numbers."""
    here = _imports(Path(__file__), "tests.test_layout")
    assert ("ast", None, 7) in here and ("pathlib", "Path", 8) in here


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_source_file_is_long(module: str) -> None:
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines; split it along a seam (limit {MAX_LINES})"


def test_three_subsystems_in_three_packages() -> None:
    for package in ("executor", "planner", "loops"):
        assert (SRC / package / "__init__.py").is_file()
    assert not (SRC / "remat").exists()
    # The solver is pure: it never imports torch (tests/planner/test_solve.py runs it with torch blocked).
    solver = [m for m in MODULES if _inside(m, "torchckpt.planner.solve")]
    assert solver and not [v for v in _violations(lambda m, i, n: m in solver and i.split(".")[0] == "torch")]


# state/'s subpackages from the bottom up: each may import only errors.py and the ones before it (their
# __init__ docstrings say the same).
STATE_LAYERS = ("errors", "process", "live", "format", "storage", "read", "sharded", "checkpointer")


def _state_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["torchckpt", "state"] or len(parts) < 3:
        return None
    return STATE_LAYERS.index(parts[2]) if parts[2] in STATE_LAYERS else None


def test_state_subpackages_import_downwards() -> None:
    assert sorted(p.name for p in (SRC / "state").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        STATE_LAYERS[1:])
    upward = [f"{m} imports {i}" for m, edges in _graph().items() for i in edges
              if _state_layer(m) is not None and _state_layer(i) is not None and _state_layer(i) > _state_layer(m)]
    assert upward == []
    for layer in STATE_LAYERS[1:]:
        doc = ast.get_docstring(ast.parse((SRC / "state" / layer / "__init__.py").read_text())) or ""
        assert "import" in doc, f"state/{layer}/__init__.py must say what it may import"
