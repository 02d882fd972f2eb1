"""Every built-in size plans at its default budget (issue 32: `torchckpt train --size tiny` was infeasible at
the default). The fast tests check the defaults against the floors bench/train_defaults.py measured at the
default batch (bench/results/train_defaults.json); the slow one plans each size at its default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchckpt._units import parse_percent
from torchckpt.models import GPT_SIZES
from torchckpt.train.config import DEFAULT_BUDGETS, TrainConfig

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "train_defaults.json"


def test_each_size_gets_its_default_budget() -> None:
    assert set(DEFAULT_BUDGETS) == set(GPT_SIZES)
    for size, budget in DEFAULT_BUDGETS.items():
        assert TrainConfig(size=size).budget == budget
        assert TrainConfig(size=size, budget="40%").budget == "40%"
    assert TrainConfig(size="tiny", model="my.py:factory").budget == DEFAULT_BUDGETS["mini"]
    assert TrainConfig().budget == "28%"  # make demo's budget (README, docs/train.md, bench/results/demo.txt)


def test_each_default_budget_is_above_the_measured_floor_at_the_default_batch() -> None:
    results = json.loads(RESULTS.read_text())
    config = TrainConfig()
    assert (results["batch_size"], results["seq_len"], results["dropout"]) == (
        config.batch_size, config.seq_len, config.dropout), "the defaults changed: run bench/train_defaults.py again"
    assert set(results["sizes"]) == set(GPT_SIZES)
    for size, row in results["sizes"].items():
        share = parse_percent(DEFAULT_BUDGETS[size], option="--budget") / 100
        assert share > row["floor_share"], (size, DEFAULT_BUDGETS[size], row["floor_share"])


@pytest.mark.slow  # profiles each size at 16 x 256 (minutes for small and medium on 2 CPU cores)
@pytest.mark.parametrize("size", list(GPT_SIZES))
def test_each_size_plans_at_its_default_budget(size: str) -> None:
    import torch

    from torchckpt.models import gpt
    from torchckpt.planner.isolation import plan_without_side_effects

    config = TrainConfig(size=size)
    torch.manual_seed(config.seed)
    model = gpt(size, dropout=config.dropout)
    batch = model.example_batch(batch_size=config.batch_size, seq_len=config.seq_len)
    plan = plan_without_side_effects(model, batch, config.budget)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
