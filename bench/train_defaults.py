"""The floor of each built-in GPT size under `torchckpt train`'s defaults, against the size's default budget.

For each size, the step `torchckpt train` plans (gpt(size) with its default dropout, a batch of the default
batch size x sequence length, AdamW state reserved: ``plan_without_side_effects``) is profiled once; the
floor (the least budget any plan fits, from ``InfeasibleBudgetError``) is told as a share of the
no-checkpointing peak, beside ``DEFAULT_BUDGETS[size]``, which must be above it (issue 32: `--size tiny` was
infeasible at its default). ``tests/train/test_default_budgets.py`` reads the results.

    .venv/bin/python bench/train_defaults.py                       # every size, ~10-30 minutes on 2 CPU cores
    .venv/bin/python bench/train_defaults.py --sizes tiny mini

Results: ``bench/results/train_defaults.json`` (commit, machine, load average before and after).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from harness.provenance import run_record, write_results
from torchckpt._units import parse_percent
from torchckpt.models import GPT_SIZES, gpt
from torchckpt.planner import InfeasibleBudgetError
from torchckpt.planner.isolation import plan_without_side_effects
from torchckpt.train.config import DEFAULT_BUDGETS, TrainConfig

RESULTS = Path(__file__).parent / "results"


def floor_share(size: str, config: TrainConfig) -> dict[str, float | str]:
    """Profile `torchckpt train`'s step for ``size``: its floor, no-checkpointing peak, and the default budget."""
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    model = gpt(size, dropout=config.dropout)
    batch = model.example_batch(batch_size=config.batch_size, seq_len=config.seq_len)
    plain = plan_without_side_effects(model, batch, "100%").reference["no_checkpointing_peak_bytes"]
    try:
        plan_without_side_effects(model, batch, 1)  # one byte: never feasible; the error tells the floor
    except InfeasibleBudgetError as error:
        floor = error.floor_bytes
    else:
        raise AssertionError("a budget of one byte was feasible")
    budget = DEFAULT_BUDGETS[size]
    percent = parse_percent(budget, option="--budget")
    assert percent is not None
    return {"default_budget": budget, "floor_bytes": floor, "no_checkpointing_peak_bytes": plain,
            "floor_share": floor / plain, "default_share": percent / 100, "fits": floor <= plain * percent / 100,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(GPT_SIZES), choices=list(GPT_SIZES))
    parser.add_argument("--out-dir", default=str(RESULTS))
    args = parser.parse_args(argv)
    config = TrainConfig()
    record = run_record(Path(__file__).parent, batch_size=config.batch_size, seq_len=config.seq_len,
                        dropout=config.dropout, optimizer="adamw", threads=torch.get_num_threads())
    record["sizes"] = {}
    for size in args.sizes:
        row = record["sizes"][size] = floor_share(size, config)
        print(f"{size}: floor {row['floor_share']:.1%} of the no-checkpointing peak; default budget "
              f"{row['default_budget']}: {'fits' if row['fits'] else 'BELOW THE FLOOR'} ({row['seconds']:.0f} s)",
              flush=True)
    print(f"wrote {write_results(record, args.out_dir, 'train_defaults.json')}")
    return 0 if all(row["fits"] for row in record["sizes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
