"""torchtitan's order on real gloo ranks: a plan made on the unsharded model (and sent as JSON, as if loaded from a
file) is applied, the blocks are compiled or not, then sharded with ``fully_shard``. The planned steps equal those
of the same sharded model without the plan, bitwise (a chunked loss head's weight gradient to rounding, as in one
process; the weights then differ to rounding after the first update, so only its gradients are compared), and
the plan says it was made for another layout (planner/layout.py's [a region over FSDP2 units runs block by
block], [a plan names the layout it was made for])."""

from __future__ import annotations

import pytest

from .order_workers import order_worker

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MODELS = ["gpt-mini", "hf-llama-tiny"]  # the project's GPT and an HF decoder built from its config


@pytest.mark.parametrize(("budget", "compiled", "models"), [
    ("hand", False, MODELS),  # a plan with a region, read from JSON, no profiling
    pytest.param("hand", True, MODELS, marks=pytest.mark.slow),  # ... with torch.compile between apply and shard
    pytest.param("90%", False, MODELS, marks=pytest.mark.slow),  # a profiled plan
    pytest.param("90%", True, MODELS, marks=pytest.mark.slow)])  # ... compiled
def test_plan_applied_before_fully_shard_runs_bitwise(spawn_ranks, budget: str, compiled: bool,
                                                      models: list[str]) -> None:
    ranks = spawn_ranks(order_worker, 2, models, budget, compiled)
    for name in models:
        records = [by_model[name] for by_model in ranks]
        for record in records:
            if budget == "hand":
                assert record["regions"] == 1, "the plan must have a region, or the test does not cover one"
            assert record["grads"] > 0 and record["grads_unequal"] == [], (name, record)
            assert record["losses_equal"], (name, record)
            assert len(record["layout_warnings"]) == 1  # once per applied plan
            assert "made for one process (no DDP, no FSDP2)" in record["layout_warnings"][0]
            assert "torchckpt.verify_plan(model, plan, batch) after fully_shard" in record["layout_warnings"][0]
        assert records[0]["losses"] != records[1]["losses"]  # each rank its own batch
    assert all(by_model["gpt-mini"]["recomputed"] >= 1 for by_model in ranks)  # the plan recomputes something
