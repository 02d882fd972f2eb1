"""Kill -9 soak: many more trials than CI's 50 (same harness as tests/state/test_state_kill9.py).

Usage: .venv/bin/python bench/state/kill9_soak.py [--trials 300] [--seed 1]

Each trial forks a writer that trains and saves every step, kills it with SIGKILL at a
random moment, then one fresh process checks every trial directory: every committed step
passes full verification, restore picks the newest one, and it is bitwise equal to a
recomputed reference. Prints a summary; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "state"))
from state_workers import run_kill_trials


def _violations(report: dict) -> list[str]:
    problems = []
    if not report["killed_by_sigkill"]:
        problems.append("writer was not killed by SIGKILL")
    if report["invalid"]:
        problems.append(f"invalid committed steps: {report['invalid']}")
    if report["steps"] and (report["restored"] != max(report["steps"]) or report["equal"] is not True):
        problems.append(f"restored {report['restored']} (equal={report['equal']}) of {report['steps']}")
    if not report["steps"] and report["restored"] is not None:
        problems.append("restored a step from a directory with none")
    if not report["cleaned"]:
        problems.append("leftovers not cleaned")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-delay-s", type=float, default=0.8)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="torchckpt-kill9-") as base:
        reports = run_kill_trials(base, args.trials, args.seed, args.max_delay_s)
    bad = [(r["run_dir"], p) for r in reports for p in _violations(r)]
    mid_save = sum(1 for r in reports if r["leftover_tmp"])
    committed = sum(1 for r in reports if r["steps"])
    print(f"{len(reports)} trials in {time.perf_counter() - start:.0f} s: {mid_save} killed during a save's "
          f"write, {committed} had committed steps, {len(bad)} violations")
    for run_dir, problem in bad[:20]:
        print(f"  {run_dir}: {problem}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
