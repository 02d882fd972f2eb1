"""The ``torchckpt`` command: help, version, and the demo end to end on the tiny GPT."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import torchckpt
from torchckpt.cli.main import main


def _torchckpt(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "torchckpt.cli.main", *args], check=False, capture_output=True,
                          text=True, timeout=600, env=env)


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"torchckpt {torchckpt.__version__}"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "train" in out


def test_demo_reports_memory_saving_and_equal_gradients() -> None:
    result = _torchckpt("demo", "--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "2")
    assert result.returncode == 0, result.stderr
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    assert set(lines) == {"no checkpointing", "every block, recompute all", "every block, keep matmuls"}
    assert all(line.count("equal") == 2 for line in lines.values())
    saving = int(lines["every block, recompute all"].split("│")[3].strip().rstrip("%"))
    assert saving < 100  # recomputing every block lowers the measured peak


def test_bad_option_is_explained() -> None:
    result = _torchckpt("demo", "--steps", "0")
    assert result.returncode == 2
    assert "must be a positive integer; got 0" in result.stderr


def test_plan_and_frontier_commands(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = _torchckpt("plan", "--model", "gpt-tiny", "--batch-size", "4", "--seq-len", "128", "--budget", "75%",
                        "--out", str(out), "--plot", str(tmp_path / "plan.png"))
    assert result.returncode == 0, result.stderr
    assert "predicted peak" in result.stdout and out.is_file() and (tmp_path / "plan.png").stat().st_size > 0
    result = _torchckpt("plan", "--model", "unet-tiny", "--batch-size", "2", "--image-size", "16", "--budget", "80%")
    assert result.returncode == 0 and "predicted peak" in result.stdout, result.stderr
    result = _torchckpt("frontier", "--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--points", "3",
                        "--plot", str(tmp_path / "front.png"))
    assert result.returncode == 0, result.stderr
    assert "checkpoint every block" in result.stdout and (tmp_path / "front.png").stat().st_size > 0
    result = _torchckpt("plan", "--model", "gpt-tiny", "--batch-size", "2", "--seq-len", "32", "--budget", "1000")
    assert result.returncode == 2 and "smallest feasible peak" in result.stderr
