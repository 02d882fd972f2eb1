"""Step numbers that go backwards start a new branch; a step that failed verification may be saved again."""

from __future__ import annotations

import os

import pytest
from state_helpers import tiny_model
from state_workers import bitwise_equal

from torchckpt.state import Checkpointer, CheckpointFallbackWarning, verify_checkpoint
from torchckpt.state.format import CORRUPT_PREFIX, parse_step_dir_name, step_dir_name


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


def test_a_step_that_failed_verification_is_saved_again_after_fallback(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, save_every_steps=1) as ckpt:
        assert ckpt.maybe_save(1, model=model) and ckpt.maybe_save(2, model=model)
    path = os.path.join(run_dir, step_dir_name(2), "model.safetensors")
    with open(path, "r+b") as handle:  # flip the last byte: same size, so only the hash can tell
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0xFF]))
    restored = tiny_model(seed=3)
    with Checkpointer(run_dir, save_every_steps=1) as ckpt:
        with pytest.warns(CheckpointFallbackWarning, match="skipped corrupt newer step"):
            assert ckpt.restore(model=restored) == 1
        assert ckpt.maybe_save(2, model=restored) is True  # was CheckpointExistsError on every restart
    infos = verify_checkpoint(run_dir, verify="full")
    assert [(info.step, info.valid) for info in infos] == [(1, True), (2, True)]
    assert [n for n in os.listdir(run_dir) if n.startswith(CORRUPT_PREFIX)][0].startswith(
        f"{CORRUPT_PREFIX}{step_dir_name(2)}-")
