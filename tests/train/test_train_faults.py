"""``torchckpt train`` on several processes when processes are missing or die: a rank SIGKILLed mid-training is
named with its signal (torchrun's failure report, read by ``failed_ranks``), and a ``WORLD_SIZE`` larger than the
processes started stops within ``--rendezvous-timeout``, saying what is missing. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchckpt._testing import free_port
from torchckpt.train.distributed import failed_ranks

TINY = ["--size", "tiny", "--batch-size", "2", "--seq-len", "32", "--budget", "100%", "--no-save"]

# torchrun's failure table, as torch/distributed/elastic/multiprocessing/errors formats it
REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
torchckpt FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-06_23:50:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_23:50:00
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
============================================================
""".splitlines()


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", COLUMNS="120", OMP_NUM_THREADS="1", **extra)


def test_failed_ranks_reads_torchruns_report() -> None:
    # the root cause first, though torchrun lists it last
    assert failed_ranks(REPORT) == [(1, "was killed by signal 9 (SIGKILL)"), (0, "exited with code 1")]
    assert failed_ranks(["nothing here"]) == []


def test_world_size_larger_than_the_processes_started_stops_in_bounded_time(tmp_path: Path) -> None:
    """Rank 0 alone waits for a second process that never comes; rank 1 alone finds no rank 0: both stop."""
    started = []
    for rank, port in ((0, free_port()), (1, free_port())):  # two ports: neither finds the other
        env = _env(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        started.append(subprocess.Popen(
            [sys.executable, "-m", "torchckpt", "train", *TINY, "--steps", "1", "--rendezvous-timeout", "1",
             "--dir", str(tmp_path / f"rank{rank}")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    (_, alone), (_, lost) = (process.communicate(timeout=120) for process in started)
    assert [process.returncode for process in started] == [2, 2]
    assert "rank 0: 1 of the 2 processes of WORLD_SIZE=2 joined at 127.0.0.1:" in alone
    assert "within --rendezvous-timeout 1 s" in alone and "Traceback" not in alone
    assert "rank 1: rank 0 of WORLD_SIZE=2 could not be reached at 127.0.0.1:" in lost
    assert "Traceback" not in lost


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(word) for word in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _rank_process(pid: int, rank: int) -> int | None:
    for child in _descendants(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID=none" not in environ[:0]:
            return child
    return None


@pytest.mark.slow  # ~30 s: torchrun and two ranks; the report's reading is test_failed_ranks_reads_torchruns_report
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank's process in /proc")
def test_a_rank_killed_mid_training_is_named_with_its_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "torchckpt", "train", "--nproc", "2", *TINY, "--steps", "100000",
                            "--dir", str(run_dir)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.monotonic() + 180
        losses = run_dir / "losses.jsonl"
        while time.monotonic() < deadline and not (losses.is_file() and losses.read_text().count("\n") >= 2):
            time.sleep(0.2)
        victim = _rank_process(job.pid, 1)
        assert victim is not None, "rank 1's process was not found"
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=30)
    assert job.returncode != 0
    assert "torchckpt train --nproc 2: rank 1 was killed by signal 9 (SIGKILL) first" in err, err[-3000:]
    assert "PlanLayoutWarning" not in err  # planned under FSDP2, for FSDP2


def hanging_exit_worker(rank: int, port: int, out_dir: str, world: int) -> None:
    """Join a 2-rank gloo group as the job does, then leave it with a shutdown that hangs (as DDP's can)."""
    import torch.distributed as dist

    from torchckpt.train.distributed import join_process_group

    ranks = join_process_group({"WORLD_SIZE": str(world), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(port)}, timeout_s=60)
    assert ranks is not None
    dist.destroy_process_group = lambda *args, **kwargs: time.sleep(3600)  # the hang
    Path(out_dir, f"{rank}.left").write_text("")
    ranks.leave(timeout_s=1.0)
    raise AssertionError("leave() returned although the shutdown hung")  # pragma: no cover


def test_a_shutdown_that_hangs_does_not_keep_the_job_alive(tmp_path: Path) -> None:
    from torchckpt._testing import spawn_processes

    codes = spawn_processes(hanging_exit_worker, 2, out_dir=str(tmp_path), deadline_s=90)
    assert codes == [0, 0]  # None would be a process still running at the deadline: killed, and the test fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.left", "1.left"]
