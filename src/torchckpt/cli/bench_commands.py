"""``torchckpt bench``: every method on every benchmark model, each in its own process; report and plots.

Writes ``<out-dir>/<name>.json`` (raw), ``<name>.md`` (tables and the targets' verdicts) and one PNG per
model. The targets are goals: the command exits 0 whether or not they are met (2 for bad options).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchckpt.bench.harness import BenchConfig
from torchckpt.bench.methods import PEER_KINDS
from torchckpt.bench.models import FULL_MODELS, MODELS


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _budgets(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers in [0, 1] separated by commas; got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the command line asks for (``--quick`` starts from the quick preset).

    Example:
        >>> parser = argparse.ArgumentParser(); _ = parser.add_subparsers()
        >>> args = argparse.Namespace(quick=True, models=None, peers=None, repeats=None, budgets=None, warmup=None,
        ...                           threads=None, with_compile=False, compile_budgets=None, name=None,
        ...                           out_dir=None, time_cap_min=None, command_timeout_s=None)
        >>> config_from_args(args).name
        'quick'
    """
    options: dict = {"out_dir": args.out_dir or "bench/results", "with_compile": args.with_compile}
    for option, value in (("models", args.models), ("peers", args.peers), ("repeats", args.repeats),
                          ("sweep_points", args.budgets), ("warmup_steps", args.warmup), ("threads", args.threads),
                          ("compile_budgets", args.compile_budgets), ("name", args.name),
                          ("command_timeout_s", args.command_timeout_s)):
        if value is not None:
            options[option] = value
    if args.time_cap_min is not None:
        options["time_cap_s"] = args.time_cap_min * 60.0
    return BenchConfig.quick_preset(**options) if args.quick else BenchConfig(**options)


def _run(args: argparse.Namespace) -> int:
    from torchckpt.bench.harness import run_benchmark
    from torchckpt.bench.report import write_reports

    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            print(f"torchckpt bench --from-json {path}: no such file; give a <name>.json that torchckpt bench wrote",
                  file=sys.stderr)
            return 2
        try:
            results = json.loads(path.read_text())
            paths = write_reports(results, args.out_dir or path.parent)
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            print(f"torchckpt bench --from-json {path}: not a results file torchckpt bench wrote ({error!r}); "
                  "give bench/results/<name>.json", file=sys.stderr)
            return 2
    else:
        try:
            config = config_from_args(args)
        except (ValueError, TypeError) as error:
            print(f"torchckpt bench: {error}", file=sys.stderr)
            return 2
        results = run_benchmark(config, log=lambda line: print(line, flush=True),
                                after_model=lambda partial: write_reports(partial, config.out_dir))
        paths = write_reports(results, config.out_dir)
    targets = results["targets"]
    print("\ntargets (goals, see the report for the numbers):")
    for key, value in targets.items():
        print(f"  {key:<28} {'met' if value['met'] else 'NOT met'}")
    for kind, path in paths.items():
        print(f"{kind:>20}: {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``torchckpt bench``."""
    parser = subparsers.add_parser("bench", help="benchmark torchckpt's plans against every peer method; "
                                                 "writes JSON, Markdown and plots")
    parser.add_argument("--quick", action="store_true", help="tiny models, two budgets, one repetition (CI)")
    parser.add_argument("--models", type=_names, help=f"comma-separated, from {', '.join(MODELS)} "
                                                      f"(default: {','.join(FULL_MODELS)})")
    parser.add_argument("--peers", type=_names, help=f"comma-separated peer kinds (default: {','.join(PEER_KINDS)})")
    parser.add_argument("--repeats", type=int, help="timed steps per method, interleaved (default 3; quick 1)")
    parser.add_argument("--budgets", type=int, help="sweep budgets from the floor to the plain peak (default 4)")
    parser.add_argument("--warmup", type=int, help="warm-up training steps per method (default 1)")
    parser.add_argument("--threads", type=int, help="torch threads per worker (default 1: stable timings on "
                                                     "shared machines)")
    parser.add_argument("--with-compile", action="store_true",
                        help="also torch.compile with activation_memory_budget (slow on CPU)")
    parser.add_argument("--compile-budgets", type=_budgets, help="default 0.1,0.3,0.5,0.7")
    parser.add_argument("--name", help="result file name (default: bench; quick: quick)")
    parser.add_argument("--out-dir", help="where results go (default bench/results; with --from-json: its folder)")
    parser.add_argument("--from-json", help="re-write the report and plots from a results JSON; runs nothing")
    parser.add_argument("--time-cap-min", type=float, help="skip models not started by then (default 30)")
    parser.add_argument("--command-timeout-s", type=float, help="stop a worker that does not answer in time "
                                                                 "(default 900; quick 120)")
    parser.set_defaults(func=_run)
