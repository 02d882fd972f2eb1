"""optimizer_shapes.py's [a fresh optimizer is shaped, not stepped]: a sharded restore into a fresh AdamW runs
no optimizer step, restores its state bitwise and trains on exactly as the original; an optimizer of another kind
still gets the restore's mismatch error (torch's own initialisation then runs); a restore refused after the state
was shaped leaves the optimizer with no state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchckpt import Checkpointer
from torchckpt.state import CheckpointMismatchError


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A first sharded save and restore in this process: DCP's state-dict machinery warms up once (a few seconds
    that the first sharded test in any worker pays), so the tests below time only themselves."""
    model = torch.nn.Linear(2, 2)
    with Checkpointer(tmp_path_factory.mktemp("warm"), sharded=True) as ckpt:
        ckpt.save(1, model=model, optimizer=torch.optim.AdamW(model.parameters()))
        ckpt.restore(model=model, optimizer=torch.optim.AdamW(model.parameters()))


def _trained(optimizer_kind: type = torch.optim.AdamW) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    optimizer = optimizer_kind(model.parameters(), lr=0.1, **({"momentum": 0.9} if optimizer_kind is torch.optim.SGD
                                                               else {}))
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_fresh_adamw_is_restored_bitwise_without_an_optimizer_step(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(2, model=model, optimizer=optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    restored = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    steps = []
    restored.register_step_pre_hook(lambda *args: steps.append(1))
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(model=fresh, optimizer=restored) == 2
    assert steps == []  # torch's initialisation would have taken one (zero gradients, learning rate 0)
    for saved, live in zip(optimizer.state.values(), restored.state.values()):
        assert saved.keys() == live.keys() and all(torch.equal(saved[k], live[k]) for k in saved)
    _step(model, optimizer)
    _step(fresh, restored)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_another_kind_of_optimizer_still_gets_the_mismatch_error(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.SGD)
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(2, model=model, optimizer=optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    adam = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError, match="momentum_buffer"):
        ckpt.restore(model=fresh, optimizer=adam)
    assert not adam.state


def test_a_restore_refused_after_shaping_leaves_no_state(tmp_path: Path) -> None:
    model, optimizer = _trained()
    with Checkpointer(tmp_path, sharded=True) as ckpt:
        ckpt.save(2, model=model, optimizer=optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    reversed_order = torch.optim.AdamW(list(fresh.parameters())[::-1], lr=0.1)  # same shapes, other order
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointMismatchError, match="parameter group"):
        ckpt.restore(model=fresh, optimizer=reversed_order)
    assert not reversed_order.state
