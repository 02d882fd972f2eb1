"""``torchckpt plan`` and ``torchckpt frontier``: plan a built-in or user model against a budget."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchckpt.models import gpt, mlp, unet

_BUILT_IN = {f"gpt-{size}": (lambda size=size: gpt(size)) for size in ("tiny", "mini", "small", "medium")}
_BUILT_IN.update({f"unet-{size}": (lambda size=size: unet(size)) for size in ("tiny", "small", "medium")})
_BUILT_IN["mlp"] = lambda: mlp()


def load_model(spec: str, batch_size: int, seq_len: int, image_size: int = 64) -> tuple[nn.Module, tuple | dict]:
    """Build ``gpt-small`` (etc.) or ``path/file.py:factory`` and its example inputs.

    A factory returns a model with ``example_batch(batch_size=..., seq_len=...)`` or a tuple
    ``(model, example_inputs)``.

    Example:
        >>> model, batch = load_model("gpt-tiny", batch_size=2, seq_len=8)
        >>> batch[0].shape
        torch.Size([2, 8])
    """
    if spec in _BUILT_IN:
        model = _BUILT_IN[spec]()
    elif ":" in spec:
        path_text, _, name = spec.rpartition(":")
        path = Path(path_text)
        if not path.is_file():
            raise SystemExit(f"--model {spec}: file {path} not found; give path/to/file.py:factory")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        factory = getattr(module, name, None)
        if not callable(factory):
            raise SystemExit(f"--model {spec}: {path} has no callable {name!r}")
        model = factory()
        if isinstance(model, tuple):
            return model[0], model[1]
    else:
        raise SystemExit(f"--model {spec}: unknown; use one of {', '.join(_BUILT_IN)} or path/to/file.py:factory")
    if not hasattr(model, "example_batch"):
        raise SystemExit(f"--model {spec}: the model has no example_batch(); return (model, example_inputs) instead")
    if "seq_len" in model.example_batch.__code__.co_varnames:
        return model, model.example_batch(batch_size=batch_size, seq_len=seq_len)
    if "image_size" in model.example_batch.__code__.co_varnames:
        return model, model.example_batch(batch_size=batch_size, image_size=image_size)
    return model, model.example_batch(batch_size=batch_size)


def _profiled(args: argparse.Namespace, action: str) -> Any:
    from rich.console import Console

    import torchckpt

    from torchckpt.remat.frontier import frontier_from_costs
    from torchckpt.remat.plan import fingerprint
    from torchckpt.remat.planner import _block_paths, plan_from_costs
    from torchckpt.remat.profile import _resolve_blocks, profile

    console = Console(stderr=True)
    torch.manual_seed(args.seed)
    model, batch = load_model(args.model, args.batch_size, args.seq_len, args.image_size)
    with console.status(f"profiling {args.model} ...") as status:
        blocks = _resolve_blocks(model, "auto")
        costs = profile(model, batch, blocks=blocks,
                        progress=lambda message: status.update(f"{args.model}: {message}"))
        status.update(f"{args.model}: solving")
        paths = _block_paths(model, blocks)
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
    _, front = _profiled(args, "frontier")
    print(front.table())
    if args.plot:
        print(f"plot written to {front.plot(args.plot)}")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt-small", help="gpt-tiny|mini|small|medium, unet-..., mlp, or "
                                                             "path/to/file.py:factory")
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
