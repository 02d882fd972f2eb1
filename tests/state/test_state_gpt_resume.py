"""Bit-exact resume of the built-in GPT, killed at several points.

``torchckpt.models.gpt("tiny", dropout=0.1)``, AdamW + warm-up/cosine SequentialLR, a shuffling
StatefulDataLoader over a fixed random token dataset (variant ``gpt-adamw-warmcosine-sync`` of
state_workers.run_training, checkpoints every 2 steps, keep_last=2). The uninterrupted reference
run takes no checkpoints at all. The test run is one real process after another on the same run
directory: three are SIGKILLed at increasing steps (read from the losses log they append to), a
fourth finishes; each continues from the newest checkpoint. The per-step losses (``float.hex``)
of the stitched run must be bitwise those of the reference, and every restart must have resumed
from a checkpoint (restored step >= 2), so a restart from scratch cannot pass.
"""

from __future__ import annotations

import random
import signal

import pytest
from state_helpers import run_worker
from test_state_resume import TOTAL_STEPS, _reference, _segments, _start_and_interrupt

VARIANT = "gpt-adamw-warmcosine-sync"
SAVE_EVERY = 2


@pytest.mark.slow
def test_gpt_killed_three_times_resumes_bit_exactly(tmp_path):
    chooser = random.Random(7)
    reference = _reference(tmp_path, VARIANT)
    assert len(set(reference.values())) == TOTAL_STEPS  # the losses move: a mixed-up step shows
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "interrupted.log")
    # 6 batches per epoch: the kills land in different epochs, some on a save step, some between.
    kill_steps = [chooser.randint(5, 10), chooser.randint(15, 21), chooser.randint(26, 32)]
    for number, kill_at in enumerate(kill_steps):
        # the log is scanned for the kill step: it must not be there from an earlier process
        assert number == 0 or all(kill_at > max(s["losses"]) for s in _segments(log))
        _start_and_interrupt(run_dir, log, VARIANT, kill_at, signal.SIGKILL, delay_s=chooser.uniform(0.0, 0.02))
    run_worker("train", run_dir, log, VARIANT, str(TOTAL_STEPS))

    segments = _segments(log)
    assert len(segments) == len(kill_steps) + 1
    assert segments[0]["restored"] == 0
    stitched: list[str] = []
    for number, segment in enumerate(segments):
        killed = number < len(kill_steps)
        assert segment["finished"] is not killed
        first = segment["restored"] + 1
        last = max(segment["losses"])
        if killed:
            assert last >= kill_steps[number]
        else:
            assert last == TOTAL_STEPS
        assert sorted(segment["losses"]) == list(range(first, last + 1))
        if number:
            before = max(segments[number - 1]["losses"])
            # resumed from a checkpoint of the killed run: a save step, at most 2 steps before its
            # last logged step (sync saves; the kill may interrupt the save of that step)
            assert segment["restored"] % SAVE_EVERY == 0 and segment["restored"] >= SAVE_EVERY
            assert before - SAVE_EVERY <= segment["restored"] <= before
            del stitched[segment["restored"]:]  # steps redone after the resume replace the lost ones
        stitched.extend(segment["losses"][step] for step in range(first, last + 1))
        for step, loss in segment["losses"].items():
            assert loss == reference[step], (
                f"segment {number}, step {step}: loss {loss} != uninterrupted {reference[step]}"
            )
    assert stitched == [reference[step] for step in range(1, TOTAL_STEPS + 1)]
