"""The layout's rules, read off the source with ``ast``: applications are leaves, private names stay home,
files stay small, and the three activation-checkpointing subsystems live in their own packages."""

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
    assert ("ast", None, 6) in here and ("pathlib", "Path", 7) in here


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
