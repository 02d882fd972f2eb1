"""At the measured peak of "checkpoint every block", is torchckpt's plan faster? And what does planning cost?

Runs on one model (default gpt("small"), batch 8 x 256, CPU): measures the peak of checkpointing every
block (recompute all, what HF's gradient_checkpointing_enable() does), plans with that peak (plus the planner's headroom) as
the budget, then times both methods interleaved (median and min-max over --repeats steps each), and reports
profiling and solving time in units of a plain training step. Results: bench/results/planner_vs_every_block.json

    .venv/bin/python bench/planner_vs_every_block.py [--size small] [--batch-size 8] [--seq-len 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import torchckpt
from torchckpt.remat import solve as solver
from torchckpt.models import gpt
from torchckpt.remat.profile import StepRunner, profile
from torchckpt.remat.planner import plan_from_costs
from torchckpt.remat.plan import fingerprint


def _step_s(runner: StepRunner) -> float:
    start = time.perf_counter()
    runner.forward_backward()
    elapsed = time.perf_counter() - start
    runner.clear_grads()
    return elapsed


def _peak(runner: StepRunner) -> int:
    with torchckpt.MemoryMeter() as meter:
        runner.forward_backward()
    runner.clear_grads()
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_vs_every_block.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = gpt(args.size)
    batch = model.example_batch(batch_size=args.batch_size, seq_len=args.seq_len)
    runner = StepRunner(model, batch)
    _step_s(runner)
    plain_s = statistics.median(_step_s(runner) for _ in range(3))

    start = time.perf_counter()
    costs = profile(model, batch)
    profile_s = time.perf_counter() - start
    with torchckpt.checkpoint_modules(model.blocks):
        every_block_peak = _peak(runner)
    paths = [f"blocks.{i}" for i in range(len(model.blocks))]
    # The planner keeps a headroom (profile.HEADROOM_*) for small untracked tensors; the plan gets that on top
    # of every block's measured peak, and both measured peaks are reported.
    headroom = int(costs.notes["headroom_bytes"])
    start = time.perf_counter()
    budget = max(every_block_peak + headroom, solver.floor_bytes(costs))
    plan = plan_from_costs(costs, budget, block_paths=paths,
                           model_fingerprint=fingerprint(model, batch, paths))
    solve_s = time.perf_counter() - start
    with torchckpt.apply(model, plan):
        plan_peak = _peak(runner)

    times: dict[str, list[float]] = {"every block": [], "torchckpt plan": []}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits both alike
        with torchckpt.checkpoint_modules(model.blocks):
            times["every block"].append(_step_s(runner))
        with torchckpt.apply(model, plan):
            times["torchckpt plan"].append(_step_s(runner))
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "model": f"gpt({args.size!r})", "batch": [args.batch_size, args.seq_len], "threads": torch.get_num_threads(),
        "plain_step_s": plain_s, "profile_s": profile_s, "profile_in_steps": profile_s / plain_s, "solve_s": solve_s,
        "every_block_peak_bytes": every_block_peak, "headroom_bytes": headroom, "plan_budget_bytes": plan.budget_bytes,
        "plan_predicted_peak_bytes": plan.predicted_peak_bytes, "plan_measured_peak_bytes": plan_peak,
        "step_s": {name: {"median": medians[name], "min": min(v), "max": max(v)} for name, v in times.items()},
        "speedup_vs_every_block": medians["every block"] / medians["torchckpt plan"],
        "plan": plan.table(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(plan.table())
    mib = 2**20
    print(f"every block: peak {every_block_peak / mib:.1f} MiB; plan (budget = that + {headroom / mib:.1f} MiB headroom): "
          f"predicted {plan.predicted_peak_bytes / mib:.1f} "
          f"MiB, measured {plan_peak / mib:.1f} MiB")
    for name, values in times.items():
        print(f"{name:>15}: median {medians[name]:.3f} s (min {min(values):.3f}, max {max(values):.3f}) "
              f"over {len(values)} interleaved steps")
    print(f"speed-up at equal peak: {result['speedup_vs_every_block']:.2f}x; profiling {profile_s:.1f} s = "
          f"{result['profile_in_steps']:.1f} plain steps; solving {solve_s:.3f} s")


if __name__ == "__main__":
    main()
