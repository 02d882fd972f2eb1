"""Bit-exact resume: a run killed (SIGKILL) or preempted (SIGTERM) and resumed in a fresh process
produces bitwise the same per-step losses as an uninterrupted run.

The run (state_workers.run_training): MLP with dropout, AdamW+OneCycleLR or SGD(nesterov)+StepLR,
a shuffling StatefulDataLoader over several epochs, input noise drawn from Python ``random`` and
NumPy, a plain-dict item; checkpoints every step (or only on preemption), keep_last=2.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from state_helpers import WORKERS, run_worker, worker_env

TOTAL_STEPS = 40


def _segments(log_path: str) -> list[dict]:
    """Split a losses log into one segment per process: restored step, {step: loss hex}, finished."""
    segments: list[dict] = []
    for line in Path(log_path).read_text().splitlines():
        if line.startswith("restored "):
            segments.append({"restored": int(line.split()[1]), "losses": {}, "finished": False})
        elif line == "finished":
            segments[-1]["finished"] = True
        elif line:
            step, loss = line.split()
            segments[-1]["losses"][int(step)] = loss
    return segments


def _reference(tmp_path, variant: str) -> dict[int, str]:
    log = str(tmp_path / "reference.log")
    run_worker("train", "-", log, variant, str(TOTAL_STEPS))
    [segment] = _segments(log)
    assert segment["finished"] and sorted(segment["losses"]) == list(range(1, TOTAL_STEPS + 1))
    return segment["losses"]


def _start_and_interrupt(
    run_dir: str, log: str, variant: str, at_step: int, how: signal.Signals, delay_s: float
) -> int:
    process = subprocess.Popen(
        [sys.executable, WORKERS, "train", run_dir, log, variant, str(TOTAL_STEPS)],
        env=worker_env(), stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(log) and f"\n{at_step} " in Path(log).read_text():
            break
        time.sleep(0.005)
    time.sleep(delay_s)
    process.send_signal(how)
    _, stderr = process.communicate(timeout=60)
    if how == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL, f"worker ended before the kill:\n{stderr[-3000:]}"
    else:
        assert process.returncode == 0, f"preempted worker did not exit cleanly:\n{stderr[-3000:]}"
    return process.returncode


# One case in the fast tier (SIGKILL of an async-saving run); the others in the slow tier.
CASES = [
    pytest.param("adamw-onecycle-sync", signal.SIGKILL, 0, marks=pytest.mark.slow, id="adamw-onecycle-sync-SIGKILL"),
    pytest.param("sgd-step-async", signal.SIGKILL, 1, id="sgd-step-async-SIGKILL"),
    pytest.param("adamw-step-preempt", signal.SIGTERM, 2, marks=pytest.mark.slow, id="adamw-step-preempt-SIGTERM"),
    pytest.param("adamw-onecycle-staged", signal.SIGKILL, 3, marks=pytest.mark.slow,
                 id="adamw-onecycle-staged-SIGKILL"),
]


@pytest.mark.parametrize("variant, how, seed", CASES)
def test_interrupted_run_resumes_bit_exactly(tmp_path, variant, how, seed):
    chooser = random.Random(seed)
    reference = _reference(tmp_path, variant)
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "interrupted.log")
    at_step = chooser.randint(6, TOTAL_STEPS - 8)  # crosses epoch boundaries (8 batches per epoch)
    _start_and_interrupt(run_dir, log, variant, at_step, how, delay_s=chooser.uniform(0.0, 0.03))
    run_worker("train", run_dir, log, variant, str(TOTAL_STEPS))

    first, resumed = _segments(log)
    last_before = max(first["losses"])
    restored = resumed["restored"]
    assert first["restored"] == 0 and not first["finished"] and last_before >= at_step
    if how == signal.SIGTERM:
        assert restored == last_before  # saved at the next safe point, then exited
    else:
        assert last_before - 2 <= restored <= last_before and restored >= 1
    assert resumed["finished"] and sorted(resumed["losses"]) == list(range(restored + 1, TOTAL_STEPS + 1))
    for segment in (first, resumed):
        for step, loss in segment["losses"].items():
            assert loss == reference[step], f"step {step}: loss {loss} != uninterrupted {reference[step]}"
