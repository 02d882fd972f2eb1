"""Start-up: ``import torchckpt`` imports no torch, its public names no ``torch._dynamo``, and ``torchckpt --help``
imports no torch (exact checks of ``sys.modules`` in a fresh process; bench/startup.py times them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIGHT = """
import io, sys, contextlib
import torchckpt
light = "torch" not in sys.modules
from torchckpt.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):  # argparse exits after help
    main(["--help"])
print(light, "torch" not in sys.modules)
"""

EVERY_NAME = """
import sys
import torchckpt
for name in torchckpt.__all__:
    getattr(torchckpt, name)
print("torch" in sys.modules, "torch._dynamo" in sys.modules)
"""
HOW = "find what imports it with: python -X importtime -c 'import torchckpt'"


def _fresh(program: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_import_torchckpt_and_help_load_no_torch() -> None:
    """So neither loads torch._dynamo (nor anything of torch): exact, in a fresh process."""
    assert _fresh(LIGHT) == ["True", "True"], f"import torchckpt or torchckpt --help imported torch; {HOW}"


@pytest.mark.slow  # a fresh process imports torch and every torchckpt namespace (seconds); the test above is fast
def test_the_public_names_load_no_dynamo() -> None:
    assert _fresh(EVERY_NAME) == ["True", "False"], f"a public name imported torch._dynamo; {HOW}"


@pytest.mark.slow  # five fresh interpreters, two of them importing torch
def test_the_startup_benchmark_writes_its_results(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "startup.py"), "--rounds", "1", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "startup.json").read_text())
    assert set(results["cases"]) == {"python", "import torch", "import torchckpt", "torchckpt, every public name",
                                     "torchckpt --help"}
    assert results["cases"]["import torch"]["ratio_to_torch"] == 1.0 and len(results["targets"]) == 2
