"""Note: [planning changes nothing]: plan() and frontier() hand back the model (parameters, buffers,
gradients, modes), the optimizer's state and the RNG exactly as they were, even with a real optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt


class BNBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


class BNNet(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BNBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    tensors = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    tensors.update({f"b:{n}": b.clone() for n, b in model.named_buffers()})
    tensors.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for i, state in enumerate(optimizer.state.values()):
        tensors.update({f"o:{i}:{k}": v.clone() for k, v in state.items()})
    tensors["rng"] = torch.get_rng_state()
    return tensors


@pytest.mark.parametrize("call", ["plan", "frontier"])
def test_planning_leaves_model_optimizer_and_rng_alone(call: str) -> None:
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x).backward()  # a run in progress: gradients and AdamW state already exist
    optimizer.step()
    model(x).backward()
    model.blocks[1].eval()  # and one submodule in eval mode
    before = _state(model, optimizer)
    identity = [id(p) for p in model.parameters()]
    if call == "plan":
        torchckpt.plan(model, (x,), budget="100%", optimizer=optimizer)
    else:
        torchckpt.frontier(model, (x,), points=2, optimizer=optimizer)
    after = _state(model, optimizer)
    assert sorted(after) == sorted(before)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed == []
    assert [id(p) for p in model.parameters()] == identity
    assert model.training and not model.blocks[1].training and model.blocks[0].training
    assert int(model.blocks[0].norm.num_batches_tracked) == 2  # the two steps above, none of planning's


def test_a_malformed_budget_is_refused_before_profiling() -> None:
    model = BNNet()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match="budget"):
        torchckpt.plan(model, (torch.randn(8, 32),), budget="lots")
    assert calls == []


class AuxNet(nn.Module):
    """Returns an auxiliary ``exp`` of the last hidden state that never reaches the loss (a logged value):
    ``exp`` saves its own output for backward, a node that never runs."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> dict:
        for block in self.blocks:
            x = block(x)
        return {"loss": self.head(x).pow(2).mean(), "aux": torch.exp(x)}


def _live_bytes() -> int:
    import gc

    gc.collect()
    with torchckpt.MemoryMeter() as meter:
        pass
    return meter.baseline_bytes


def test_profiling_leaves_no_tensor_alive_and_the_floor_plan_fits() -> None:
    """The profiler's saved-tensor hook once returned the tensor itself: an op that saves its own output
    then kept it (and its graph) alive in a cycle the collector cannot see, 64 KiB per profile here, which
    counted in every later peak (a floor plan measured 65,536 B over its budget)."""
    torch.manual_seed(0)
    model = AuxNet()
    inputs = (torch.randn(256, 64),)
    before = _live_bytes()
    for _ in range(3):
        costs = torchckpt.profile(model, inputs)
    assert _live_bytes() == before
    with pytest.raises(torchckpt.InfeasibleBudgetError) as caught:
        costs.plan("1%")
    report = torchckpt.verify_plan(model, costs.plan(caught.value.floor_bytes), inputs)
    assert report.within_budget and report.gradients_equal and report.buffers_equal
    assert _live_bytes() == before
    residuals = torchckpt.saved_residuals(model, *inputs, policy="everything_saveable")
    assert residuals.residuals and _live_bytes() == before
