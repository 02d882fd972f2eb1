"""Offload planned and verified on the registry's models: the device and host peaks against their predictions,
gradients and buffers against no checkpointing, and the floor with offload against every block's peak.

For each model: profile once with AdamW and ``offload=True`` (costs.py's [offloaded blocks]); record what the
profile measured (bandwidths, the every-block-offloaded step's extra time) and which blocks the solver offloads at
every block's measured peak as measured here. Then, with the copies priced as a GPU's that hide behind compute
(``--copy-share`` of each block's forward time, 0.05 by default: on this CPU the copies are slower than recomputing,
so plans seldom offload), plan at three budgets (midway to no checkpointing, a quarter of the way, every block's
measured peak) and at the floor with offload, and verify each (``verify_plan``: one measured step with the plan,
one without). Byte figures are exact on the CPU (MemoryMeter; the host side is the second pool,
memory/host_pool.py); the times are this CPU's and say nothing of a GPU's (``bench/cuda_check.sh``'s offload
section measures those).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/offload.py \\
        --models hf-llama-8x256,hf-gpt2-8x256,unet-small-b8,hf-vit-224,gpt-small-8x512

Writes bench/results/offload.json (``--out``) with the commit it ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

import torchckpt
from harness.models import REGIME_MODELS, get_model
from harness.provenance import run_record, write_results
from torchckpt.planner import solve
from torchckpt.planner.from_costs import no_checkpointing_schedule

_SHARES = (("midway", 0.5), ("a quarter of the way", 0.25), ("every block's peak", 0.0))


def _verified(model: Any, inputs: Any, optimizer: Any, plan: Any) -> dict[str, Any]:
    report = torchckpt.verify_plan(model, plan, inputs, optimizer=optimizer)
    return {"budget_bytes": plan.budget_bytes, "predicted_peak_bytes": report.predicted_peak_bytes,
            "measured_peak_bytes": report.measured_peak_bytes, "prediction_error": report.prediction_error,
            "within_budget": report.within_budget, "gradients_equal": report.gradients_equal,
            "buffers_equal": report.buffers_equal, "predicted_host_peak_bytes": report.predicted_host_peak_bytes,
            "measured_host_peak_bytes": report.measured_host_peak_bytes,
            "offloaded_blocks": sum(1 for d in plan.decisions() if "offloaded" in d["decision"]),
            "blocks": len(plan.decisions())}


def measure(name: str, copy_share: float) -> dict[str, Any]:
    """One model: its profile with offload, and the plans verified (module docstring)."""
    entry = get_model(name)
    model, inputs = entry.build()
    blocks = entry.blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    costs = torchckpt.profile(model, inputs, optimizer=optimizer, blocks=blocks, offload=True)
    result: dict[str, Any] = {"name": name, "profile_s": time.perf_counter() - start,
                              "offload": costs.offload, "every_block_peak_bytes": costs.every_block_peak_bytes}
    as_measured = costs.plan(costs.every_block_peak_bytes)
    result["as_measured_offloaded_blocks"] = sum(1 for d in as_measured.decisions() if "offloaded" in d["decision"])
    priced = dataclasses.replace(costs, blocks=tuple(
        dataclasses.replace(b, offload_time_s=copy_share * b.forward_time_s) for b in costs.blocks))
    without = dataclasses.replace(costs, blocks=tuple(dataclasses.replace(b, offload_held_bytes=-1)
                                                      for b in costs.blocks))
    plain, _ = solve.evaluate(costs, no_checkpointing_schedule(costs))
    result["floor_without_offload_bytes"] = solve.floor_bytes(without)
    result["floor_with_offload_bytes"] = solve.floor_bytes(priced)
    result["floor_with_offload_over_every_block"] = result["floor_with_offload_bytes"] / costs.every_block_peak_bytes
    runs = {}
    for label, share in _SHARES:
        budget = int(costs.every_block_peak_bytes + share * (plain - costs.every_block_peak_bytes))
        runs[label] = _verified(model, inputs, optimizer, priced.plan(budget))
    floor_plan = priced.plan(result["floor_with_offload_bytes"])
    runs["the floor with offload"] = _verified(model, inputs, optimizer, floor_plan)
    result["runs"] = runs
    return result


def main(argv: list[str] | None = None) -> int:
    """Measure each model; print one line per run; write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(REGIME_MODELS))
    parser.add_argument("--copy-share", type=float, default=0.05,
                        help="each offloaded block's copy time as a share of its forward time (default 0.05)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "offload.json"))
    args = parser.parse_args(argv)
    if not 0 <= args.copy_share:
        parser.error(f"--copy-share must be >= 0; got {args.copy_share}")
    results = run_record(Path(__file__).parent, models=args.models.split(","), copy_share=args.copy_share)
    results["models"] = []
    for name in args.models.split(","):
        entry = measure(name, args.copy_share)
        results["models"].append(entry)
        for label, run in entry["runs"].items():
            print(f"{name} {label}: {run['offloaded_blocks']}/{run['blocks']} offloaded; peak measured "
                  f"{run['measured_peak_bytes']} predicted {run['predicted_peak_bytes']} "
                  f"({run['prediction_error']:+.2%}); "
                  f"host {run['measured_host_peak_bytes']}/{run['predicted_host_peak_bytes']}; gradients "
                  f"{'bitwise' if run['gradients_equal'] else 'DIFFER'}", flush=True)
        print(f"{name}: floor with offload {entry['floor_with_offload_over_every_block']:.2f}x every block's peak",
              flush=True)
    write_results(results, Path(args.out).parent, Path(args.out).name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
