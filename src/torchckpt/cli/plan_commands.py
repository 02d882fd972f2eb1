"""``torchckpt plan`` and ``torchckpt frontier``: plan a built-in or user model against a budget.

A user model comes from ``--model path/to/file.py:factory`` (``models.load_model``: the factory returns
a model with ``example_batch(...)`` or a tuple ``(model, example_inputs)``). What the library takes as
arguments the command takes as flags: ``--loss file.py:fn`` (``loss_fn``), ``--step file.py:fn``
(``step_fn``) and ``--blocks`` (``blocks``, as module paths). Every bad value exits with code 2 and one
line naming the fix, before anything is profiled where it can be checked before.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn

from torchckpt._optional import install_hint
from torchckpt._progress import phase
from torchckpt.cli import COMMANDS
from torchckpt.models import MODELS, BatchShape, load_model
from torchckpt.train.status import reported

__all__ = ["CommandLineError", "register", "select_blocks"]

_BLOCKS_HELP = ("the blocks to plan, as module paths separated by commas; '*' stands for one name of a path, "
                "e.g. 'encoder.layer.*' or 'model.layers.*' or 'blocks.0,blocks.1' (default: found "
                "automatically, the longest run of one layer class)")


class CommandLineError(ValueError):
    """A bad value on the command line; the message names the flag and the fix."""


def select_blocks(model: nn.Module, spec: str) -> list[nn.Module]:
    """The modules ``--blocks spec`` names: comma-separated module paths in which ``*`` (or any
    ``fnmatch`` pattern) stands for one name of the path; each pattern's matches in the model's module
    order, the patterns in the order given. A pattern that matches nothing, or a module named twice, is a
    :class:`CommandLineError` listing paths the model has.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        >>> [type(m).__name__ for m in select_blocks(model, "1.*")]
        ['Linear', 'Linear']
        >>> len(select_blocks(model, "0, 1.1"))
        2
        >>> select_blocks(model, "layers.*")
        Traceback (most recent call last):
        torchckpt.cli.plan_commands.CommandLineError: --blocks layers.*: no module of the model has that path; ...
    """
    modules = [(name, module) for name, module in model.named_modules() if name]
    chosen: list[nn.Module] = []
    for pattern in (part.strip() for part in spec.split(",")):
        if not pattern:
            raise CommandLineError(f"--blocks {spec!r}: an empty path; give module paths separated by commas, "
                                   "e.g. --blocks 'encoder.layer.*'")
        parts = pattern.split(".")
        found = [module for name, module in modules if len(name.split(".")) == len(parts)
                 and all(fnmatchcase(a, b) for a, b in zip(name.split("."), parts))]
        if not found:
            shown = ", ".join(name for name, _ in modules if name.count(".") <= 1)
            raise CommandLineError(f"--blocks {pattern}: no module of the model has that path; its paths begin "
                                   f"{shown[:300]} ('*' stands for one name, e.g. model.layers.*)")
        for module in found:
            if any(module is other for other in chosen):
                raise CommandLineError(f"--blocks {spec}: a module is named twice ({pattern}); name each block once")
            chosen.append(module)
    return chosen


def _load_callable(flag: str, spec: str) -> Callable[..., Any]:
    """The function ``spec`` (``path/to/file.py:name``) names, for ``--loss`` and ``--step``."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name:
        raise CommandLineError(f"{flag} {spec}: give path/to/file.py:function")
    if not path.is_file():
        raise CommandLineError(f"{flag} {spec}: file {path} not found; give path/to/file.py:function")
    module_spec = importlib.util.spec_from_file_location(f"_torchckpt_cli_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise CommandLineError(f"{flag} {spec}: {path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file: report it in one line
        raise CommandLineError(f"{flag} {spec}: importing {path} failed: {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise CommandLineError(f"{flag} {spec}: {path} has no function {name!r}")
    return function


def _check_before_profiling(args: argparse.Namespace, action: str) -> None:
    """What can be refused before minutes of profiling: the budget, --plot without matplotlib, --loss
    with --step."""
    from torchckpt._units import parse_bytes, parse_percent

    if action == "plan" and parse_percent(args.budget, option="--budget") is None:
        parse_bytes(args.budget, option="--budget")
    if args.plot:
        try:
            import matplotlib  # noqa: F401 - only whether it is there
        except ImportError:
            raise CommandLineError(f"--plot needs matplotlib: {install_hint('matplotlib')}, or leave out "
                                   "--plot") from None
    if args.loss and args.step:
        raise CommandLineError("--loss and --step together: the --step function runs the whole forward and "
                               "backward, so compute the loss inside it and leave out --loss")
    if args.host_budget is not None and not args.offload:
        raise CommandLineError("--host-budget bounds the host memory of offloaded activations: give --offload too, "
                               "or leave out --host-budget")
    if args.host_budget is not None:
        parse_bytes(args.host_budget, option="--host-budget")


def _profiled(args: argparse.Namespace, action: str) -> Any:
    from torchckpt.planner import (
        fingerprint,
        frontier_from_costs,
        plan_from_costs,
        profile,
        resolve_blocks,
    )

    _check_before_profiling(args, action)
    loss_fn = _load_callable("--loss", args.loss) if args.loss else None
    step_fn = _load_callable("--step", args.step) if args.step else None
    shape = BatchShape(batch_size=args.batch_size, seq_len=args.seq_len, image_size=args.image_size)
    try:
        model, batch = load_model(args.model, shape, seed=args.seed)
    except (ImportError, SyntaxError) as error:  # the user's file: one line, as for --loss
        raise CommandLineError(f"--model {args.model}: importing failed: {type(error).__name__}: {error}") from None
    # "auto" itself, not the blocks it finds: the profile may put the stem before them (planner/stem.py)
    blocks = resolve_blocks(model, select_blocks(model, args.blocks)) if args.blocks else "auto"
    with reported(f"torchckpt {action}: {args.model}"):  # each phase, block and solving, on stderr
        costs = profile(model, batch, blocks=blocks, loss_fn=loss_fn, step_fn=step_fn, batch_slices=args.batch_slices,
                        offload=args.offload, host_budget=args.host_budget)
        phase("solving")
        paths = list(costs.block_paths)
        identity = fingerprint(model, batch, paths)
        front = None
        if action == "frontier" or args.plot:
            front = frontier_from_costs(costs, points=getattr(args, "points", 12), block_paths=paths,
                                        model_fingerprint=identity)
        plan = plan_from_costs(costs, args.budget, block_paths=paths, model_fingerprint=identity) \
            if action == "plan" else None
    return plan, front


def _run(args: argparse.Namespace, action: str) -> Any:
    """``_profiled``, with every refusal (a bad value, a model output without a loss) as one line, exit 2."""
    try:
        return _profiled(args, action)
    except (ValueError, TypeError) as error:  # bad values and outputs without a loss: the message says what to do
        hint = " (on the command line: --loss file.py:fn or --step file.py:fn)" if "loss_fn=" in str(error) else ""
        print(f"torchckpt {action}: {error}{hint}", file=sys.stderr)
        return None


def _plan(args: argparse.Namespace) -> int:
    result = _run(args, "plan")
    if result is None:
        return 2
    plan, front = result
    print(plan.table())
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if front is not None:
        print(f"frontier plot written to {front.plot(args.plot)}")
    return 0


def _frontier(args: argparse.Namespace) -> int:
    result = _run(args, "frontier")
    if result is None:
        return 2
    _, front = result
    print(front.table())
    if args.plot:
        print(f"plot written to {front.plot(args.plot)}")
    return 0


def _points(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 2 (budgets from the floor to the top); got {text}")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
    from torchckpt.cli import positive_int

    parser.add_argument("--model", default="gpt-small",
                        help=f"one of {', '.join(MODELS)}, or path/to/file.py:factory (the factory returns a model "
                             "with example_batch(batch_size=..., seq_len=...) or a tuple (model, example_inputs))")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (GPT)")
    parser.add_argument("--image-size", type=positive_int, default=64, help="image height and width (U-Net)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", help=_BLOCKS_HELP)
    parser.add_argument("--loss", metavar="FILE.py:FN",
                        help="the loss: FN(output) returns the scalar loss from the model's output (default: the "
                             "output if scalar, else output.loss / output['loss']; a non-scalar output needs --loss)")
    parser.add_argument("--batch-slices", type=positive_int, default=1, metavar="K",
                        help="let blocks that are exact in K slices of the batch be recomputed one slice at a time "
                             "(a lower floor; their weights' gradients then equal to rounding; default 1: never)")
    parser.add_argument("--offload", action="store_true",
                        help="let blocks run plainly with their saved activations in host memory, where that is "
                             "faster than recomputing them (on a CPU the host is a second, counted pool of the same "
                             "memory: for tests and teaching; one more measured step and four timed ones)")
    parser.add_argument("--host-budget", metavar="SIZE",
                        help="with --offload: the host memory offloaded activations may take at once, e.g. '16GiB' "
                             "(default: half the host memory available)")
    parser.add_argument("--step", metavar="FILE.py:FN",
                        help="your own training step: FN(model, example_inputs) runs the forward, calls "
                             "loss.backward() and returns the loss; use it when your loop keeps the output (the "
                             "logits) alive through backward, so that the plan counts it (not with --loss)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt plan`` and ``torchckpt frontier``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> register(parser.add_subparsers())
        >>> parser.parse_args(["plan", "--blocks", "model.layers.*"]).blocks
        'model.layers.*'
    """
    plan = subparsers.add_parser("plan", help=COMMANDS["plan"][1])
    _common(plan)
    plan.add_argument("--budget", default="60%", help="bytes, '6GiB', '800MB' or a percentage of the "
                                                      "no-checkpointing peak (default 60%%)")
    plan.add_argument("--out", help="write the plan as JSON")
    plan.add_argument("--plot", help="also write a PNG of the memory/time frontier, with this plan's model "
                                     "(needs matplotlib: pip install 'torchckpt[plot]')")
    plan.set_defaults(func=_plan)
    front = subparsers.add_parser("frontier", help=COMMANDS["frontier"][1])
    _common(front)
    front.add_argument("--points", type=_points, default=12, help="budgets to solve (>= 2; default 12)")
    front.add_argument("--plot", help="write a PNG of the frontier (needs matplotlib: pip install 'torchckpt[plot]')")
    front.set_defaults(func=_frontier)
