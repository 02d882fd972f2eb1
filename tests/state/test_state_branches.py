"""Step numbers that go backwards start a new branch; a step that failed verification may be saved again, by
``maybe_save`` or by a preemption's save."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from state_helpers import tiny_model
from state_workers import bitwise_equal

from torchckpt.state import Checkpointer, CheckpointFallbackWarning, verify_checkpoint
from torchckpt.state.format.layout import CORRUPT_PREFIX, parse_step_dir_name, step_dir_name


def _steps_on_disk(run_dir):
    return sorted(s for s in map(parse_step_dir_name, os.listdir(run_dir)) if s is not None)


def test_rewind_keeps_the_new_saves_and_sets_the_newer_steps_aside(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, keep_last=2) as ckpt:
        ckpt.save(100, model=model)
        ckpt.save(200, model=tiny_model(seed=2))
    with Checkpointer(run_dir, keep_last=2) as ckpt:
        assert ckpt.restore(step=100, model=model) == 100
        ckpt.save(101, model=model)
        ckpt.save(102, model=model)
        assert _steps_on_disk(run_dir) == [101, 102]
        assert ckpt.latest_step() == 102
    assert os.listdir(os.path.join(run_dir, "abandoned")) == [step_dir_name(200)]
    restored = tiny_model(seed=5)
    with Checkpointer(run_dir, keep_last=2) as ckpt:  # a restart resumes the current branch, not step 200
        assert ckpt.restore(model=restored) == 102
    assert bitwise_equal(restored.state_dict(), model.state_dict())
    [abandoned] = verify_checkpoint(os.path.join(run_dir, "abandoned"))  # kept whole, not deleted
    assert (abandoned.step, abandoned.valid) == (200, True)


def test_restarted_step_counter_keeps_its_first_save(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, keep_last=2) as ckpt:
        for step in (5, 6):
            ckpt.save(step, model=model)
    with Checkpointer(run_dir, keep_last=2) as ckpt:
        ckpt.save(1, model=model)
        assert _steps_on_disk(run_dir) == [1]
        ckpt.save(2, model=model)
    assert _steps_on_disk(run_dir) == [1, 2]
    assert sorted(os.listdir(os.path.join(run_dir, "abandoned"))) == [step_dir_name(5), step_dir_name(6)]


def test_a_step_abandoned_twice_keeps_both_copies(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(2, model=model)
        ckpt.save(1, model=model)  # step 2 is abandoned
        ckpt.save(2, model=model)
        ckpt.save(0, model=model)  # and steps 1 and the new 2 too
    names = sorted(os.listdir(os.path.join(run_dir, "abandoned")))
    assert names[:2] == [step_dir_name(1), step_dir_name(2)] and len(names) == 3
    assert names[2].startswith(step_dir_name(2) + "-")
    assert _steps_on_disk(run_dir) == [0]


def _flip_last_byte(path: str) -> None:
    """Same size, so only the hash can tell."""
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))


def test_a_step_that_failed_verification_is_saved_again_after_fallback(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, save_every_steps=1) as ckpt:
        assert ckpt.maybe_save(1, model=model) and ckpt.maybe_save(2, model=model)
    _flip_last_byte(os.path.join(run_dir, step_dir_name(2), "model.safetensors"))
    restored = tiny_model(seed=3)
    with Checkpointer(run_dir, save_every_steps=1) as ckpt:
        with pytest.warns(CheckpointFallbackWarning, match="skipped corrupt newer step"):
            assert ckpt.restore(model=restored) == 1
        assert ckpt.maybe_save(2, model=restored) is True  # was CheckpointExistsError on every restart
    infos = verify_checkpoint(run_dir, verify="full")
    assert [(info.step, info.valid) for info in infos] == [(1, True), (2, True)]
    assert [n for n in os.listdir(run_dir) if n.startswith(CORRUPT_PREFIX)][0].startswith(
        f"{CORRUPT_PREFIX}{step_dir_name(2)}-")


@pytest.mark.parametrize("damage", ["flipped byte", "stray file"])
def test_sigterm_at_a_step_that_is_not_a_valid_checkpoint_saves_it(run_dir, damage):
    model = tiny_model()
    with Checkpointer(run_dir, save_every_steps=1) as ckpt:
        assert ckpt.maybe_save(1, model=model) and ckpt.maybe_save(2, model=model)
    path = os.path.join(run_dir, step_dir_name(2))
    if damage == "flipped byte":
        _flip_last_byte(os.path.join(path, "model.safetensors"))
    else:
        shutil.rmtree(path)
        Path(path).write_text("not a checkpoint")
    restored = tiny_model(seed=3)
    ckpt = Checkpointer(run_dir, save_every_steps=100, save_on_preemption=True)
    with pytest.warns(CheckpointFallbackWarning):
        assert ckpt.restore(model=restored) == 1
    with torch.no_grad():
        restored[0].weight.add_(1.0)  # step 2's progress
    expected = {key: value.clone() for key, value in restored.state_dict().items()}
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as caught:
        ckpt.maybe_save(2, model=restored)  # was skipped ("step 2 exists") yet reported as saved
    assert caught.value.code == 0
    infos = verify_checkpoint(run_dir, verify="full")
    assert [(info.step, info.valid) for info in infos] == [(1, True), (2, True)]
    again = tiny_model(seed=4)
    with Checkpointer(run_dir) as reader:
        assert reader.restore(model=again) == 2
    assert bitwise_equal(again.state_dict(), expected)


def test_sigterm_at_a_valid_committed_step_does_not_save_it_again(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, model=model)
        ckpt.save(2, model=model)
    ckpt = Checkpointer(run_dir, save_every_steps=100, save_on_preemption=True)
    assert ckpt.restore(model=model, step=1) == 1
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit):
        ckpt.maybe_save(2, model=model)  # step 2 is valid: nothing to save, nothing abandoned
    assert [(info.step, info.valid) for info in verify_checkpoint(run_dir)] == [(1, True), (2, True)]
    assert not [n for n in os.listdir(run_dir) if n.startswith(CORRUPT_PREFIX)]
