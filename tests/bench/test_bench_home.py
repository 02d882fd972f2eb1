"""One benchmark home: the harness lives in the checkout's ``bench/`` (``python bench/run.py``, ``make bench``);
the installed package only says so (``torchckpt bench``) and never imports benchmark code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from torchckpt.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [[], ["--quick"], ["--models", "gpt-tiny", "--out-dir", "x"], ["-h"]])
def test_torchckpt_bench_says_where_it_runs_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert "source checkout" in line and "make bench" in line and "python bench/run.py --quick" in line


def test_src_imports_no_benchmark_code() -> None:
    assert not (ROOT / "src" / "torchckpt" / "bench").exists()
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] not in ("bench", "harness", "cuda_check"), f"{path} imports {name}"
                assert not name.startswith("torchckpt.bench"), f"{path} imports {name}"


def test_harness_modules_import_each_other_relatively() -> None:
    for path in (ROOT / "bench" / "harness").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] != "harness", f"{path}: use a relative import"


def test_run_py_help_and_bad_options() -> None:
    run = [sys.executable, str(ROOT / "bench" / "run.py")]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0 and "--quick" in shown.stdout and "--from-json" in shown.stdout
    bad = subprocess.run([*run, "--repeats", "0"], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "repeats must be >= 1" in bad.stderr, bad.stderr


def test_make_bench_runs_bench_run_py() -> None:
    target = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "bench/run.py $(BENCH_ARGS)" in target and "torchckpt bench" not in target
