"""Dead-rank soak for sharded saves: many trials of tests/distributed/test_sharded_dead_rank.py's harness.

Usage: .venv/bin/python bench/state/sharded_kill_soak.py [--trials 20] [--seed 1] [--timeout-s 15]
       [--out bench/results]   (writes sharded_kill_soak.json there)

Each trial starts 3 gloo ranks that save step 1 of an FSDP2 model, then SIGKILLs one rank (random) at a
random point of saving step 2 (before or after writing its shard, at its vote, or rank 0 just before the
commit). A trial passes when the killed save committed nothing, every survivor raised an error naming the
killed rank within the timeout and exited, and a restarted job resumed from step 1 on every rank. Prints a
summary and writes the results; exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "distributed"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/: the harness package
from sharded_workers import KILL_POINTS, dead_rank_trial

from harness.provenance import run_record, write_results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=15.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    record = run_record(command=" ".join(sys.argv), trials=args.trials, seed=args.seed, timeout_s=args.timeout_s)
    trials = []
    for number in range(args.trials):
        point = rng.choice(KILL_POINTS)
        victim = 0 if point == "commit" else rng.randrange(3)
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as root:
            problems = dead_rank_trial(root, victim, point, args.timeout_s)
        seconds = time.monotonic() - start
        trials.append({"victim": victim, "point": point, "violations": problems, "seconds": round(seconds, 1)})
        print(f"trial {number + 1}/{args.trials}: rank {victim} killed at {point}: "
              f"{'ok' if not problems else problems} ({seconds:.0f} s)", flush=True)
    failed = [trial for trial in trials if trial["violations"]]
    print(f"{len(trials)} trials, {len(failed)} with violations")
    if args.out:
        seconds = sorted(trial["seconds"] for trial in trials)
        write_results({**record, "results": trials, "violations": len(failed),
                       "trial_seconds_median": seconds[len(seconds) // 2]}, args.out, "sharded_kill_soak.json")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
