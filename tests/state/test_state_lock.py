"""One writer per directory: the second gets an error naming the holder; a dead holder frees it."""

from __future__ import annotations

import json
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


def test_a_symlinked_lock_is_refused_and_its_target_untouched(run_dir, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.makedirs(run_dir)
    os.symlink(target, os.path.join(run_dir, ".lock"))
    with pytest.raises(CheckpointLockedError, match=r"/\.lock is a symlink .*Fix: remove it"):
        Checkpointer(run_dir)
    assert target.read_text() == "keep me"


def test_a_lock_that_is_not_a_regular_file_is_refused(run_dir):
    os.makedirs(run_dir)
    os.mkfifo(os.path.join(run_dir, ".lock"))
    with pytest.raises(CheckpointLockedError, match=r"/\.lock is not a regular file.*Fix: remove it"):
        Checkpointer(run_dir)


def test_lock_is_private_and_names_no_arguments(run_dir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/opt/jobs/train.py", "--api-key", "hunter2"])
    with Checkpointer(run_dir):
        path = os.path.join(run_dir, ".lock")
        with open(path) as handle:
            text = handle.read()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    record = json.loads(text)
    assert sorted(record) == ["host", "pid", "program", "since_unix_s"]
    assert (record["pid"], record["program"]) == (os.getpid(), "train.py")
    assert "hunter2" not in text


def test_a_hard_linked_lock_is_refused_and_its_other_name_untouched(run_dir, tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.chmod(target, 0o644)
    os.makedirs(run_dir)
    os.link(target, os.path.join(run_dir, ".lock"))  # O_NOFOLLOW does not see a hard link
    with pytest.raises(CheckpointLockedError, match=r"/\.lock has 2 hard links: .*Fix: remove it"):
        Checkpointer(run_dir)
    assert target.read_text() == "keep me"
    assert oct(os.stat(target).st_mode & 0o777) == "0o644"
    os.remove(os.path.join(run_dir, ".lock"))  # the fix the message names
    Checkpointer(run_dir).close()
    assert target.read_text() == "keep me"
