"""Preemption by a SIGTERM to the whole process group, which kills the DataLoader workers too, and a
pending SIGTERM honoured by ``save`` (not only ``maybe_save``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from state_helpers import WORKERS, run_worker, tiny_model, worker_env
from test_state_resume import TOTAL_STEPS, _reference, _segments

from torchckpt.state import Checkpointer
from torchckpt.state.format.layout import parse_step_dir_name

# Every test here needs torchdata (the `train` extra); bench/cuda_check.sh collects this file where it is absent.
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

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


@pytest.mark.parametrize("at_step, delay_s", [(11, 0.0), pytest.param(19, 0.02, marks=pytest.mark.slow)])
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



class _Items(torch.utils.data.Dataset):
    """Eight numbers, each taking ``load_s`` to load."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.load_s)
        return torch.tensor(float(index))


def _slow_worker_start(worker_id: int) -> None:
    time.sleep(0.4)


# Where the main thread waits when the SIGTERM lands, just after the last step of an epoch:
WAITS = {
    # the new epoch's iterator is built and waits for its first batch (200 ms to load)
    "first_batch": {"load_s": 0.05, "worker_init_fn": None},
    # the new epoch's iterator is still starting: its workers take 400 ms to answer, the loader still
    # reports the finished iterator, and torch's RNG has already given the new one its base seed
    "workers_starting": {"load_s": 0.0, "worker_init_fn": _slow_worker_start},
}


def _loader(wait: str) -> StatefulDataLoader:
    return StatefulDataLoader(_Items(WAITS[wait]["load_s"]), batch_size=4, shuffle=True, num_workers=1,
                              worker_init_fn=WAITS[wait]["worker_init_fn"])


def _next_epoch(loader: StatefulDataLoader) -> tuple[list[float], torch.Tensor]:
    """The first batch of the loader's next epoch and the next numbers torch's RNG gives (dropout's)."""
    batch = next(iter(loader))
    return batch.tolist(), torch.rand(4)


@pytest.mark.parametrize("wait", sorted(WAITS))
def test_sigterm_as_a_new_epoch_starts_resumes_bitwise(run_dir, wait):
    """A SIGTERM just after an epoch's last step, while the next epoch's iterator starts or waits for its
    first batch: the resumed run sees the same batches and random numbers as an uninterrupted one. (The
    "workers_starting" case failed once in CI as a resumed run's losses differing from the first step of
    the next epoch on: the step was saved with the RNG streams after the new iterator's seed draw.)"""
    torch.manual_seed(7)
    loader = _loader(wait)
    for _ in loader:  # one epoch, 2 steps
        pass
    expected = _next_epoch(loader)  # what an uninterrupted run sees next

    torch.manual_seed(7)
    loader = _loader(wait)
    ckpt = Checkpointer(run_dir, save_on_preemption=True)
    step = 0
    for _ in loader:
        step += 1
        ckpt.maybe_save(step, loader=loader)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(SystemExit) as caught:
        for _ in loader:  # the SIGTERM lands while iter() starts the workers or waits for the batch
            pytest.fail("the first batch of the new epoch arrived before the SIGTERM was handled")
    timer.join()
    assert caught.value.code == 0
    torch.manual_seed(12345)  # anything: the restore sets it
    resumed = _loader(wait)
    with Checkpointer(run_dir, read_only=True) as reader:
        assert reader.restore(loader=resumed) == 2
    got = _next_epoch(resumed)
    assert got[0] == expected[0], "a different first batch"
    assert torch.equal(got[1], expected[1]), "torch's RNG streams differ from an uninterrupted run's"
