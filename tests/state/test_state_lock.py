"""One writer per directory: the second gets an error naming the holder; a dead holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from state_helpers import worker_env

from torchckpt.state import Checkpointer, CheckpointLockedError


def test_second_writer_in_same_process_is_refused(run_dir):
    with Checkpointer(run_dir), pytest.raises(CheckpointLockedError, match=f"locked by pid {os.getpid()} on host"):
        Checkpointer(run_dir)
    Checkpointer(run_dir).close()  # released on close


def test_writer_in_other_process_is_named_and_its_death_frees_the_lock(run_dir):
    code = (
        "import sys, time; from torchckpt.state import Checkpointer; "
        f"c = Checkpointer({run_dir!r}); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=worker_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointLockedError, match=f"locked by pid {holder.pid} on host .* since"):
            Checkpointer(run_dir)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    Checkpointer(run_dir).close()  # the kernel released the dead holder's flock
