"""A Checkpointer's life in its process: a save in flight at exit, a forked child, a dropped object."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from state_helpers import tiny_model, worker_env
from state_workers import bitwise_equal

from torchckpt.state import Checkpointer, CheckpointLockedError, verify_checkpoint

# A script whose async save is still being written when the interpreter exits: the write is held back
# 0.5 s, so the script's ending (given as {ending}) always comes first.
EXIT_SCRIPT = """
import sys, time, torch
from torchckpt.state import Checkpointer, CheckpointWriteError
from torchckpt.state.checkpointer import checkpointer as module
original = module.Checkpointer._write
def slow_write(self, *args):
    time.sleep(0.5)
    if {fail!r}:
        raise CheckpointWriteError("disk on fire")
    return original(self, *args)
module.Checkpointer._write = slow_write
torch.manual_seed(0)
ckpt = Checkpointer(sys.argv[1], async_save=True)
ckpt.save(1, model=torch.nn.Linear(4, 4))
{ending}
"""


def _run_script(source: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True,
                          env=worker_env(), timeout=120, check=False)


@pytest.mark.parametrize("ending, code", [("", 0), ("sys.exit(0)", 0), ("raise RuntimeError('boom')", 1)])
def test_async_save_in_flight_at_exit_is_committed(run_dir, ending, code):
    done = _run_script(EXIT_SCRIPT.format(fail=False, ending=ending), run_dir)
    assert done.returncode == code, done.stderr
    assert ("RuntimeError: boom" in done.stderr) == (code == 1)
    assert "torchckpt: error" not in done.stderr
    [info] = verify_checkpoint(run_dir, verify="full")
    assert (info.step, info.valid) == (1, True)
    torch.manual_seed(0)
    expected, restored = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=restored, rng=False) == 1
    assert bitwise_equal(restored.state_dict(), expected.state_dict())


def test_async_save_failing_at_exit_is_reported_on_stderr(run_dir):
    done = _run_script(EXIT_SCRIPT.format(fail=True, ending=""), run_dir)
    assert f"torchckpt: error: the save in flight at exit to {run_dir} failed and was not committed: " \
           "CheckpointWriteError: the background save failed: disk on fire" in done.stderr, done.stderr
    assert verify_checkpoint(run_dir, verify="full") == []


# Parent and child write each line with one os.write (atomic on a pipe): print writes its pieces one by one
# when PYTHONUNBUFFERED is set, and the two processes' lines then interleaved ("forkedchild refused: ...").
FORK_SCRIPT = """
import os, sys, time, torch
from torchckpt.state import Checkpointer, CheckpointError
say = lambda line: os.write(1, (line + "\\n").encode())
ckpt = Checkpointer(sys.argv[1])
pid = os.fork()
if pid == 0:  # stands for a DataLoader worker: it outlives its parent
    try:
        ckpt.save(5, model=torch.nn.Linear(2, 2))
        say("child saved")
    except CheckpointError as error:
        say(f"child refused: {error}")
    time.sleep(60)
    os._exit(0)
say(f"forked {pid}")
time.sleep(60)
"""


def test_forked_child_does_not_keep_the_lock_of_a_killed_parent(run_dir):
    parent = subprocess.Popen([sys.executable, "-c", FORK_SCRIPT, run_dir], stdout=subprocess.PIPE, text=True,
                              env=worker_env())
    lines = [parent.stdout.readline().strip(), parent.stdout.readline().strip()]
    [child_line] = [line for line in lines if line.startswith("forked ")]
    child = int(child_line.split()[1])
    try:
        assert [line for line in lines if line.startswith("child refused")] == [
            f"child refused: this Checkpointer for {run_dir} is closed; build a new one"
        ]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        os.kill(child, 0)  # the child is still alive
        Checkpointer(run_dir).close()  # and yet the lock is free
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if parent.poll() is None:
            parent.kill()
    assert verify_checkpoint(run_dir) == []  # the child wrote nothing


def test_dropped_checkpointer_releases_its_lock_and_signal_handlers(run_dir):
    before = signal.getsignal(signal.SIGTERM)
    ckpt = Checkpointer(run_dir, save_on_preemption=True, async_save=True)
    ckpt.save(1, model=tiny_model())
    ckpt.wait()
    assert signal.getsignal(signal.SIGTERM) is not before
    del ckpt
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is before
    with Checkpointer(run_dir) as again:
        assert again.latest_step() == 1


def test_second_checkpointer_in_this_process_is_told_to_close_the_first(run_dir):
    first = Checkpointer(run_dir)
    with pytest.raises(CheckpointLockedError, match=(
            f"locked by pid {os.getpid()} on host .*, which is this process: another Checkpointer on this "
            r"directory is still open here. Fix: call close\(\) on it")):
        Checkpointer(run_dir)
    first.close()
    Checkpointer(run_dir).close()


def test_dropped_async_checkpointer_finishes_its_save_first(run_dir):
    ckpt = Checkpointer(run_dir, async_save=True)
    ckpt.save(3, model=tiny_model())
    del ckpt  # the save thread holds it until the write is done; then it lets go
    deadline = time.monotonic() + 30
    while True:
        try:
            with Checkpointer(run_dir) as again:
                assert again.latest_step() == 3
            break
        except CheckpointLockedError:
            assert time.monotonic() < deadline, "the lock was never released"
            time.sleep(0.05)


# An async Checkpointer with preemption handlers dropped while its save is in flight: the save thread drops
# the last reference, so the finalizer runs there, where signal handlers cannot be changed. {before_drop}
# runs first (a SIGTERM already recorded starts the 50 ms SIGALRM timer).
DROP_SCRIPT = """
import gc, os, signal, sys, time, torch
from torchckpt.state import Checkpointer
from torchckpt.state.checkpointer import checkpointer as module
original = module.Checkpointer._write
def slow_write(self, *args):
    time.sleep(0.5)
    return original(self, *args)
module.Checkpointer._write = slow_write
ckpt = Checkpointer(sys.argv[1], save_on_preemption=True, async_save=True)
ckpt.save(1, model=torch.nn.Linear(4, 4))
{before_drop}
del ckpt
gc.collect()
time.sleep(1.5)  # the save is committed and the Checkpointer finalized, in the save thread
print("timer", signal.getitimer(signal.ITIMER_REAL), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2)
print("still alive after SIGTERM", flush=True)
"""


@pytest.mark.parametrize("before_drop", ["", "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)"],
                         ids=["idle", "preemption-requested"])
def test_checkpointer_dropped_during_its_async_save_lets_go_of_signals(run_dir, before_drop):
    done = _run_script(DROP_SCRIPT.format(before_drop=before_drop), run_dir)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "timer (0.0, 0.0)" in done.stdout  # the 50 ms timer is stopped, or SIGALRM would kill it later
    assert "still alive" not in done.stdout
    [info] = verify_checkpoint(run_dir, verify="full")
    assert (info.step, info.valid) == (1, True)
