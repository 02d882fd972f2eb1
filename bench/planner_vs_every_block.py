"""At the measured peak of "checkpoint every block", is torchckpt's plan faster? And what does planning cost?

This one-model question is now a slice of the peer benchmark (``bench/run.py``, bench/README.md):
the same harness, with only the "no checkpointing" and "every block" peers, on gpt('small') (batch
2 x 256). Results: bench/results/planner_vs_every_block.{json,md} and a PNG.

    .venv/bin/python bench/planner_vs_every_block.py [--repeats 5] [--budgets 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from run import main as run_main


def main() -> int:
    """Run ``bench/run.py`` restricted to the every-block comparison on gpt-small."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", default="5")
    parser.add_argument("--budgets", default="4")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    return run_main(["--models", "gpt-small", "--peers", "none,every_block", "--repeats", args.repeats,
                     "--budgets", args.budgets, "--name", "planner_vs_every_block", "--out-dir", args.out_dir])


if __name__ == "__main__":
    sys.exit(main())
