"""Long work is never silent: the planner's steps and each block's forward pass show as plain lines in a log."""

from __future__ import annotations

import io

from torchckpt.models import gpt
from torchckpt.planner import profile
from torchckpt.train.status import Status, block_ticks


def test_profiling_shows_each_step_and_each_block_in_plain_lines() -> None:
    model = gpt("tiny")
    batch = model.example_batch(batch_size=2, seq_len=16)
    out = io.StringIO()
    with Status("gpt-tiny", stream=out, live=False, every_s=0.0) as status, block_ticks(list(model.blocks), status):
        profile(model, batch, blocks=list(model.blocks), progress=status.update, regions=False, loss_head=False,
                pieces=False)  # steps 1-4 only: short
        status.update("solving")
    lines = [line.split("] gpt-tiny: ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines[0] == "starting" and lines[-2:] == ["solving", "done"]
    step_1 = lines.index("profiling step 1: 2 blocks, every block recomputed")
    step_2 = next(i for i, line in enumerate(lines) if line.startswith("profiling step 2"))
    ticks = lines[step_1 + 1:step_2]  # step 1: each block's forward pass (recomputation calls no hook)
    assert ticks == [f"{lines[step_1]}: block 1/2", f"{lines[step_1]}: block 2/2"]
    assert not any(hasattr(block, "_forward_pre_hooks") and block._forward_pre_hooks for block in model.blocks)


def test_plain_lines_are_throttled_but_each_new_step_shows() -> None:
    out = io.StringIO()
    with Status("x", stream=out, live=False, every_s=3600.0) as status:
        status.update("one")
        status.tick("block 1/9")  # within the hour since the last line: not shown
        status.update("two")
    assert [line.split("] ", 1)[1] for line in out.getvalue().splitlines()] == ["x: starting", "x: one", "x: two",
                                                                               "x: done"]
