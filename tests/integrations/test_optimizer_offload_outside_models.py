"""The optimizer's state in host memory (``optimizer_offload=True``) on models nobody here wrote: every family of
outside_models.py (decoders, an encoder, ViT, ConvNeXt, ResNet with BatchNorm, diffusers' UNet, PEFT LoRA with
frozen weights, plain-torch shapes) with AdamW, planned at its floor; ``verify_plan`` measures the step with its
update inside the peak and the parameters after it bitwise; then two real training steps under the plan (forward,
backward, ``optimizer.step()``, the loop keeping its loss) stay within the predicted peak, and the parameters and
AdamW state equal, bitwise, two plain steps of a twin model with its state on the device.
Slow tier (make test-all); tests/planner/test_optimizer_offload_plans.py checks the same on the project's GPT and an
HF Llama in the fast one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from outside_models import BUILDERS, Case, case_for

import torchckpt
from torchckpt.memory import MemoryMeter
from torchckpt.memory.host_pool import is_host_tensor
from torchckpt.planner.from_costs import floor_over_options
from torchckpt.planner.runner import StepRunner


def _case(name: str) -> Case:
    return case_for(name)


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_at_its_floor_a_whole_step_holds_and_matches_the_plain_one(name: str) -> None:
    case = _case(name)
    twin = copy.deepcopy(case.model)
    optimizer = _adamw(case.model)
    costs = torchckpt.profile(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=optimizer,
                              blocks=case.blocks, optimizer_offload=True)
    plan = costs.plan(floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes))
    report = torchckpt.verify_plan(case.model, plan, case.inputs, loss_fn=case.loss_fn, optimizer=optimizer)
    assert report.within_budget and report.gradients_equal and report.buffers_equal, report.table()
    assert not optimizer.state  # verify_plan and profile leave the optimizer as they found it

    # The planned steps first: the meter counts every tensor alive in the process, and the twin held only its
    # parameters while profiling (its gradients and AdamW state, made by the reference steps, come after).
    runner = StepRunner(case.model, case.inputs, case.loss_fn)
    with torchckpt.apply(case.model, plan, optimizer=optimizer):
        for step in range(2):
            torch.manual_seed(step)  # the same dropout masks in both runs
            with MemoryMeter() as meter:
                loss = runner.forward_backward()  # kept through the step, as a loop that logs it
                optimizer.step()
            optimizer.zero_grad()
            del loss
            assert meter.peak_bytes <= plan.predicted_peak_bytes, (meter.peak_bytes, plan.predicted_peak_bytes)
        assert all(is_host_tensor(v) for state in optimizer.state.values() for v in state.values() if v.dim() > 0)
    plain = _adamw(twin)
    reference = StepRunner(twin, case.inputs, case.loss_fn)
    for step in range(2):
        torch.manual_seed(step)
        reference.forward_backward()
        plain.step()
        plain.zero_grad()
    pairs = list(zip(case.model.parameters(), twin.parameters()))
    assert all(torch.equal(p, q) for p, q in pairs)
    assert all(torch.equal(b, c) for b, c in zip(case.model.buffers(), twin.buffers()))
    for p, q in pairs:
        if p.requires_grad:
            assert all(torch.equal(optimizer.state[p][key], plain.state[q][key]) for key in plain.state[q])
