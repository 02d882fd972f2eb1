"""Async saves snapshot synchronously, never overlap, and surface errors; a full disk is reported."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import uuid

import pytest
import torch
from state_helpers import tiny_model
from state_workers import bitwise_equal

import torchckpt.state.storage.local as storage_module
from torchckpt.state import Checkpointer, CheckpointWriteError
from torchckpt.state.format.layout import parse_step_dir_name, step_dir_name


def test_async_save_captures_state_before_training_continues(run_dir):
    model = tiny_model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(run_dir, async_save=True) as ckpt:
        ckpt.save(1, model=model)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # training goes on while the write is in flight
    restored = tiny_model(7)
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=restored) == 1
    assert bitwise_equal(restored.state_dict(), expected)


def test_second_async_save_waits_for_the_first(run_dir, monkeypatch):
    gate = threading.Event()
    real_write = storage_module._write_fully

    def gated_write(fd, data):
        gate.wait(timeout=30)
        return real_write(fd, data)

    monkeypatch.setattr(storage_module, "_write_fully", gated_write)
    model = tiny_model()
    with Checkpointer(run_dir, async_save=True) as ckpt:
        ckpt.save(1, model=model)
        assert not os.path.exists(os.path.join(run_dir, step_dir_name(1)))  # blocked in the background
        threading.Timer(0.1, gate.set).start()
        ckpt.save(2, model=model)  # must wait until step 1 is committed
        assert os.path.isdir(os.path.join(run_dir, step_dir_name(1)))
    committed = sorted(n for n in os.listdir(run_dir) if parse_step_dir_name(n) is not None)
    assert committed == [step_dir_name(1), step_dir_name(2)]


def _failing_writer(fail_after_bytes: int):
    real_write = storage_module._write_fully
    written = [0]

    def write(fd, data):
        if written[0] + len(data) > fail_after_bytes:
            os.write(fd, bytes(data[: max(0, fail_after_bytes - written[0])]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_write(fd, data)

    return write


def _assert_earlier_checkpoint_intact(run_dir, expected_state):
    assert not [n for n in os.listdir(run_dir) if n.startswith(".tmp-")]
    restored = tiny_model(9)
    with Checkpointer(run_dir) as ckpt:
        assert [info.step for info in ckpt.list("full") if info.valid] == [1]
        assert ckpt.restore(model=restored) == 1
    assert bitwise_equal(restored.state_dict(), expected_state)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_via_fault_injection(run_dir, monkeypatch, async_save):
    model = tiny_model()
    with Checkpointer(run_dir, async_save=async_save) as ckpt:
        ckpt.save(1, model=model)
        ckpt.wait()
        monkeypatch.setattr(storage_module, "_write_fully", _failing_writer(fail_after_bytes=300))
        with pytest.raises(CheckpointWriteError, match="no space left on device") as caught:
            ckpt.save(2, model=tiny_model(3))
            ckpt.save(3, model=tiny_model(3))  # async: the error of step 2 surfaces here
        assert "earlier checkpoints are untouched" in str(caught.value)
    monkeypatch.undo()
    _assert_earlier_checkpoint_intact(run_dir, model.state_dict())


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, when this process may mount one (root); skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_on_a_real_small_tmpfs(small_tmpfs):
    run_dir = os.path.join(small_tmpfs, "run")
    model = tiny_model()
    big = torch.nn.Linear(256, 512)  # 0.5 MiB of weights: cannot fit in 256 KiB
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
        with pytest.raises(CheckpointWriteError, match="no space left on device"):
            ckpt.save(2, model=big)
    _assert_earlier_checkpoint_intact(run_dir, model.state_dict())
