"""Below every block: how far each new plan option lowers the floor, plans there, and the time won back at its peak.

For each model (default: decoders with real vocabularies, the regime's gpt-small, HF Llama, and a CNN), profiled
once without an optimizer (plain SGD: no state):

- the floor (the least budget any plan fits) with the options of before (regions, selective ops), then with the
  pieces of a block nested, with the loss head in chunks, and with both, each as a share of every block's
  measured peak (``gradient_checkpointing_enable()``'s);
- the plan at the floor with every option, and one step with it measured (``verify_plan``): peak, prediction
  error, gradients; where the plan takes the work before the first block as a block (planner/stem.py), every
  block's peak stays that of the repeated blocks found (profiled again with them given);
- at every block's measured peak: bare training steps, interleaved and timed (median of ``--repeats``):
  no checkpointing, every block checkpointed, and torchckpt's plan for that budget; the share of every block's
  recompute cost won back, (t_every_block - t_plan) / (t_every_block - t_no_checkpointing);
- with ``batch_slices=4`` (blocks exact in slices of the batch recomputed slice by slice), profiled again: the
  floor, and the plan there measured;
- with AdamW, profiled four more times (without and with the optimizer inside the backward pass, with batch
  slices, and with its state in host memory between steps, ``optimizer_offload=True``): the floors, and what the
  first, the sliced and the offloaded are made of (the parts of the infeasible-budget error, which sum to it); the
  plan at the offloaded floor measured over a whole training step, the optimizer's included (``verify_plan`` with
  the optimizer: the parameters after the update compared bitwise).

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/below_every_block.py [--models NAMES] [--repeats 3] [--name N]

Results: bench/results/below_every_block.json and .md (or ``--name``'s), with the commit they ran on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import torchckpt
from harness.provenance import run_record, write_results
from torchckpt._units import format_bytes
from torchckpt.executor import checkpoint_modules
from torchckpt.models.registry import MODELS as REGISTRY
from torchckpt.models.registry import load_model
from torchckpt.planner.blocks import block_paths, resolve_blocks
from torchckpt.planner.from_costs import floor_over_options
from torchckpt.planner.runner import StepRunner

BATCH_SLICES = 4  # plan(..., batch_slices=4): blocks exact in 4 slices of the batch may be recomputed so
MODELS = ("hf-llama-32k-4x512", "hf-gpt2-50k-4x512", "gpt-small-8x512", "hf-llama-8x256", "unet-small-b8",
          "hf-resnet-b32")


def _floor(costs: Any) -> int:
    return floor_over_options(costs, allow_regions=True, margin_bytes=costs.margin_bytes)


def _without(costs: Any, *, head: bool, pieces: bool) -> Any:
    """``costs`` with the loss head option and/or the nested pieces taken out."""
    if not head:
        costs = replace(costs, loss_head={})
    if not pieces:
        costs = replace(costs, blocks=tuple(replace(b, nested_recompute_peak_bytes=-1) for b in costs.blocks))
    return costs


def _timed(runner: StepRunner, repeats: int, setups: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Bare forward+backward steps, interleaved across ``setups`` (name -> context factory); median, min, max."""
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(repeats + 1):  # the first round warms up
        for name, setup in setups.items():
            runner.clear_grads()
            with setup():
                start = time.perf_counter()
                runner.forward_backward()
                times[name].append(time.perf_counter() - start)
            runner.clear_grads()
    return {name: {"median_s": statistics.median(values[1:]), "min_s": min(values[1:]), "max_s": max(values[1:])}
            for name, values in times.items()}


def measure(name: str, repeats: int) -> dict[str, Any]:
    """Profile one registry model and measure what the module docstring lists."""
    torch.manual_seed(0)
    model, inputs = load_model(name)
    start = time.perf_counter()
    costs = torchckpt.profile(model, inputs)
    profile_s = time.perf_counter() - start
    # "every block" is what a user's one-liner checkpoints: the repeated blocks found, not a stem the plan adds
    found = resolve_blocks(model, "auto")
    stem_taken = costs.block_paths[0] not in block_paths(model, found)
    every = (torchckpt.profile(model, inputs, blocks=found) if stem_taken else costs).every_block_peak_bytes
    floors = {label: _floor(_without(costs, head=head, pieces=pieces)) for label, head, pieces in (
        ("before", False, False), ("pieces nested", False, True), ("loss head in chunks", True, False),
        ("both", True, True))}
    record: dict[str, Any] = {"model": name, "description": REGISTRY[name].description, "profile_s": profile_s,
                              "plain_step_s": costs.step_time_s, "every_block_peak_bytes": every,
                              "plain_head_bytes": costs.head_bytes, "loss_head": costs.loss_head,
                              "stem": costs.notes.get("stem"),
                              "floors": floors, "floor_share": {k: v / every for k, v in floors.items()}}
    record["at_floor"] = _at_floor(model, inputs, costs, floors["both"])
    sliced = torchckpt.profile(model, inputs, batch_slices=BATCH_SLICES)
    floors[f"batch slices ({BATCH_SLICES})"] = _floor(sliced)
    record["floor_share"] = {k: v / every for k, v in floors.items()}
    record["batch_slices_note"] = sliced.notes.get("batch slices", "")
    record["at_sliced_floor"] = _at_floor(model, inputs, sliced, floors[f"batch slices ({BATCH_SLICES})"])
    at_every = costs.plan(every)
    runner = StepRunner(model, inputs)
    times = _timed(runner, repeats, {
        "no checkpointing": lambda: torch.enable_grad(),
        "every block": lambda: checkpoint_modules(found, policy="nothing_saveable"),
        "torchckpt": lambda: torchckpt.apply(model, at_every)})
    t_none, t_every, t_plan = (times[k]["median_s"] for k in ("no checkpointing", "every block", "torchckpt"))
    record["at_every_block_peak"] = {"times": times, "plan_predicted_extra_s": at_every.predicted_extra_time_s,
                                     "won_back": (t_every - t_plan) / (t_every - t_none) if t_every > t_none else None}
    optimizer = torch.optim.AdamW(model.parameters())
    adamw = torchckpt.profile(model, inputs, optimizer=optimizer)
    inside = torchckpt.profile(model, inputs, optimizer=optimizer, optimizer_in_backward=True)
    adamw_sliced = torchckpt.profile(model, inputs, optimizer=optimizer, batch_slices=BATCH_SLICES)
    offloaded = torchckpt.profile(model, inputs, optimizer=optimizer, optimizer_offload=True)
    adamw_every = (torchckpt.profile(model, inputs, optimizer=optimizer, blocks=found) if stem_taken
                   else adamw).every_block_peak_bytes
    record["adamw"] = {"every_block_peak_bytes": adamw_every, "floor_bytes": _floor(adamw),
                       "floor_in_backward_bytes": _floor(inside), "floor_parts": _floor_parts(adamw),
                       "state_bytes": dict(adamw.state_bytes), "floor_sliced_bytes": _floor(adamw_sliced),
                       "floor_sliced_parts": _floor_parts(adamw_sliced), "floor_offload_bytes": _floor(offloaded),
                       "floor_offload_parts": _floor_parts(offloaded),
                       "at_offload_floor": _at_floor(model, inputs, offloaded, _floor(offloaded), optimizer)}
    return record


def _at_floor(model: Any, inputs: Any, costs: Any, floor: int, optimizer: Any = None) -> dict[str, Any]:
    """The plan at ``floor`` from ``costs``, measured once (``verify_plan``; with ``optimizer``, a plan made with its
    state in host memory, the optimizer's step inside the measured peak)."""
    plan = costs.plan(floor)
    report = torchckpt.verify_plan(model, plan, inputs, optimizer=optimizer)
    rows = plan.decisions()
    return {"budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "measured_peak_bytes": report.measured_peak_bytes, "within_budget": report.within_budget,
            "prediction_error": report.prediction_error, "gradients_equal": report.gradients_equal,
            "rounding_only": list(report.rounding_only),
            "rounding_relative_difference": report.rounding_relative_difference, "loss_head": plan.loss_head,
            "nested_blocks": sum(1 for row in rows if "nested" in row["decision"]),
            "sliced_blocks": sum(1 for row in rows if "slices of the batch" in row["decision"])}


def _floor_parts(costs: Any) -> dict[str, Any]:
    """What the floor is made of (solve/floor_parts.py's [the floor is told in parts]): the figures of the error a
    budget below it raises, and its message."""
    try:
        costs.plan(1)
    except torchckpt.InfeasibleBudgetError as error:
        return {**error.breakdown, "message": str(error)}
    raise AssertionError("a budget of 1 byte planned")


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown report."""
    lines = ["# Below every block", "",
             f"Commit {results['commit']}; {results['machine']}, {results['cpu_count']} CPUs, 1 torch thread. "
             "Command: `MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/below_every_block.py"
             f"{results.get('args', '')}`. Peaks are exact "
             "live tensor bytes (MemoryMeter); floors are the least budget some plan fits (predicted, margin "
             "included); without an optimizer unless the column says AdamW.", "",
             "## Floors, as a share of every block's measured peak", "",
             f"| model | every block | before | pieces nested | loss head in chunks | both | + batch slices "
             f"({BATCH_SLICES}) | AdamW: every block | AdamW floor | AdamW, optimizer in backward | AdamW + batch "
             f"slices ({BATCH_SLICES}) | AdamW, state in host memory |", "|---" * 12 + "|"]
    for r in results["models"]:
        share = r["floor_share"]
        a = r["adamw"]
        lines.append(f"| {r['model']} | {format_bytes(r['every_block_peak_bytes'])} | "
                     + " | ".join(f"{format_bytes(r['floors'][k])} ({share[k]:.2f}x)" for k in
                                  ("before", "pieces nested", "loss head in chunks", "both",
                                   f"batch slices ({BATCH_SLICES})"))
                     + f" | {format_bytes(a['every_block_peak_bytes'])} | "
                     + " | ".join(f"{format_bytes(a[k])} ({a[k] / a['every_block_peak_bytes']:.2f}x)" for k in
                                  ("floor_bytes", "floor_in_backward_bytes", "floor_sliced_bytes",
                                   "floor_offload_bytes")) + " |")
    lines += ["", f"Batch slices: {'; '.join(r['model'] + ': ' + r['batch_slices_note'] for r in results['models'])}."]
    lines += ["", "## What the AdamW floor is made of", "",
              "The floor's parts sum to it exactly (solve/floor_parts.py); \"the block itself\" is the binding "
              "block's own need, the gradients made by then included. \"0.6x needs\" is what the activations "
              "(checkpointed inputs, other held, the block itself) may be at 0.6x of every block's peak, beside what "
              "they are.", "",
              "| model | floor | parameters | optimizer state | gradients (all) | rest outside the blocks | "
              "checkpointed inputs | other held | the block itself | margin | binding | activations | 0.6x needs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, label, key in [(r, label, key) for r in results["models"] for label, key in (
            ("", "floor_parts"), (f" + batch slices ({BATCH_SLICES})", "floor_sliced_parts"),
            (", state in host memory", "floor_offload_parts"))]:
        a = r["adamw"]
        p = a[key]
        activations = p["checkpoint_bytes"] + p["other_held_bytes"] + p["own_bytes"]
        allowed = 0.6 * a["every_block_peak_bytes"] - (p["floor_bytes"] - activations)
        cells = [format_bytes(p["floor_bytes"]), format_bytes(p["parameters_bytes"]),
                 format_bytes(p["optimizer_state_bytes"]), format_bytes(a["state_bytes"].get("gradients", 0)),
                 format_bytes(p["outside_bytes"]), f"{p['checkpoints']}: {format_bytes(p['checkpoint_bytes'])}",
                 format_bytes(p["other_held_bytes"]), format_bytes(p["own_bytes"]), format_bytes(p["margin_bytes"]),
                 p["binding"], format_bytes(activations),
                 format_bytes(int(allowed)) if allowed > 0 else "unreachable: the rest is over 0.6x"]
        lines.append(f"| {r['model']}{label} | " + " | ".join(cells) + " |")
    lines += ["", "## The plan at the floor, measured", "",
              "| model | budget | predicted | measured | within | error | head | nested blocks | "
              "blocks in slices (or pieces) | "
              "gradients |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r, label, f in [(r, label, r[key]) for r in results["models"] for label, key in (
            ("", "at_floor"), (f" + batch slices ({BATCH_SLICES})", "at_sliced_floor"))] + [
            (r, ", AdamW, state in host memory (the step's update inside)", r["adamw"]["at_offload_floor"])
            for r in results["models"]]:
        grads = "bitwise" if f["gradients_equal"] else "DIFFER"
        if f["rounding_only"]:
            names = f["rounding_only"]
            shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
            grads += f" but {shown} (to rounding, {f['rounding_relative_difference']:.1g})"
        head = f"chunks of {f['loss_head']['chunk_tokens']}" if f["loss_head"] else "whole"
        lines.append(f"| {r['model']}{label} | {format_bytes(f['budget_bytes'])} | "
                     f"{format_bytes(f['predicted_peak_bytes'])} | {format_bytes(f['measured_peak_bytes'])} | "
                     f"{'yes' if f['within_budget'] else '**NO**'} | "
                     f"{f['prediction_error']:+.2%} | {head} | {f['nested_blocks']} | {f['sliced_blocks']} | {grads} |")
    lines += ["", f"## At every block's measured peak: bare steps, median of {results['repeats']} "
              "(min-max), interleaved", "",
              "| model | no checkpointing | every block | torchckpt | share of every block's recompute cost won back |",
              "|---|---|---|---|---|"]
    for r in results["models"]:
        t = r["at_every_block_peak"]["times"]
        cells = [f"{t[k]['median_s']:.3f} s ({t[k]['min_s']:.3f}-{t[k]['max_s']:.3f})"
                 for k in ("no checkpointing", "every block", "torchckpt")]
        won = r["at_every_block_peak"]["won_back"]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + f" | {'n/a' if won is None else f'{won:.0%}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the models; write bench/results/below_every_block.{json,md}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="below_every_block", help="result file name (.json and .md)")
    parser.add_argument("--batch-slices", type=int, default=BATCH_SLICES,
                        help=f"k of the batch-slices columns (default {BATCH_SLICES})")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.batch_slices < 2:
        parser.error("--batch-slices must be at least 2")
    globals()["BATCH_SLICES"] = args.batch_slices  # the columns' k, read by measure() and markdown()
    torch.set_num_threads(1)
    chosen = "" if args.models == ",".join(MODELS) else f" --models {args.models}"
    chosen += "" if args.name == "below_every_block" else f" --name {args.name}"
    chosen += "" if args.batch_slices == 4 else f" --batch-slices {args.batch_slices}"
    results = run_record(Path(__file__).parent, repeats=args.repeats, args=chosen)  # the commit it starts on
    results["batch_slices"] = args.batch_slices
    results["models"] = [measure(name, args.repeats) for name in args.models.split(",")]
    write_results(results, args.out_dir, f"{args.name}.json")
    text = markdown(results)
    (Path(args.out_dir) / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
