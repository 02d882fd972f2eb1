"""Remote paths through fsspec: manifest-last commit, restore, retention, leftovers, lock."""

from __future__ import annotations

import uuid

import pytest
import torch
from state_helpers import tiny_model
from state_workers import bitwise_equal

from torchckpt.state import Checkpointer, CheckpointLockedError, verify_checkpoint
from torchckpt.state.format.layout import step_dir_name

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory_url():
    url = f"memory://torchckpt-test-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url.removeprefix("memory://")):
        fs.rm(url.removeprefix("memory://"), recursive=True)


def test_round_trip_and_retention(memory_url):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(memory_url, keep_last=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, model=model, optimizer=optimizer)
    assert [info.step for info in verify_checkpoint(memory_url) if info.valid] == [2, 3]
    restored, restored_opt = tiny_model(4), None
    restored_opt = torch.optim.AdamW(restored.parameters())
    with Checkpointer(memory_url) as ckpt:
        assert ckpt.restore(model=restored, optimizer=restored_opt) == 3
    assert bitwise_equal(restored.state_dict(), model.state_dict())
    assert bitwise_equal(restored_opt.state_dict(), optimizer.state_dict())


def test_step_without_manifest_is_ignored_then_cleaned(memory_url):
    model = tiny_model()
    with Checkpointer(memory_url) as ckpt:
        ckpt.save(1, model=model)
    fs = fsspec.filesystem("memory")
    root = memory_url.removeprefix("memory://")
    fs.pipe_file(f"{root}/{step_dir_name(2)}/model.safetensors", b"half written")  # crashed before its manifest
    with Checkpointer(memory_url) as ckpt:  # start-up removes it
        assert not fs.exists(f"{root}/{step_dir_name(2)}")
        assert ckpt.restore(model=tiny_model(3)) == 1


def test_remote_lock_names_holder(memory_url):
    with Checkpointer(memory_url), pytest.raises(CheckpointLockedError, match="locked by pid"):
        Checkpointer(memory_url)
    Checkpointer(memory_url).close()


def test_multi_piece_files_stream_both_ways(memory_url):
    torch.manual_seed(0)
    model = torch.nn.Linear(2100, 2100)  # 17.6 MB weight: more than one 16 MiB piece each way
    with Checkpointer(memory_url, async_save=True) as ckpt:
        ckpt.save(1, model=model)
    [info] = verify_checkpoint(memory_url, step=1, verify="full")
    assert info.valid and info.size_bytes > 16 << 20
    restored = torch.nn.Linear(2100, 2100)
    with Checkpointer(memory_url) as ckpt:
        assert ckpt.restore(model=restored) == 1
    assert bitwise_equal(restored.state_dict(), model.state_dict())
