"""Long work reports its phases to a reporter an application installs (torchckpt/_progress.py); without one, the
library prints nothing."""

from __future__ import annotations

import pytest
import torch

import torchckpt
from torchckpt._progress import Progress, reporting
from torchckpt.models import mlp
from torchckpt.state import verify_checkpoint


def test_api_calls_print_nothing(capfd: pytest.CaptureFixture[str], tmp_path) -> None:
    model = mlp(width=8, depth=2)
    torchckpt.plan(model, model.example_batch(batch_size=2), budget="100%", regions=False)
    with torchckpt.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, model=model)
        checkpointer.restore(model=model)
    assert capfd.readouterr() == ("", "")


def test_profiling_reports_each_step_and_each_blocks_forward_pass_in_order() -> None:
    model = mlp(width=8, depth=2)
    batch = model.example_batch(batch_size=2)
    seen: list[Progress] = []
    with reporting(seen.append):
        torchckpt.plan(model, batch, budget="100%", regions=False)
    phases = [report.text for report in seen if report.done is None]
    assert [text.split(":")[0] for text in phases] == [
        "checking which blocks can be recomputed (a forward pass without gradients)", "profiling step 1",
        "profiling step 2", "profiling steps 3-4", "checking whether another grouping of blocks has a much lower floor",
        "solving"]
    # each measured step (1 and 2) ticks once per block's forward pass; the timed steps 3-4 tick nothing
    ticks = [(phases[sum(r.done is None for r in seen[:i + 1]) - 1].split(":")[0], report.detail())
             for i, report in enumerate(seen) if report.done is not None]
    assert ticks == [("profiling step 1", "block 1/2"), ("profiling step 1", "block 2/2"),
                     ("profiling step 2", "block 1/2"), ("profiling step 2", "block 2/2")]
    assert not any(module._forward_pre_hooks for module in model.modules())  # the ticks' hooks are gone


def test_a_save_a_restore_and_a_verification_count_their_bytes(tmp_path) -> None:
    model = torch.nn.Linear(2048, 2560)  # 20 MiB of weights: more than one 16 MiB piece
    seen: list[Progress] = []
    with reporting(seen.append), torchckpt.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(1, model=model)
        checkpointer.restore(model=model)
        verify_checkpoint(str(tmp_path), verify="full")
    size = sum(path.stat().st_size for path in (tmp_path / "step-000000001").iterdir() if path.name != "manifest.json")
    phases: list[tuple[str, list[int]]] = []  # each phase and the counts reported in it
    for report in seen:
        if report.done is None:
            phases.append((report.text.replace(str(tmp_path), "DIR"), []))
        else:
            assert report.text.replace(str(tmp_path), "DIR") == phases[-1][0] and report.unit == "bytes"
            phases[-1][1].append(report.done)
    assert [text for text, _ in phases] == ["saving step 1 to DIR", "reading DIR/step-000000001",  # state.json first
                                            "reading DIR/step-000000001", "verifying DIR/step-000000001"]
    for _, counts in phases:
        assert counts == sorted(counts)  # never backwards
    saved, _, read, verified = (counts for _, counts in phases)
    assert len(saved) > 2 and len(read) > 2 and len(verified) > 2  # piece by piece
    assert saved[-1] == verified[-1] == size and read[-1] == size - phases[1][1][-1]  # every byte of the step
