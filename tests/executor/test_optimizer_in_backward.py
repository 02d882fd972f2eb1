"""The optimizer's update inside the backward pass (executor/optimizer_in_backward.py): bitwise the optimizer's own
step, the loop unchanged, what needs every gradient refused; and plans made with it (profile, apply, verify_plan)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import torchckpt
from torchckpt.executor.optimizer_in_backward import optimizer_in_backward
from torchckpt.memory import MemoryMeter
from torchckpt.models import gpt


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=1e-3),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.Adam(params, lr=1e-3, weight_decay=0.01),
])
def test_three_steps_match_the_optimizers_own_step_bitwise(make):
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)  # tied embedding and head: one update for the shared weight
    batch = model.example_batch(batch_size=2, seq_len=32)
    other = copy.deepcopy(model)
    plain, inside = make(model.parameters()), make(other.parameters())
    schedule = torch.optim.lr_scheduler.StepLR(inside, step_size=1, gamma=0.5)
    plain_schedule = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    for _ in range(3):
        model(*batch).backward()
        plain.step()
        plain.zero_grad()
        plain_schedule.step()
    with optimizer_in_backward(inside) as handle:
        for _ in range(3):
            other(*batch).backward()
            inside.step()  # finds no gradients
            inside.zero_grad()
            schedule.step()  # the hyperparameters are read at every update
    assert handle.updates == 3 * sum(1 for _ in model.parameters())
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q) and q.grad is None
        for key, value in plain.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(inside.state[q][key]))
    assert json.dumps(inside.state_dict()["param_groups"], default=str)  # the optimizer saves as before


def test_gradients_never_all_live_at_once():
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    x = torch.randn(4, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = sum(p.numel() * 4 for p in model.parameters())

    def peak() -> int:
        with MemoryMeter() as meter:
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return meter.peak_bytes

    plain = peak()
    with optimizer_in_backward(optimizer):
        inside = peak()
    assert inside <= plain - grads + 2 * 256 * 256 * 4  # at most about one layer's gradient at a time


def test_what_needs_every_gradient_is_refused():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with optimizer_in_backward(optimizer):
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(RuntimeError, match="clip_grad_norm_ clips by the norm of all gradients"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match="GradScaler.scale"):
            torch.amp.GradScaler("cpu").scale(torch.ones(()))
        with pytest.raises(ValueError, match="already runs in the backward pass"):
            optimizer_in_backward(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # off again: passes through
    with pytest.raises(ValueError, match="LBFGS"):
        optimizer_in_backward(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        optimizer_in_backward(model)  # type: ignore[arg-type]


def test_a_plan_made_with_it_holds_its_budget_and_updates_bitwise():
    torch.manual_seed(2)
    model = gpt("mini", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=128)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="pass optimizer="):
        torchckpt.plan(model, batch, budget="50%", optimizer_in_backward=True)
    costs = torchckpt.profile(model, batch, optimizer=optimizer, optimizer_in_backward=True)
    plain_costs = torchckpt.profile(model, batch, optimizer=optimizer)
    assert costs.optimizer_in_backward and costs.tail_bytes < plain_costs.tail_bytes
    plan = costs.plan(costs.every_block_peak_bytes)
    assert plan.optimizer_in_backward and "inside the backward pass" in plan.table()
    assert torchckpt.Plan.from_json(plan.to_json()) == plan and json.loads(plan.to_json())["version"] == 2
    with pytest.raises(ValueError, match="pass the optimizer"):
        torchckpt.apply(model, plan)
    with pytest.raises(ValueError, match="pass verify_plan"):
        torchckpt.verify_plan(model, plan, batch)
    before = [p.detach().numpy().copy() for p in model.parameters()]  # NumPy: the meter counts live tensors only
    report = torchckpt.verify_plan(model, plan, batch, optimizer=optimizer)
    assert report.within_budget and report.gradients_equal and report.max_gradient_difference == 0, report.table()
    assert all((p.detach().numpy() == q).all() for p, q in zip(model.parameters(), before)) and not optimizer.state
    with torchckpt.apply(model, plan, optimizer=optimizer):
        model(*batch).backward()
        assert all(p.grad is None for p in model.parameters())
    model(*batch).backward()  # removed: gradients again
    assert all(p.grad is not None for p in model.parameters())


def test_load_state_dict_between_steps_is_honoured():
    """load_state_dict replaces the optimizer's state dict; the per-parameter updates use the new one (they kept
    updating the old one before, and every later checkpoint saved the stale loaded state)."""
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    plain, inside = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(twin.parameters())
    with optimizer_in_backward(inside):
        for _ in range(2):
            model(x).sum().backward()
            plain.step()
            plain.zero_grad()
            twin(x).sum().backward()
        saved = [copy.deepcopy(o.state_dict()) for o in (plain, inside)]
        for _ in range(2):
            model(x).sum().backward()
            plain.step()
            plain.zero_grad()
            twin(x).sum().backward()
        plain.load_state_dict(saved[0])
        inside.load_state_dict(saved[1])
        model(x).sum().backward()
        plain.step()
        twin(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(plain.state[p]["step"], inside.state[q]["step"])
        assert torch.equal(plain.state[p]["exp_avg"], inside.state[q]["exp_avg"])
