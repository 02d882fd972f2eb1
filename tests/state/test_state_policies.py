"""When to save: every N steps, every N seconds, on preemption; options are validated."""

from __future__ import annotations

import os
import signal
import time

import pytest
from state_helpers import tiny_model

from torchckpt.state import Checkpointer, CheckpointerConfig
from torchckpt.state.format.layout import parse_step_dir_name


def _saved(run_dir):
    return sorted(s for s in map(parse_step_dir_name, os.listdir(run_dir)) if s is not None)


def test_every_n_steps(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, save_every_steps=3) as ckpt:
        started = [step for step in range(1, 11) if ckpt.maybe_save(step, model=model)]
    assert started == [3, 6, 9] and _saved(run_dir) == [3, 6, 9]


def test_every_n_seconds_with_a_fake_clock(run_dir, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    model = tiny_model()
    with Checkpointer(run_dir, save_every_seconds=60) as ckpt:
        started = []
        for step in range(1, 8):
            now[0] += 25.0  # each step takes 25 s
            if ckpt.maybe_save(step, model=model):
                started.append(step)
    assert started == [3, 6]  # 75 s after start, then 75 s after the save at step 3


def test_restored_step_is_not_saved_again(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, save_every_steps=2) as ckpt:
        ckpt.maybe_save(2, model=model)
    with Checkpointer(run_dir, save_every_steps=2) as ckpt:
        assert ckpt.restore(model=model) == 2
        assert ckpt.maybe_save(2, model=model) is False
        assert ckpt.maybe_save(4, model=model) is True


def test_maybe_save_without_policy_is_an_error(run_dir):
    with Checkpointer(run_dir) as ckpt, pytest.raises(ValueError, match="maybe_save needs a policy"):
        ckpt.maybe_save(1, model=tiny_model())


def test_sigterm_saves_at_next_safe_point_and_exits_cleanly(run_dir):
    before = signal.getsignal(signal.SIGTERM)
    model = tiny_model()
    ckpt = Checkpointer(run_dir, save_on_preemption=True)
    assert ckpt.maybe_save(1, model=model) is False
    os.kill(os.getpid(), signal.SIGTERM)
    assert ckpt.preemption_requested
    with pytest.raises(SystemExit) as caught:
        ckpt.maybe_save(2, model=model)
    assert caught.value.code == 0 and _saved(run_dir) == [2]
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored on close
    Checkpointer(run_dir).close()  # and the lock released


@pytest.mark.parametrize(
    "options, message",
    [
        ({"save_every_steps": 0}, "save_every_steps=0"),
        ({"save_every_seconds": -1}, "save_every_seconds=-1"),
        ({"verify": "paranoid"}, "verify='paranoid'"),
        ({"hash_algorithm": "md4"}, "hash_algorithm='md4'"),
        ({"preemption_signals": ("SIGNOPE",)}, "'SIGNOPE' is unknown"),
        ({"keep_last": -2}, "keep_last=-2"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        CheckpointerConfig(**options)


def test_step_must_be_a_non_negative_int(run_dir):
    with Checkpointer(run_dir) as ckpt:
        with pytest.raises(ValueError, match="step=-1"):
            ckpt.save(-1, model=tiny_model())
        with pytest.raises(ValueError, match="step=1.0"):
            ckpt.save(1.0, model=tiny_model())
