"""``torchckpt plan`` and ``torchckpt frontier``: plan a built-in or user model against a budget."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from torchckpt.models import MODELS, BatchShape, load_model


def _profiled(args: argparse.Namespace, action: str) -> Any:
    from rich.console import Console

    from torchckpt.planner import (
        block_paths,
        fingerprint,
        frontier_from_costs,
        plan_from_costs,
        profile,
        resolve_blocks,
    )

    console = Console(stderr=True)
    shape = BatchShape(batch_size=args.batch_size, seq_len=args.seq_len, image_size=args.image_size)
    model, batch = load_model(args.model, shape, seed=args.seed)
    with console.status(f"profiling {args.model} ...") as status:
        blocks = resolve_blocks(model, "auto")
        costs = profile(model, batch, blocks=blocks,
                        progress=lambda message: status.update(f"{args.model}: {message}"))
        status.update(f"{args.model}: solving")
        paths = block_paths(model, blocks)
        identity = fingerprint(model, batch, paths)
        front = None
        if action == "frontier" or args.plot:
            front = frontier_from_costs(costs, points=getattr(args, "points", 12), block_paths=paths,
                                        model_fingerprint=identity)
        plan = plan_from_costs(costs, args.budget, block_paths=paths, model_fingerprint=identity) \
            if action == "plan" else None
    return plan, front


def _plan(args: argparse.Namespace) -> int:
    try:
        plan, front = _profiled(args, "plan")
    except ValueError as error:
        print(f"torchckpt plan: {error}", file=sys.stderr)
        return 2
    print(plan.table())
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if front is not None:
        print(f"frontier plot written to {front.plot(args.plot)}")
    return 0


def _frontier(args: argparse.Namespace) -> int:
    try:
        _, front = _profiled(args, "frontier")
    except ValueError as error:
        print(f"torchckpt frontier: {error}", file=sys.stderr)
        return 2
    print(front.table())
    if args.plot:
        print(f"plot written to {front.plot(args.plot)}")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-small", help=f"one of {', '.join(MODELS)}, or path/to/file.py:factory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (GPT)")
    parser.add_argument("--image-size", type=int, default=64, help="image height and width (U-Net)")
    parser.add_argument("--seed", type=int, default=0)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt plan`` and ``torchckpt frontier``."""
    plan = subparsers.add_parser("plan", help="plan activation checkpointing for a model under a memory budget")
    _common(plan)
    plan.add_argument("--budget", default="60%", help="bytes, '6GiB', '800MB' or a percentage of the "
                                                      "no-checkpointing peak (default 60%%)")
    plan.add_argument("--out", help="write the plan as JSON")
    plan.add_argument("--plot", help="also write a PNG of the memory/time frontier, with this plan's model")
    plan.set_defaults(func=_plan)
    front = subparsers.add_parser("frontier", help="memory/time trade-off: Pareto plans and reference methods")
    _common(front)
    front.add_argument("--points", type=int, default=12)
    front.add_argument("--plot", help="write a PNG of the frontier")
    front.set_defaults(func=_frontier)
