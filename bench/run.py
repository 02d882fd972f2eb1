"""The peer benchmark: every method on every benchmark model, each in its own process; report and plots.

Run from a source checkout (``make bench`` runs it; bench/README.md)::

    python bench/run.py --quick                 # what CI runs: tiny models, two budgets (minutes)
    python bench/run.py                         # the full suite (~30 min on a 2-core CPU)
    python bench/run.py --from-json bench/results/bench.json   # re-write the report and plots only

Writes ``<out-dir>/<name>.json`` (raw), ``<name>.md`` (tables and the targets' verdicts) and one PNG per
model. The targets are goals: the command exits 0 whether or not they are met (2 for bad options).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.harness import BenchConfig
from harness.methods import PEER_KINDS
from harness.models import FULL_MODELS, MODELS


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
    from harness.harness import run_benchmark
    from harness.report import write_reports

    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            print(f"bench/run.py --from-json {path}: no such file; give a <name>.json that bench/run.py wrote",
                  file=sys.stderr)
            return 2
        try:
            results = json.loads(path.read_text())
            paths = write_reports(results, args.out_dir or path.parent)
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            print(f"bench/run.py --from-json {path}: not a results file bench/run.py wrote ({error!r}); "
                  "give bench/results/<name>.json", file=sys.stderr)
            return 2
    else:
        try:
            config = config_from_args(args)
        except (ValueError, TypeError) as error:
            print(f"bench/run.py: {error}", file=sys.stderr)
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


def build_parser() -> argparse.ArgumentParser:
    """The options (those of the former ``torchckpt bench``).

    Example:
        >>> build_parser().parse_args(["--quick", "--models", "gpt-tiny"]).models
        ('gpt-tiny',)
    """
    parser = argparse.ArgumentParser(prog="python bench/run.py", description="benchmark torchckpt's plans against "
                                     "every peer method; writes JSON, Markdown and plots")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or re-write a report with ``--from-json``); returns the exit code."""
    return _run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
