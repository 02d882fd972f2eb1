"""``torchckpt train`` on two processes (torchrun, FSDP2, gloo): trains within the per-process budget, and the
plan does not change the run: the losses at two budgets are bitwise equal. Without --no-save it refuses, in
one line, before training (sharded state cannot be saved yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from torchckpt.train import read_losses

TINY = ["--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--steps", "4"]


def _env() -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120", OMP_NUM_THREADS="1")


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchckpt", "train", *args], check=False, capture_output=True,
                          text=True, timeout=280, env=_env())


def test_two_processes_train_within_the_per_process_budget_and_the_plan_changes_nothing(tmp_path: Path) -> None:
    runs = {}
    for budget in ("100%", "75%"):
        run_dir = tmp_path / budget.rstrip("%")
        done = _train("--nproc", "2", *TINY, "--budget", budget, "--no-save", "--dir", str(run_dir))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["processes"] == 2 and summary["step"] == 4 and summary["checkpoint_steps"] == []
        assert summary["peak_bytes"] <= summary["budget_bytes"], summary  # the largest process's peak
        assert done.stdout.count("torchckpt train: ") == 1  # rank 0 speaks for the run
        assert "FSDP2 over 2 processes" in done.stdout and "regions: off: 2 blocks are FSDP2 units" in done.stdout
        assert not (run_dir / "checkpoints").exists()
        runs[budget] = (read_losses(run_dir), summary)
    assert len(runs["100%"][0]) == 4
    assert runs["100%"][0] == runs["75%"][0]  # bitwise: checkpointing under FSDP2 is exact
    assert runs["75%"][1]["peak_bytes"] < runs["100%"][1]["peak_bytes"]  # and it does free memory


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
