"""``torchckpt train`` on several processes without --no-save refuses, in one line, before training: sharded
state cannot be saved yet. (Training on two processes, within budget and bitwise equal at two budgets, and on
two "machines", is run from docs/distributed.md's commands by tests/distributed/test_distributed_docs.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TINY = ["--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "4"]


def _env() -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120", OMP_NUM_THREADS="1")


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchckpt", "train", *args], check=False, capture_output=True,
                          text=True, timeout=280, env=_env())


def test_without_no_save_it_refuses_before_starting_processes(tmp_path: Path) -> None:
    done = _train("--nproc", "2", *TINY, "--dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "add --no-save" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_under_torchrun_each_process_refuses_to_save_sharded_state(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "torchckpt",
               "train", *TINY, "--dir", str(tmp_path / "run")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=280, env=_env())
    assert done.returncode != 0
    assert "cannot save sharded (FSDP2) training state yet" in done.stderr and "--no-save" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
