"""An infeasible budget's advice fits the model: shard (one process), FSDP2 instead of DDP (replicas), or more
processes (already FSDP2 units)."""

from __future__ import annotations

import pytest

from torchckpt.planner.costs import BlockCosts
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.solve import InfeasibleBudgetError, solve


@pytest.mark.parametrize(("notes", "advice"), [
    ({}, "sharding parameters, gradients and optimizer state (FSDP/ZeRO)"),
    ({"ranks": "2 ranks profiled", "engine": "DDP"}, "FSDP2 (fully_shard) instead of DDP"),
    ({"ranks": "2 ranks profiled", "engine": "FSDP2", "regions": "off (profiled with regions=False)"},
     "more processes to shard over")])
def test_the_advice_names_the_next_step(notes: dict, advice: str) -> None:
    block = BlockCosts(name="b", input_bytes=100, output_bytes=100, saved_bytes=400, forward_time_s=1.0)
    costs = ChainCosts(fixed_bytes=1000, head_bytes=10, blocks=(block, block), notes=notes)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(costs, 10)
    assert advice in str(caught.value)
    assert sum(phrase in str(caught.value) for phrase in ("FSDP/ZeRO", "instead of DDP", "more processes")) == 1
