"""``torchckpt train`` on several processes saves sharded checkpoints: stopped after 4 steps and run again to
6 under a plan (75%: blocks recomputed), the losses are bitwise those of a run without checkpointing that went
to 6 at once, and every process stayed within the budget; run again on one process, the model and AdamW are
resharded and the job says what it did not carry over. (Training on two "machines" is run from
docs/distributed.md's commands by tests/distributed/test_distributed_docs.py, in the slow tier.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchckpt.train import read_losses

TINY = ["--size", "tiny", "--batch-size", "4", "--seq-len", "64", "--save-every", "2", "--budget", "100%"]


def _env() -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120", OMP_NUM_THREADS="1")


def _train(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "torchckpt", "train", *args], check=False, capture_output=True,
                          text=True, timeout=280, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # 76 s; the fast tier checks its parts: sharded resumes bitwise (tests/distributed), FSDP2 plans
# bitwise (test_plans_distributed.py), the --nproc launcher (test_rendezvous*.py), one-process resumes (test_train.py)
def test_two_processes_stop_and_resume_under_a_plan_bitwise(tmp_path: Path) -> None:
    """2 steps, stopped, resumed to 4 under a plan, equal to an unplanned run of 4."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train("--nproc", "2", *TINY, "--steps", "4", "--dir", str(whole))
    _train("--nproc", "2", *TINY, "--budget", "75%", "--steps", "2", "--dir", str(split))
    resumed = _train("--nproc", "2", *TINY, "--budget", "75%", "--steps", "4", "--dir", str(split))
    assert "resumed from" in resumed.stdout and "step-000000002" in resumed.stdout
    assert "plan reused from step 2 (made for FSDP2 over 2 processes, batch 4 x 64 per process" in resumed.stdout
    assert "planning" not in resumed.stdout  # plan_record.py's [a plan follows the job]: nothing profiled
    assert read_losses(split) == read_losses(whole) and len(read_losses(whole)) == 4
    summary = json.loads((split / "summary.json").read_text())  # the largest peak over the ranks
    assert summary["predicted_extra_s"] > 0 and summary["peak_bytes"] <= summary["budget_bytes"], summary


@pytest.mark.slow  # the fast tier has test_two_processes_stop_and_resume_under_a_plan_bitwise
def test_two_processes_save_and_resume_bitwise(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train("--nproc", "2", *TINY, "--steps", "6", "--dir", str(whole))
    _train("--nproc", "2", *TINY, "--budget", "75%", "--steps", "4", "--dir", str(split))
    manifest = json.loads((split / "checkpoints" / "step-000000004" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    resumed = _train("--nproc", "2", *TINY, "--budget", "75%", "--steps", "6", "--dir", str(split))
    assert "resumed from" in resumed.stdout and "step-000000004" in resumed.stdout
    assert read_losses(split) == read_losses(whole) and len(read_losses(whole)) == 6
    summary = json.loads((split / "summary.json").read_text())  # the largest peak over the ranks
    assert summary["predicted_extra_s"] > 0 and summary["peak_bytes"] <= summary["budget_bytes"], summary
    one = _train(*TINY, "--steps", "8", "--dir", str(split))  # one process: resharded, the loader restarts
    assert "resumed from" in one.stdout and "step-000000006" in one.stdout
    # plan_record.py's [a plan follows the job]: planned again for one process, before the first step
    said = one.stdout.split("resumed from")[0]
    assert "planned (the plan stored in step 6: the layout changed)" in said
    assert ("the layout changed since step 6: FSDP2 over 2 processes, batch 4 x 64 per process -> one process, "
            "batch 4 x 64; predicted peak per process ") in said
    assert json.loads((split / "baseline.json").read_text())["every_block_peak_bytes"] > 0  # measured here
    assert "saved by 2 rank(s) and is restored on 1" in one.stderr and "item 'loader' not restored" in one.stderr
    assert "(model, AdamW, LR schedule; not restored: data position, RNG, as warned above)" in one.stdout
    assert sorted(read_losses(split)) == list(range(1, 9))
    again = _train(*TINY, "--steps", "10", "--dir", str(split))  # one process again: its own plan, reused
    assert "plan reused from step 8 (made for one process, batch 4 x 64, --budget 100%); not profiled" in again.stdout
    assert "planning" not in again.stdout and sorted(read_losses(split)) == list(range(1, 11))


@pytest.mark.slow  # 50 s; the fast tier plans offload under DDP (tests/distributed/test_plans_distributed.py)
def test_two_processes_train_with_offload_beside_fsdp2_bitwise(tmp_path: Path) -> None:
    """`--offload --nproc 2`: each FSDP2 process plans offload from the agreed figures, trains within the budget,
    and the losses are bitwise those of a run without checkpointing."""
    whole, offloaded = tmp_path / "whole", tmp_path / "offloaded"
    _train("--nproc", "2", *TINY, "--steps", "2", "--dir", str(whole))
    done = _train("--nproc", "2", *TINY[:-2], "--budget", "70%", "--offload", "--steps", "2", "--dir", str(offloaded))
    assert "host" in done.stdout, done.stdout[-3000:]  # the plan's host memory line
    assert read_losses(offloaded) == read_losses(whole) and len(read_losses(whole)) == 2
    summary = json.loads((offloaded / "summary.json").read_text())
    assert summary["peak_bytes"] <= summary["budget_bytes"], summary
