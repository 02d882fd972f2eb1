"""Preemption by a SIGTERM to the whole process group, which kills the DataLoader workers too, and a
pending SIGTERM honoured by ``save`` (not only ``maybe_save``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from state_helpers import WORKERS, run_worker, tiny_model, worker_env
from test_state_resume import TOTAL_STEPS, _reference, _segments

from torchckpt.state import Checkpointer
from torchckpt.state.format import parse_step_dir_name

VARIANT = "adamw-step-preempt-workers"


def _killpg_at(run_dir: str, log: str, at_step: int, delay_s: float) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        [sys.executable, WORKERS, "train", run_dir, log, VARIANT, str(TOTAL_STEPS)],
        env=worker_env(), stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(log) and f"\n{at_step} " in Path(log).read_text():
            break
        time.sleep(0.005)
    time.sleep(delay_s)
    os.killpg(process.pid, signal.SIGTERM)  # as Slurm and Kubernetes do: the workers get it too
    _, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, "", stderr)


@pytest.mark.slow
@pytest.mark.parametrize("at_step, delay_s", [(11, 0.0), (19, 0.02)])
def test_sigterm_to_the_process_group_saves_and_resumes_bitwise(tmp_path, at_step, delay_s):
    reference = _reference(tmp_path, VARIANT)
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "interrupted.log")
    done = _killpg_at(run_dir, log, at_step, delay_s)
    assert done.returncode == 0, f"preempted run did not exit cleanly:\n{done.stderr[-3000:]}"
    assert "torchckpt: SIGTERM received; saved step" in done.stderr
    run_worker("train", run_dir, log, VARIANT, str(TOTAL_STEPS))
    first, resumed = _segments(log)
    assert resumed["restored"] == max(first["losses"]) >= at_step
    assert resumed["finished"] and sorted(resumed["losses"]) == list(range(resumed["restored"] + 1, TOTAL_STEPS + 1))
    for segment in (first, resumed):
        for step, loss in segment["losses"].items():
            assert loss == reference[step], f"step {step}: loss {loss} != uninterrupted {reference[step]}"


def test_save_honours_a_pending_sigterm(run_dir):
    before = signal.getsignal(signal.SIGTERM)
    model = tiny_model()
    ckpt = Checkpointer(run_dir, save_on_preemption=True)
    ckpt.save(1, model=model)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as caught:
        ckpt.save(2, model=model)
    assert caught.value.code == 0
    assert sorted(s for s in map(parse_step_dir_name, os.listdir(run_dir)) if s is not None) == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is before
    Checkpointer(run_dir).close()
