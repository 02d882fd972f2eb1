"""Executor overhead: the same checkpointing decisions through torchckpt and by hand with torch's own API.

For each model, every block is checkpointed two ways with two decisions, and the steps are interleaved:

- recompute everything: ``torch.utils.checkpoint.checkpoint(block, use_reentrant=False)`` by hand, against
  ``torchckpt.checkpoint_modules(blocks, policy="nothing_saveable")``;
- keep the matmul outputs (JAX's ``dots_saveable``): ``create_selective_checkpoint_contexts`` by hand with a
  policy that returns ``MUST_SAVE`` for the same ops torchckpt's ``dots_saveable`` keeps, against
  ``torchckpt.checkpoint_modules(blocks, policy="dots_saveable")``;
- and no checkpointing, for the overhead above a plain step.

Target (tracker: plans on torch's own machinery): a torchckpt step takes <= 1.03x the time of the same
decisions written by hand (median of interleaved steps). Gradients of each torchckpt method are checked
bitwise against its hand-written twin. One thread per process (``torch.set_num_threads(1)``).

    .venv/bin/python bench/executor_overhead.py              # ~3 minutes on 2 CPU cores
    .venv/bin/python bench/executor_overhead.py --quick      # seconds (tests/bench runs it)

Results: ``bench/results/executor_overhead.json`` (commit, machine, load average before and after).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import torchckpt
from harness.provenance import run_record, write_results
from torchckpt.executor import OpInfo, dots_saveable

RESULTS = Path(__file__).parent / "results"


def _gpt(quick: bool) -> tuple[torch.nn.Module, list[torch.nn.Module], Callable[[], torch.Tensor]]:
    from torchckpt.models import gpt

    model = gpt("tiny" if quick else "small", dropout=0.0)
    batch = model.example_batch(batch_size=2 if quick else 8, seq_len=32 if quick else 256)
    return model, list(model.blocks), lambda: model(*batch)


def _vit(quick: bool) -> tuple[torch.nn.Module, list[torch.nn.Module], Callable[[], torch.Tensor]]:
    from transformers import ViTConfig, ViTForImageClassification

    size = 32 if quick else 224
    config = ViTConfig(hidden_size=64 if quick else 192, num_hidden_layers=2 if quick else 12,
                       num_attention_heads=2 if quick else 3, intermediate_size=128 if quick else 768,
                       image_size=size, patch_size=16, num_labels=10, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = ViTForImageClassification(config).train()
    pixels = torch.randn(2 if quick else 8, 3, size, size)
    labels = torch.randint(0, 10, (pixels.shape[0],))
    return model, list(model.vit.layers), lambda: model(pixel_values=pixels, labels=labels).loss


MODELS = {"gpt": _gpt, "vit": _vit}


def _dots_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torch SAC's policy with torchckpt's ``dots_saveable`` decision for each op (the same ops kept: random
    and in-place ops never, as torchckpt's executor rules say, so SDPA with its dropout argument is recomputed)."""
    never = func._schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags
    keep = not never and dots_saveable(OpInfo(func, args, kwargs, 0, None))
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _by_hand(blocks: list[torch.nn.Module], selective: bool) -> Callable[[], None]:
    """Wrap every block's forward with torch's checkpoint; returns the undo."""
    originals = [block.forward for block in blocks]
    context_fn = functools.partial(create_selective_checkpoint_contexts, _dots_policy) if selective else None
    for block, forward in zip(blocks, originals):
        extra = {"context_fn": context_fn} if context_fn is not None else {}

        def wrapped(*args: Any, _forward: Callable = forward, _extra: dict = extra, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **_extra, **kwargs)

        block.forward = wrapped  # type: ignore[method-assign]

    def undo() -> None:
        for block in blocks:
            del block.forward

    return undo


def _methods(blocks: list[torch.nn.Module]) -> dict[str, Callable[[], Callable[[], None]]]:
    return {
        "none": lambda: (lambda: None),
        "torch: every block": lambda: _by_hand(blocks, selective=False),
        "torchckpt: nothing_saveable": lambda: torchckpt.checkpoint_modules(blocks, policy="nothing_saveable").remove,
        "torch SAC: dots": lambda: _by_hand(blocks, selective=True),
        "torchckpt: dots_saveable": lambda: torchckpt.checkpoint_modules(blocks, policy="dots_saveable").remove,
    }


PAIRS = (("torchckpt: nothing_saveable", "torch: every block"), ("torchckpt: dots_saveable", "torch SAC: dots"))


def _step(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_fn().backward()
    elapsed = time.perf_counter() - start
    return elapsed, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def measure(name: str, quick: bool, rounds: int) -> dict[str, Any]:
    """Interleaved steps of every method on one model; median, min and max seconds; the pairs' ratios."""
    model, blocks, loss_fn = MODELS[name](quick)
    methods = _methods(blocks)
    labels = list(methods)
    times: dict[str, list[float]] = {label: [] for label in labels}
    grads: dict[str, list[torch.Tensor]] = {}
    for r in range(rounds + 1):  # round 0 warms up and is not counted
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            undo = methods[label]()
            try:
                torch.manual_seed(1)
                seconds, got = _step(model, loss_fn)
            finally:
                undo()
            if r:
                times[label].append(seconds)
            grads.setdefault(label, got)
    rows = {label: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "steps": len(t)}
            for label, t in times.items()}
    plain = rows["none"]["median_s"]
    pairs = []
    for ours, theirs in PAIRS:
        ratio = rows[ours]["median_s"] / rows[theirs]["median_s"]
        pairs.append({"torchckpt": ours, "torch": theirs, "ratio": ratio, "target": 1.03, "met": ratio <= 1.03,
                      "overhead_torchckpt_s": rows[ours]["median_s"] - plain,
                      "overhead_torch_s": rows[theirs]["median_s"] - plain,
                      "gradients_bitwise_equal": all(torch.equal(a, b) for a, b in zip(grads[ours], grads[theirs]))})
    return {"model": name, "blocks": len(blocks), "methods": rows, "pairs": pairs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; write and return the results.

    Example:
        >>> import tempfile
        >>> out = main(["--quick", "--models", "gpt", "--out", tempfile.mkdtemp()])  # doctest: +ELLIPSIS
        gpt ...
        >>> out["models"][0]["pairs"][0]["gradients_bitwise_equal"]
        True
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per method (default 9; 2 quick)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--out", default=str(RESULTS), help="folder for executor_overhead.json")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise SystemExit(f"executor_overhead: --models {args.models!r}: choose from {', '.join(MODELS)}")
    torch.set_num_threads(1)
    rounds = args.rounds or (2 if args.quick else 9)
    results = run_record(Path(__file__).parent, threads=1, rounds=rounds, quick=args.quick, models=[])
    for name in names:
        row = measure(name, args.quick, rounds)
        results["models"].append(row)
        summary = "; ".join(f"{p['torchckpt']} / {p['torch']} = {p['ratio']:.3f}x" for p in row["pairs"])
        print(f"{name}: {summary}", flush=True)
    write_results(results, args.out, "executor_overhead.json")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
