"""Plans made with the optimizer's state in host memory (plan(..., optimizer_offload=True)): the floor falls by the
state less one parameter's, the optimizer step's peak is measured and predicted, apply and verify_plan hold the
budget and update bitwise, the plan format refuses it to older readers, and bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch

import torchckpt
from torchckpt.executor.optimizer_offload import state_offload_of
from torchckpt.memory import MemoryMeter
from torchckpt.memory.host_pool import is_host_tensor
from torchckpt.models import gpt
from torchckpt.planner.from_costs import floor_over_options


def _floor(costs) -> int:
    """The least budget some plan fits (the margin included), as the floor benchmark reads it."""
    return floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes)


@pytest.fixture(scope="module")
def mini():
    torch.manual_seed(4)
    model = gpt("mini", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=128)
    optimizer = torch.optim.AdamW(model.parameters())
    plain = torchckpt.profile(model, batch, optimizer=optimizer)
    offloaded = torchckpt.profile(model, batch, optimizer=optimizer, optimizer_offload=True)
    return model, batch, optimizer, plain, offloaded


def test_the_floor_falls_by_the_state_less_the_step_it_brings_back(mini):
    model, _, optimizer, plain, offloaded = mini
    assert not optimizer.state  # planning changes nothing: no state made, none left on the host
    state = 2 * sum(p.numel() * 4 for p in model.parameters())  # exp_avg and exp_avg_sq
    scalars = 4 * len(list(model.parameters()))  # AdamW's step counters stay on the device
    assert plain.fixed_bytes - offloaded.fixed_bytes == state  # analytic: the whole state left the device
    assert offloaded.state_bytes["optimizer_state"] == scalars
    assert plain.state_bytes["optimizer_state"] == state + scalars
    assert offloaded.optimizer_offload and not plain.optimizer_offload
    floor, plain_floor = _floor(offloaded), _floor(plain)
    assert plain_floor - floor >= state // 2, (plain_floor, floor)  # at least half the state won back here


def test_a_plan_at_the_floor_holds_its_budget_and_updates_bitwise(mini):
    model, batch, optimizer, plain, offloaded = mini
    budget = _floor(offloaded)
    with pytest.raises(torchckpt.InfeasibleBudgetError):
        plain.plan(budget)  # below the floor with the state on the device
    plan = offloaded.plan(budget)
    assert plan.optimizer_offload and "host memory between steps" in plan.table()
    text = plan.to_json()
    assert json.loads(text)["version"] == 5 and torchckpt.Plan.from_json(text) == plan
    older = json.loads(text)
    older["version"] = 7
    with pytest.raises(ValueError, match="upgrade torchckpt"):
        torchckpt.Plan.from_json(json.dumps(older))
    with pytest.raises(ValueError, match="pass the optimizer"):
        torchckpt.apply(model, plan)
    with pytest.raises(ValueError, match="pass verify_plan"):
        torchckpt.verify_plan(model, plan, batch)
    before = [p.detach().numpy().copy() for p in model.parameters()]  # NumPy: the meter counts live tensors only
    report = torchckpt.verify_plan(model, plan, batch, optimizer=optimizer)
    assert report.within_budget and report.gradients_equal and report.max_gradient_difference == 0, report.table()
    assert report.measured_peak_bytes <= plan.predicted_peak_bytes, report.table()
    assert all((p.detach().numpy() == q).all() for p, q in zip(model.parameters(), before)) and not optimizer.state


def test_training_under_the_plan_stays_within_budget_with_its_step(mini):
    """Three real steps (forward, backward, optimizer.step) under one meter each: the step's peak, the state brought
    back one parameter at a time included, never passes the prediction; the state is on the host between steps and
    back on the device after remove()."""
    model, batch, optimizer, _, offloaded = mini
    plan = offloaded.plan(_floor(offloaded))
    with torchckpt.apply(model, plan, optimizer=optimizer):
        assert state_offload_of(optimizer) is not None
        for _ in range(3):
            with MemoryMeter() as meter:
                model(*batch).backward()
                optimizer.step()
            optimizer.zero_grad()
            assert meter.peak_bytes <= plan.predicted_peak_bytes, (meter.peak_bytes, plan.predicted_peak_bytes)
            assert all(is_host_tensor(s["exp_avg"]) for s in optimizer.state.values())
    assert state_offload_of(optimizer) is None
    assert not any(is_host_tensor(s["exp_avg"]) for s in optimizer.state.values())
    optimizer.state.clear()


def test_bad_input_is_refused_before_profiling():
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=2, seq_len=16)
    with pytest.raises(ValueError, match="pass optimizer="):
        torchckpt.plan(model, batch, budget="50%", optimizer_offload=True)
    with pytest.raises(TypeError, match="optimizer_offload must be True or False"):
        torchckpt.plan(model, batch, budget="50%", optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       optimizer_offload="yes")
    with pytest.raises(ValueError, match="fused=False"):
        torchckpt.plan(model, batch, budget="50%", optimizer=torch.optim.AdamW(model.parameters(), fused=True),
                       optimizer_offload=True)


def test_where_the_optimizer_step_sets_the_peak_it_is_predicted():
    """An HF Llama whose embedding and head outweigh its activations: at the floor the step that brings each
    parameter's state back peaks highest. Before the step was measured, verify_plan found it 15% over its budget;
    now the floor, the prediction and three real steps (the loop keeping its loss) agree to the byte."""
    pytest.importorskip("transformers")
    from torchckpt.models.registry import load_model

    torch.manual_seed(0)
    model, inputs = load_model("hf-llama-tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    costs = torchckpt.profile(model, inputs, optimizer=optimizer, optimizer_offload=True)
    plan = costs.plan(_floor(costs))
    report = torchckpt.verify_plan(model, plan, inputs, optimizer=optimizer)
    assert report.within_budget and report.gradients_equal, report.table()
    peaks = []
    with torchckpt.apply(model, plan, optimizer=optimizer):
        for _ in range(3):
            with MemoryMeter() as meter:
                loss = model(**inputs).loss
                loss.backward()
                backward_peak = meter.peak_bytes
                optimizer.step()
            optimizer.zero_grad()
            peaks.append((backward_peak, meter.peak_bytes))
            del loss
    assert all(step > backward for backward, step in peaks)  # the step sets the peak here
    assert max(step for _, step in peaks) == plan.predicted_peak_bytes <= plan.budget_bytes, peaks


def test_the_docs_example_runs_as_written():
    """docs/planner.md's "The optimizer's state in host memory" example, executed; what it prints holds."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    section = text[text.index("## The optimizer's state in host memory"):]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]
    namespace: dict = {}
    exec(compile(block, "docs/planner.md", "exec"), namespace)  # noqa: S102 - our own docs
    model, report = namespace["model"], namespace["report"]
    state = 2 * sum(p.numel() * 4 for p in model.parameters())
    assert namespace["with_state"].fixed_bytes - namespace["offloaded"].fixed_bytes == state
    assert report.within_budget and report.gradients_equal, report.table()
    assert namespace["plan"].budget_bytes == int(0.7 * namespace["with_state"].every_block_peak_bytes)
    with pytest.raises(torchckpt.InfeasibleBudgetError, match="optimizer_offload=True"):  # the lever is named
        namespace["with_state"].plan(namespace["plan"].budget_bytes)


def test_refused_under_ddp_or_fsdp2(monkeypatch):
    """A model in a process group (DDP, FSDP2) is refused before anything is measured, naming FSDP2's own offload."""
    import sys

    module = sys.modules["torchckpt.planner.profile"]  # the module: torchckpt.planner.profile is the function
    monkeypatch.setattr(module, "process_group_of", lambda model: object())
    model = gpt("tiny", dropout=0.0)
    with pytest.raises(ValueError, match="not planned under DDP or FSDP2 yet .*CPUOffloadPolicy"):
        torchckpt.profile(model, model.example_batch(batch_size=2, seq_len=16),
                          optimizer=torch.optim.AdamW(model.parameters()), optimizer_offload=True)
