"""keep_last / keep_best / keep_every keep exactly what they say, and never the wrong thing."""

from __future__ import annotations

import os

import pytest
from state_helpers import tiny_model

from torchckpt.state import Checkpointer, RetentionPolicy
from torchckpt.state.checkpointer.retention import steps_to_keep
from torchckpt.state.format.layout import TMP_PREFIX, parse_step_dir_name, step_dir_name

LOSSES = {1: 5.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 2.0, 6: 2.5, 7: 9.0}


@pytest.mark.parametrize(
    "policy, expected",
    [
        (RetentionPolicy(), {1, 2, 3, 4, 5, 6, 7}),
        (RetentionPolicy(keep_last=2), {6, 7}),
        (RetentionPolicy(keep_every=3), {3, 6, 7}),
        (RetentionPolicy(keep_best=("loss", "min", 2)), {3, 5, 7}),
        (RetentionPolicy(keep_best=("loss", "max", 1)), {7}),
        (RetentionPolicy(keep_last=1, keep_best=("loss", "min", 1), keep_every=4), {3, 4, 7}),
        (RetentionPolicy(keep_best=("accuracy", "max", 3)), {7}),
    ],
)
def test_steps_to_keep_golden(policy, expected):
    metrics = {step: {"loss": loss} for step, loss in LOSSES.items()}
    assert steps_to_keep(metrics, policy) == expected


@pytest.mark.parametrize(
    "options, message",
    [
        ({"keep_last": 0}, "keep_last=0"),
        ({"keep_every": 2.5}, "keep_every=2.5"),
        ({"keep_best": ("loss", "lowest", 2)}, "'min' or 'max'"),
        ({"keep_best": ["loss", "min", 2]}, "keep_best="),
    ],
)
def test_bad_policies_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        RetentionPolicy(**options)


def _steps_on_disk(run_dir):
    return sorted(s for s in map(parse_step_dir_name, os.listdir(run_dir)) if s is not None)


def test_checkpointer_applies_all_rules(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, keep_last=2, keep_every=5, keep_best=("loss", "min", 1)) as ckpt:
        for step in range(1, 13):
            ckpt.save(step, model=model, metrics={"loss": 0.1 if step == 3 else float(step)})
    assert _steps_on_disk(run_dir) == [3, 5, 10, 11, 12]


def test_newest_is_kept_even_when_it_is_the_worst(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, keep_best=("loss", "min", 1)) as ckpt:
        for step, loss in [(1, 1.0), (2, 2.0), (3, 3.0)]:
            ckpt.save(step, model=model, metrics={"loss": loss})
    assert _steps_on_disk(run_dir) == [1, 3]


def test_corrupt_steps_and_saves_in_flight_are_never_deleted(run_dir):
    model = tiny_model()
    with Checkpointer(run_dir, keep_last=1) as ckpt:
        ckpt.save(1, model=model)
        with open(os.path.join(run_dir, step_dir_name(1), "model.safetensors"), "ab") as handle:
            handle.write(b"junk")  # step 1 is now corrupt
        in_flight = os.path.join(run_dir, f"{TMP_PREFIX}{step_dir_name(99)}-other")
        os.mkdir(in_flight)  # stands for a save still being written
        for step in (2, 3, 4):
            ckpt.save(step, model=model)
        assert os.path.isdir(in_flight)
    assert _steps_on_disk(run_dir) == [1, 4]
