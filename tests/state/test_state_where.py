"""Where a Checkpointer is pointed: a file, a read-only disk, a directory named ``.lock``, no permission.

Each case used to end in a raw ``FileExistsError`` / ``OSError`` from deep inside, or in a message about
symlinks or free space that named the wrong cause (issue 14, items 8 and 12). Now the error names the
path, the real cause and the fix, and nothing on disk changes.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest
import torch
from state_helpers import tiny_model

from torchckpt.state import (
    Checkpointer,
    CheckpointError,
    CheckpointLockedError,
    CheckpointWriteError,
    load,
)
from torchckpt.state.storage import local as storage_module


def test_a_path_that_is_a_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "run"
    path.write_text("my notes")
    with pytest.raises(CheckpointError, match=r"run is a file, not a directory.*Fix: pass a directory path"):
        Checkpointer(str(path))
    assert path.read_text() == "my notes"


def test_a_path_under_a_file_is_refused_naming_the_cause(tmp_path):
    (tmp_path / "notes").write_text("x")
    with pytest.raises(CheckpointError, match=r"cannot create the checkpoint directory.*a part of the path is a file"):
        Checkpointer(str(tmp_path / "notes" / "run"))


def test_a_lock_that_is_a_directory_is_refused(run_dir):
    os.makedirs(os.path.join(run_dir, ".lock"))
    with pytest.raises(CheckpointLockedError, match=r"/\.lock is a directory .*Fix: remove it .*rmdir"):
        Checkpointer(run_dir)
    assert os.path.isdir(os.path.join(run_dir, ".lock"))


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_lock_that_cannot_be_created_names_the_real_cause(run_dir, monkeypatch, code):
    os.makedirs(run_dir)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(run_dir)
    message = str(caught.value)
    assert "cannot create the writer's lock file" in message
    assert ("read-only" if code == errno.EROFS else "permission denied") in message
    assert "symlink" not in message and "free space" not in message


@pytest.mark.parametrize("code, cause", [(errno.EROFS, "the filesystem is read-only"),
                                         (errno.EACCES, "permission denied"),
                                         (errno.ENOSPC, "free space")])
def test_a_failed_save_names_its_cause(run_dir, monkeypatch, code, cause):
    model = tiny_model()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
        monkeypatch.setattr(storage_module, "_write_fully",
                            lambda fd, data: (_ for _ in ()).throw(OSError(code, os.strerror(code))))
        with pytest.raises(CheckpointWriteError, match=f"Fix: {cause}") as caught:
            ckpt.save(2, model=tiny_model(3))
        monkeypatch.undo()
        assert "earlier checkpoints are untouched" in str(caught.value)
        if code != errno.ENOSPC:
            assert "free space" not in str(caught.value)
        assert [info.step for info in ckpt.list()] == [1]


@pytest.fixture
def read_only_run(tmp_path):
    """A run directory with step 1 on a tmpfs remounted read-only (needs root); yields (path, saved state)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             check=False, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount not permitted here: {mounted.stderr.decode().strip()}")
    try:
        run_dir = str(mount_point / "run")
        model = tiny_model()
        with Checkpointer(run_dir) as ckpt:
            ckpt.save(1, model=model)
        remounted = subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=False, capture_output=True)
        if remounted.returncode != 0:
            pytest.skip(f"remount read-only not permitted here: {remounted.stderr.decode().strip()}")
        yield run_dir, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_writer_on_a_read_only_disk_is_refused_and_points_at_the_readers(read_only_run):
    run_dir, _ = read_only_run
    with pytest.raises(CheckpointError, match=r"read-only.*read_only=True") as caught:
        Checkpointer(run_dir)
    assert "symlink" not in str(caught.value)
    with pytest.raises(CheckpointError, match=r"cannot create the checkpoint directory.*read-only"):
        Checkpointer(os.path.join(os.path.dirname(run_dir), "new-run"))


def test_readers_restore_from_a_read_only_disk(read_only_run):
    run_dir, saved = read_only_run
    model = tiny_model(7)
    assert load(run_dir, model=model) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    other = tiny_model(8)
    with Checkpointer(run_dir, read_only=True) as reader:
        assert reader.restore(model=other) == 1
        assert [info.valid for info in reader.list(verify="full")] == [True]
    assert all(torch.equal(other.state_dict()[k], v) for k, v in saved.items())
