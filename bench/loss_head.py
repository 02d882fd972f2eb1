"""Below every block with the loss head in chunks: the floor against every block's measured peak, and plans there.

For each decoder with a real vocabulary (``hf-llama-32k-4x512``: Llama 2's 32,000; ``hf-gpt2-50k-4x512``: GPT-2's
50,257; both 8 layers x 256 at 4 x 512 tokens, from configs), profiled once (plain SGD: no optimizer state):

- the plain head's bytes at the end of the forward pass, the chunked head's, every block's measured peak and the
  new floor (the least budget any plan fits), as a share of every block's peak;
- at the floor and at 0.6x every block's peak: the plan, and one measured step with it (``verify_plan``):
  measured peak, prediction error, gradients (all bitwise but the head weight's, to rounding).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/loss_head.py [--models NAMES]

Results: bench/results/loss_head.json and loss_head.md (with the commit they ran on).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

import torchckpt
from harness.provenance import run_record, write_results
from torchckpt._units import format_bytes
from torchckpt.models.registry import load_model
from torchckpt.planner.from_costs import floor_over_options

MODELS = ("hf-llama-32k-4x512", "hf-gpt2-50k-4x512")


def measure(name: str) -> dict[str, Any]:
    """Profile one registry model, plan at its floor and at 0.6x every block's peak, verify both."""
    torch.manual_seed(0)
    model, inputs = load_model(name)
    start = time.perf_counter()
    costs = torchckpt.profile(model, inputs)
    profile_s = time.perf_counter() - start
    every = costs.every_block_peak_bytes
    floor = floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes)
    record: dict[str, Any] = {"model": name, "profile_s": profile_s, "plain_step_s": costs.step_time_s,
                              "plain_head_bytes": costs.head_bytes, "loss_head": costs.loss_head,
                              "every_block_peak_bytes": every, "floor_bytes": floor, "floor_share": floor / every,
                              "plans": []}
    for label, budget in (("floor", floor), ("0.6x every block", int(0.6 * every))):
        plan = costs.plan(budget)
        report = torchckpt.verify_plan(model, plan, inputs)
        record["plans"].append({"label": label, "budget_bytes": budget, "loss_head": plan.loss_head,
                                "predicted_peak_bytes": plan.predicted_peak_bytes,
                                "measured_peak_bytes": report.measured_peak_bytes,
                                "within_budget": report.within_budget, "prediction_error": report.prediction_error,
                                "gradients_equal": report.gradients_equal,
                                "max_gradient_difference": report.max_gradient_difference,
                                "rounding_only": list(report.rounding_only),
                                "rounding_relative_difference": report.rounding_relative_difference,
                                "step_s": report.step_time_s,
                                "no_checkpointing_step_s": report.no_checkpointing_step_time_s})
    return record


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown report."""
    lines = ["# The loss head in chunks: below every block", "", f"Commit {results['commit']}; "
             f"{results['machine']}. Command: `MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/loss_head.py`.",
             "Plain SGD (no optimizer state); peaks are exact live tensor bytes (MemoryMeter).", "",
             "| model | plain head | chunked head | every block's peak | floor | floor / every block |",
             "|---|---|---|---|---|---|"]
    for r in results["models"]:
        chunked = r["loss_head"].get("head_bytes")
        lines.append(f"| {r['model']} | {format_bytes(r['plain_head_bytes'])} | "
                     f"{format_bytes(chunked) if chunked is not None else r['loss_head'].get('note', '')} | "
                     f"{format_bytes(r['every_block_peak_bytes'])} | {format_bytes(r['floor_bytes'])} | "
                     f"{r['floor_share']:.2f}x |")
    lines += ["", "| model | budget | head | predicted | measured | within | error | gradients | step / plain step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results["models"]:
        for p in r["plans"]:
            grads = "bitwise" if p["gradients_equal"] else "DIFFER"
            if p["rounding_only"]:
                grads += f"; {', '.join(p['rounding_only'])} to rounding ({p['rounding_relative_difference']:.1g})"
            lines.append(f"| {r['model']} | {p['label']} {format_bytes(p['budget_bytes'])} | "
                         f"{'chunks of ' + str(p['loss_head']['chunk_tokens']) if p['loss_head'] else 'whole'} | "
                         f"{format_bytes(p['predicted_peak_bytes'])} | {format_bytes(p['measured_peak_bytes'])} | "
                         f"{'yes' if p['within_budget'] else '**NO**'} | {p['prediction_error']:+.2%} | {grads} | "
                         f"{p['step_s'] / p['no_checkpointing_step_s']:.2f}x |")
    lines += ["", "Step times are single measured steps (with the meter), for orientation only; the timed comparison "
              "with peers is bench/run.py's."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the models, write bench/results/loss_head.{json,md}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run_record(Path(__file__).parent, models=[measure(name) for name in args.models.split(",")])
    write_results(results, args.out_dir, "loss_head.json")
    (Path(args.out_dir) / "loss_head.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
