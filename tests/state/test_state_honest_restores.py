"""Restores that reported success and were not, and directories that moved or filled (issue 29, items 2, 5, 6, 8):
a meta model is refused before anything changes (and the named fix works), inference_mode gives normal tensors,
a step of a newer format is refused by every reader and writer with the directory left byte-identical, a relative
directory stays where it was resolved, and a step that cannot fit on the disk is refused before it is written."""

from __future__ import annotations

import collections
import hashlib
import json
import os

import pytest
import torch
from state_helpers import tiny_model
from state_workers import bitwise_equal
from test_state_async_and_diskfull import small_tmpfs  # noqa: F401 (a fixture: a 256 KiB tmpfs, root only)

import torchckpt.state.checkpointer.room as room_module
from torchckpt.state import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointNewerFormatError,
    CheckpointWriteError,
    list_checkpoints,
    load,
)
from torchckpt.state.format.hashing import hash_bytes
from torchckpt.state.format.layout import MANIFEST_NAME, step_dir_name
from torchckpt.state.format.manifest import canonical_json


def _tree_bytes(root: str) -> dict[str, str]:
    """Every entry under ``root`` with a digest of its bytes (directories by name)."""
    found = {}
    for folder, dirs, names in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = "dir"
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                found[os.path.relpath(os.path.join(folder, name), root)] = hashlib.sha256(handle.read()).hexdigest()
    return found


# ----- item 2: meta models and inference_mode --------------------------------------------------------------


def test_a_meta_model_is_refused_before_anything_changes_and_to_empty_fixes_it(run_dir):
    saved = tiny_model(1)
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=saved, extras={"epoch": 3})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tiny_model(2)
    extras: dict = {}
    rng_before = torch.get_rng_state()
    with Checkpointer(run_dir) as ckpt, pytest.raises(CheckpointMismatchError, match=r"item 'model'.*meta device.*"
                                                                                       r"to_empty\(device='cpu'\)"):
        ckpt.restore(model=model, extras=extras)
    assert extras == {} and torch.equal(torch.get_rng_state(), rng_before)  # no half restore
    model.to_empty(device="cpu")  # the fix the message names
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=model, extras=extras) == 1
    assert bitwise_equal(model.state_dict(), saved.state_dict()) and extras == {"epoch": 3}


def test_an_optimizer_of_meta_parameters_is_refused(run_dir):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, optimizer=optimizer)
    meta_optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2, device="meta").parameters())
    with Checkpointer(run_dir) as ckpt, pytest.raises(CheckpointMismatchError, match="meta device"):
        ckpt.restore(optimizer=meta_optimizer)


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copied"])
def test_restore_under_inference_mode_gives_tensors_a_backward_can_use(run_dir, copy):
    saved = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    saved(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=saved, optimizer=optimizer, extras={"t": torch.ones(2)})
    model = torch.nn.Linear(3, 2)
    held = model.state_dict() if copy else None  # a held state_dict makes restore copy (load_state_dict)
    fresh_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extras: dict = {}
    with torch.inference_mode(), Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(model=model, optimizer=fresh_optimizer, extras=extras) == 1
    del held
    assert not any(t.is_inference() for t in [*model.parameters(), extras["t"]])
    assert not any(v.is_inference() for s in fresh_optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    assert bitwise_equal(model.state_dict(), saved.state_dict())
    model(torch.ones(1, 3)).sum().backward()  # raised "Inference tensors cannot be saved for backward" before
    fresh_optimizer.step()
    assert model.weight.grad is not None


# ----- item 5: a step of a newer format ---------------------------------------------------------------------


def _rewrite_manifest(run_dir: str, step: int, version: int, rehash: bool = True) -> None:
    path = os.path.join(run_dir, step_dir_name(step), MANIFEST_NAME)
    with open(path, "rb") as handle:
        body = json.load(handle)
    body.pop("manifest_hash")
    body["format_version"] = version
    body["new_field_of_format_4"] = {"anything": [1, 2]}
    body["manifest_hash"] = hash_bytes(canonical_json(body), "sha256") if rehash else "0" * 64
    with open(path, "w") as handle:
        json.dump(body, handle)


@pytest.fixture
def newer_run(run_dir):
    """Steps 1 and 2; step 2's manifest rewritten as a newer torchckpt's (format 4, an unknown field)."""
    with Checkpointer(run_dir, keep_last=1) as ckpt:
        ckpt.save(1, model=tiny_model(1))
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(2, model=tiny_model(2))
    _rewrite_manifest(run_dir, 2, 4)
    return run_dir


def test_a_newer_format_is_refused_by_every_reader_and_writer_and_nothing_changes(newer_run):
    before = _tree_bytes(newer_run)
    message = r"written by a newer torchckpt \(format 4\).*upgrade"
    model = tiny_model(5)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointNewerFormatError, match=message):
        Checkpointer(newer_run)  # a writer: would rewind past it, abandon it or move it aside
    with pytest.raises(CheckpointNewerFormatError, match=message):
        Checkpointer(newer_run, keep_last=1, save_every_steps=1)
    with Checkpointer(newer_run, read_only=True) as reader, pytest.raises(CheckpointNewerFormatError, match=message):
        reader.restore(model=model)
    with pytest.raises(CheckpointNewerFormatError, match=message):
        load(newer_run, model=model)  # never falls back to step 1
    infos = {info.step: info for info in list_checkpoints(newer_run, "full")}
    assert infos[1].valid and not infos[2].valid and "newer torchckpt (format 4)" in infos[2].problem
    assert bitwise_equal(model.state_dict(), weights)
    assert _tree_bytes(newer_run) == before  # byte-identical: nothing quarantined, abandoned, cleaned or locked
    assert load(newer_run, step=1, model=model) == 1  # an older step asked for by number still reads


def test_a_newer_version_with_a_broken_manifest_hash_is_corrupt_as_before(run_dir):
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=tiny_model(1))
        ckpt.save(2, model=tiny_model(2))
    _rewrite_manifest(run_dir, 2, 4, rehash=False)  # cannot be told from damage: the usual fallback
    with pytest.warns(UserWarning, match="skipped corrupt newer step"):
        assert load(run_dir, model=tiny_model(3)) == 1


def test_an_older_torchckpt_refuses_a_format_3_step_as_newer(run_dir, monkeypatch):
    import torchckpt.state.format.manifest as manifest_module

    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, extras={"n": 1})
        ckpt.save(2, extras={"n": 10 ** 5000})  # needs format 3
    monkeypatch.setattr(manifest_module, "NEWEST_FORMAT_VERSION", 2)  # a torchckpt that reads formats 1 and 2
    with pytest.raises(CheckpointNewerFormatError, match=r"format 3\).*reads formats 1 to 2"):
        load(run_dir, extras={})


# ----- item 6: a relative directory --------------------------------------------------------------------------


def test_a_relative_directory_is_resolved_once(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    model = tiny_model(1)
    with Checkpointer("runs/exp1") as ckpt:
        monkeypatch.chdir(tmp_path / "b")
        ckpt.save(1, model=model)
        assert ckpt.directory == "runs/exp1"  # as given, for messages; its storage was resolved when built
        restored = tiny_model(2)
        assert ckpt.restore(model=restored) == 1
    assert os.listdir(tmp_path / "b") == []
    assert step_dir_name(1) in os.listdir(tmp_path / "a" / "runs" / "exp1")
    assert bitwise_equal(restored.state_dict(), model.state_dict())


# ----- item 8: a step that cannot fit --------------------------------------------------------------------------

_Usage = collections.namedtuple("_Usage", "total used free")


def _fake_free(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(room_module.shutil, "disk_usage", lambda path: _Usage(1 << 40, 0, free_bytes))


def _step_bytes(run_dir: str, step: int) -> int:
    return room_module._bytes_on_disk(os.path.join(run_dir, step_dir_name(step)))


def test_a_step_that_cannot_fit_is_refused_before_it_is_written(run_dir, monkeypatch):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(run_dir, keep_last=1) as ckpt:
        ckpt.save(1, model=model)
        _fake_free(monkeypatch, _step_bytes(run_dir, 1) // 2)  # room for half a step
        before = _tree_bytes(run_dir)
        with pytest.raises(CheckpointWriteError, match=r"no space left on device for step 2.*bytes are free.*nothing "
                                                       r"was written or removed.*remove_old_steps_when_full=True\) "
                                                       r"removes steps \[1\]"):
            ckpt.save(2, model=model)
        assert _tree_bytes(run_dir) == before


def test_remove_old_steps_when_full_removes_what_retention_would_and_then_saves(run_dir, monkeypatch):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(run_dir, keep_last=1, remove_old_steps_when_full=True) as ckpt:
        ckpt.save(1, model=model)
        _fake_free(monkeypatch, _step_bytes(run_dir, 1) // 2)  # fits only once step 1 is gone
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(2, model=model)
        assert [info.step for info in ckpt.list("full") if info.valid] == [2]
    restored = torch.nn.Linear(64, 64)
    assert load(run_dir, model=restored) == 2 and bitwise_equal(restored.state_dict(), model.state_dict())


def test_remove_old_steps_when_full_never_removes_a_step_the_policy_keeps(run_dir, monkeypatch):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(run_dir, keep_last=2, remove_old_steps_when_full=True) as ckpt:
        ckpt.save(1, model=model)
        _fake_free(monkeypatch, _step_bytes(run_dir, 1) // 2)
        with pytest.raises(CheckpointWriteError, match=r"could free only 0 bytes.*it removed nothing"):
            ckpt.save(2, model=model)
        assert [info.step for info in ckpt.list("full") if info.valid] == [1]


def test_a_full_real_tmpfs_is_said_before_the_write_and_the_opt_in_saves(small_tmpfs):  # noqa: F811
    run_dir = os.path.join(small_tmpfs, "run")
    model = torch.nn.Linear(128, 256)  # 129 KiB of weights: one step fits in 256 KiB, two do not
    with Checkpointer(run_dir, keep_last=1) as ckpt:
        ckpt.save(1, model=model)
        with pytest.raises(CheckpointWriteError, match="no space left on device for step 2.*nothing was written"):
            ckpt.save(2, model=model)
        assert not [n for n in os.listdir(run_dir) if n.startswith(".tmp-")]
    with torch.no_grad():
        model.bias.add_(1.0)
    with Checkpointer(run_dir, keep_last=1, remove_old_steps_when_full=True) as ckpt:
        ckpt.save(2, model=model)
    restored = torch.nn.Linear(128, 256)
    assert load(run_dir, model=restored) == 2 and bitwise_equal(restored.state_dict(), model.state_dict())
