"""The package as pip installs it: the wheel, built from this checkout, installed (not editable) into a fresh
virtual environment, runs the quickstart's commands; the sdist holds what running the tests needs.

The fresh environment sees this environment's site-packages (torch, torchdata, ...) through a ``.pth`` line,
which adds the folder to ``sys.path`` without running the ``.pth`` files in it, so the editable install of
torchckpt there stays out of sight: ``torchckpt`` imports from the wheel's files. Nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str | Path, cwd: Path, timeout: int = 600) -> str:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", COLUMNS="120")
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout + done.stderr


@pytest.mark.slow  # builds and installs the wheel, then plans and trains (about a minute on 2 CPU cores)
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_quickstart_commands(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", out, ROOT,
         cwd=tmp_path)
    wheel = next(out.glob("torchckpt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "torchckpt/py.typed" in names and "torchckpt/cli/main.py" in names
    assert not any(name.startswith(("tests/", "bench/")) for name in names)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "outer_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel,
         cwd=tmp_path)
    where = _run(python, "-c", "import torchckpt; print(torchckpt.__file__)", cwd=tmp_path).strip()
    assert where.startswith(str(site)), where  # the wheel's files, not the editable checkout

    torchckpt = venv / "bin" / "torchckpt"
    assert _run(torchckpt, "--version", cwd=tmp_path).startswith("torchckpt ")
    assert "exit codes" in _run(torchckpt, "--help", cwd=tmp_path)
    planned = _run(torchckpt, "plan", "--model", "gpt-tiny", "--batch-size", "4", "--seq-len", "64", "--budget", "70%",
                   cwd=tmp_path)
    assert "predicted peak" in planned and "profiling step 1" in planned
    trained = _run(torchckpt, "train", "--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "2",
                   "--save-every", "2", "--budget", "90%", "--dir", "runs/q", cwd=tmp_path)
    assert "step 2/2" in trained
    assert "step 2: OK" in _run(torchckpt, "verify", "runs/q", cwd=tmp_path)
    assert "│ 2 " in _run(torchckpt, "ls", "runs/q", cwd=tmp_path)
    _run(torchckpt, "export", "runs/q", "--out", "w.safetensors", cwd=tmp_path)
    assert (tmp_path / "w.safetensors").stat().st_size > 0


@pytest.mark.slow  # builds the sdist (seconds); tests/test_packaging.py checks MANIFEST.in in the fast tier
def test_the_sdist_holds_the_tests_docs_and_benchmark_results(tmp_path: Path) -> None:
    build = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    name = next(line for line in _run(sys.executable, "-c", build, tmp_path, cwd=ROOT).splitlines()
                if line.endswith(".tar.gz"))
    with tarfile.open(tmp_path / name) as sdist:
        names = {member.split("/", 1)[1] for member in sdist.getnames() if "/" in member}
    assert {"tests/test_readme.py", "tests/public_api.txt", "tests/state/cli_helpers.py", "docs/train.md",
            "bench/results/demo.txt", "bench/results/train_defaults.json", "src/torchckpt/py.typed", "Makefile",
            "README.md", "LICENSE", "pyproject.toml"} <= names
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)
