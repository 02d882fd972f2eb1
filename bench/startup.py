"""Start-up time: ``import torchckpt``, its public names, and ``torchckpt --help``, against ``import torch``.

Each case runs in a fresh Python process (``sys.executable -c ...``, the same environment), the cases
interleaved round by round so that a change in the machine's load touches them all alike; the median of the
rounds per case, its min-max, and the ratio and difference of each median to ``import torch``'s.

Targets (issue 32): ``import torchckpt`` <= ``import torch`` + 0.3 s; ``torchckpt --help`` <= 1.5 s.

    .venv/bin/python bench/startup.py                # 5 rounds, ~1 minute on 2 CPU cores
    .venv/bin/python bench/startup.py --rounds 1 --out-dir /tmp/x   # what tests/test_startup.py runs
    git archive 76b7739 src | tar -x -C /tmp/before     # an earlier commit's source, timed the same way:
    .venv/bin/python bench/startup.py --src /tmp/before/src --src-commit 76b7739 --name startup-before-76b7739.json

Results: ``bench/results/startup.json`` (commit, machine, load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness.provenance import run_record, write_results

RESULTS = Path(__file__).parent / "results"

# case -> the program a fresh interpreter runs
CASES: dict[str, str] = {
    "python": "pass",
    "import torch": "import torch",
    "import torchckpt": "import torchckpt",
    "torchckpt, every public name": "import torchckpt\nfor name in torchckpt.__all__: getattr(torchckpt, name)",
    "torchckpt --help": "import sys\nfrom torchckpt.cli.main import main\nsys.argv = ['torchckpt', '--help']\n"
                        "main()",
}


def time_once(program: str, env: dict[str, str] | None = None) -> float:
    """Wall seconds of ``python -c program`` in a fresh process (it must succeed).

    Example:
        >>> 0 < time_once("pass") < 60
        True
    """
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", program], check=True, capture_output=True, timeout=300, env=env)
    return time.perf_counter() - start


def measure(rounds: int, env: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Each case's median, min and max over ``rounds`` interleaved rounds, and its median's ratio and
    difference to ``import torch``'s.

    Example:
        >>> sorted(measure(1)["import torch"])  # doctest: +SKIP
        ['max_s', 'median_s', 'min_s', 'minus_torch_s', 'ratio_to_torch']
    """
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(rounds):
        for case, program in CASES.items():
            times[case].append(time_once(program, env))
    torch_s = statistics.median(times["import torch"])
    return {case: {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
                   "ratio_to_torch": statistics.median(seconds) / torch_s,
                   "minus_torch_s": statistics.median(seconds) - torch_s} for case, seconds in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--name", default="startup.json", help="results file name")
    parser.add_argument("--src", default=None, help="time the torchckpt in this src folder (PYTHONPATH)")
    parser.add_argument("--src-commit", default=None, help="the commit --src was taken from (recorded)")
    args = parser.parse_args(argv)
    src = str(Path(args.src).resolve()) if args.src else str(Path(__file__).resolve().parents[1] / "src")
    record = run_record(Path(__file__).parent, rounds=args.rounds, python=sys.executable, src=src)
    if args.src_commit:
        record["commit"] = args.src_commit
    cases = measure(args.rounds, env={**os.environ, "PYTHONPATH": src})
    record["cases"] = cases
    record["targets"] = {
        "import torchckpt <= import torch + 0.3 s": cases["import torchckpt"]["minus_torch_s"] <= 0.3,
        "torchckpt --help <= 1.5 s": cases["torchckpt --help"]["median_s"] <= 1.5,
    }
    path = write_results(record, args.out_dir, args.name)
    for case, row in cases.items():
        print(f"{case:30s} median {row['median_s']:.2f} s (min {row['min_s']:.2f}, max {row['max_s']:.2f}); "
              f"{row['ratio_to_torch']:.2f}x import torch, {row['minus_torch_s']:+.2f} s")
    for target, met in record["targets"].items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
