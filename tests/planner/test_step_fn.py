"""``step_fn=``: plans for a training loop that keeps the model output (the logits) through backward.

The profiler's built-in step deletes the output before ``loss.backward()``. nanoGPT's loop,
``logits, loss = model(x, y); loss.backward()``, keeps the logits alive through the whole backward
pass, so it peaks exactly one logits tensor above a plan made with the built-in step. Given as
``step_fn``, the loop itself is measured and the plan covers it (docs/planner.md, "What the budget
covers").
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import torchckpt
from torchckpt.models.gpt import GPT, GPT_SIZES
from torchckpt.planner import block_paths, fingerprint, plan_from_costs, profile

BATCH, TOKENS = 4, 64
SLACK = 1024  # bytes: small tensors that live in one measured step and not another
# The most room a prediction keeps above the measured peak (profile.HEADROOM_*: 64 KiB + 0.5%).
profiling = importlib.import_module("torchckpt.planner.profile")  # the module (planner.profile is the function)
HEADROOM_BYTES = getattr(profiling, "HEADROOM_BYTES", 64 * 1024)
HEADROOM_FRACTION = getattr(profiling, "HEADROOM_FRACTION", 0.005)


class NanoGPT(GPT):
    """gpt("tiny") with nanoGPT's interface: ``model(idx, targets)`` returns ``(logits, loss)``."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:  # type: ignore[override]
        logits = super().forward(idx)
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss


def keep_logits(model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    """nanoGPT's training step: the logits stay alive until backward has finished."""
    logits, loss = model(*inputs)
    loss.backward()
    return loss


def _model() -> tuple[NanoGPT, tuple, int]:
    torch.manual_seed(0)
    model = NanoGPT(GPT_SIZES["tiny"])
    batch = model.example_batch(batch_size=BATCH, seq_len=TOKENS)
    logits_bytes = BATCH * TOKENS * model.config.vocab_size * 4
    return model.train(), batch, logits_bytes


def test_a_loop_holding_the_logits_is_planned_with_step_fn() -> None:
    model, batch, logits_bytes = _model()
    # The built-in step (default_loss finds nanoGPT's loss; the output is deleted before backward). The head stays
    # whole (loss_head=False): in chunks its logits have no storage, and holding them costs nothing.
    costs = profile(model, batch, loss_head=False)
    paths = block_paths(model, list(model.blocks))
    default_plan = plan_from_costs(costs, "85%", block_paths=paths, model_fingerprint=fingerprint(model, batch, paths))
    report = torchckpt.verify_plan(model, default_plan, batch, step_fn=keep_logits)
    headroom = int(costs.notes.get("headroom_bytes", 0))  # what the prediction adds above the measured figures
    beyond = report.measured_peak_bytes - (default_plan.predicted_peak_bytes - headroom)
    assert abs(beyond - logits_bytes) <= SLACK, (beyond, logits_bytes)  # one logits tensor the plan missed
    assert not report.within_budget
    # The same loop given as step_fn: the prediction covers the loop's measured peak, with no more to
    # spare than a headroom (at most 64 KiB + 0.5% of the no-checkpointing peak).
    planned = torchckpt.plan(model, batch, budget="85%", step_fn=keep_logits, loss_head=False)
    report = torchckpt.verify_plan(model, planned, batch, step_fn=keep_logits)
    most_headroom = HEADROOM_BYTES + HEADROOM_FRACTION * planned.reference["no_checkpointing_peak_bytes"]
    assert report.measured_peak_bytes <= planned.predicted_peak_bytes + SLACK
    assert planned.predicted_peak_bytes <= planned.budget_bytes
    assert planned.predicted_peak_bytes - report.measured_peak_bytes <= most_headroom + SLACK
    assert report.within_budget and report.gradients_equal and report.buffers_equal
    assert any(not getattr(piece, "plain", False) for piece in planned.schedule)  # something is checkpointed


def test_frontier_takes_step_fn() -> None:
    model, batch, logits_bytes = _model()
    plain = torchckpt.frontier(model, batch, points=2)
    held = torchckpt.frontier(model, batch, points=2, step_fn=keep_logits)
    top = {p.label: p.peak_bytes for p in plain.references}["no checkpointing"]
    held_top = {p.label: p.peak_bytes for p in held.references}["no checkpointing"]
    assert abs(held_top - top - logits_bytes) <= SLACK + 0.01 * top  # the headroom grows with the activations


def test_step_fn_and_loss_fn_together_are_refused_before_profiling() -> None:
    model, batch, _ = _model()
    with pytest.raises(ValueError, match="pass loss_fn= or step_fn=, not both"):
        torchckpt.plan(model, batch, budget="70%", loss_fn=lambda out: out[1], step_fn=keep_logits)
    plan = torchckpt.Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
                          block_paths=(), fingerprint={})
    with pytest.raises(ValueError, match="compute the loss inside it"):
        torchckpt.verify_plan(model, plan, batch, loss_fn=lambda out: out[1], step_fn=keep_logits)


def test_a_step_fn_that_never_calls_backward_is_refused() -> None:
    model, batch, _ = _model()
    with pytest.raises(ValueError, match=r"step_fn left no gradient .* must call loss.backward\(\)"):
        torchckpt.plan(model, batch, budget="70%", step_fn=lambda m, inputs: m(*inputs)[1])
    with pytest.raises(TypeError, match="step_fn must be callable; got str"):
        torchckpt.plan(model, batch, budget="70%", step_fn="train.py:step")  # type: ignore[arg-type]
