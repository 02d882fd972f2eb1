"""What showing progress costs: planning and a save + restore, with the CLI's reporter on and with nobody listening.

The library reports long work (``torchckpt/_progress.py``) per phase, per block's forward pass in the measured
profiling steps, and per 16 MiB piece of a save or restore. This times, in one process and interleaved round by
round (off, on, on, off, ...), ``torchckpt.profile`` on a GPT and a ``Checkpointer`` save + restore of a model's
weights, each with nobody listening and with the ``Status`` the commands install (plain lines, to /dev/null);
the median of the rounds per case, its min-max, and the ratio of the medians (on / off). It also records the
profile's own timed steps (``step_time_s``, ``every_block_step_time_s``) both ways: no reporting runs inside them.

    .venv/bin/python bench/progress_overhead.py              # gpt('mini') 8 x 256, 512 MiB of weights, 7 rounds
    .venv/bin/python bench/progress_overhead.py --quick      # seconds (tiny sizes, 2 rounds)

Results: ``bench/results/progress_overhead.json`` (commit, machine, load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def _listening(on: bool, out: Any) -> Any:
    from contextlib import nullcontext

    from torchckpt.train.status import reported

    return reported("bench", live=False, stream=out) if on else nullcontext()


def _profile_case(size: str, batch_size: int, seq_len: int) -> Callable[[bool, Any], dict[str, float]]:
    from torchckpt.models import gpt
    from torchckpt.planner import profile

    model = gpt(size)
    batch = model.example_batch(batch_size=batch_size, seq_len=seq_len)

    def run(on: bool, out: Any) -> dict[str, float]:
        with _listening(on, out):
            start = time.perf_counter()
            costs = profile(model, batch)
            wall_s = time.perf_counter() - start
        return {"wall_s": wall_s, "step_time_s": costs.step_time_s,
                "every_block_step_time_s": costs.every_block_step_time_s}

    return run


def _state_case(megabytes: int, folder: str) -> Callable[[bool, Any], dict[str, float]]:
    import torch

    from torchckpt import Checkpointer

    model = torch.nn.Linear(1024, megabytes * 256)  # 4 KiB per output feature: megabytes MiB of weights
    steps = iter(range(1, 10**6))

    def run(on: bool, out: Any) -> dict[str, float]:
        with _listening(on, out), Checkpointer(folder, keep_last=1) as checkpointer:
            start = time.perf_counter()
            checkpointer.save(next(steps), model=model)
            checkpointer.restore(model=model)
            return {"wall_s": time.perf_counter() - start}

    return run


def measure(cases: dict[str, Callable[[bool, Any], dict[str, float]]], rounds: int) -> dict[str, Any]:
    """Each case off and on, interleaved (the order flips every round): per figure, median, min and max, and the
    ratio of the wall-time medians (on / off)."""
    seen: dict[str, dict[str, dict[str, list[float]]]] = {
        case: {"off": {}, "on": {}} for case in cases}
    with open(os.devnull, "w") as out:
        for round_index in range(rounds):
            for case, run in cases.items():
                for mode in (("off", "on") if round_index % 2 == 0 else ("on", "off")):
                    for figure, value in run(mode == "on", out).items():
                        seen[case][mode].setdefault(figure, []).append(value)
                print(f"round {round_index + 1}/{rounds}: {case} done", flush=True)
    results: dict[str, Any] = {}
    for case, modes in seen.items():
        row: dict[str, Any] = {}
        for mode, figures in modes.items():
            row[mode] = {figure: {"median": statistics.median(values), "min": min(values), "max": max(values)}
                         for figure, values in figures.items()}
        row["wall_ratio_on_off"] = row["on"]["wall_s"]["median"] / row["off"]["wall_s"]["median"]
        results[case] = row
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (quick: 2)")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--name", default="progress_overhead.json", help="results file name")
    args = parser.parse_args(argv)
    import torch  # after the options: --help starts in a moment

    from harness.provenance import run_record, write_results

    rounds = args.rounds or (2 if args.quick else 7)
    gpt_size, batch_size, seq_len, megabytes = ("tiny", 2, 32, 20) if args.quick else ("mini", 8, 256, 512)
    torch.set_num_threads(1)
    record = run_record(Path(__file__).parent, rounds=rounds, threads=1, profile=f"gpt('{gpt_size}') "
                        f"{batch_size} x {seq_len}", state=f"{megabytes} MiB of weights (one nn.Linear)")
    with tempfile.TemporaryDirectory() as folder:
        cases = {"profile": _profile_case(gpt_size, batch_size, seq_len),
                 "save + restore": _state_case(megabytes, folder)}
        record["cases"] = measure(cases, rounds)
    path = write_results(record, args.out_dir, args.name)
    for case, row in record["cases"].items():
        off, on = row["off"]["wall_s"], row["on"]["wall_s"]
        print(f"{case:16s} off {off['median']:.3f} s ({off['min']:.3f}-{off['max']:.3f}), on {on['median']:.3f} s "
              f"({on['min']:.3f}-{on['max']:.3f}): {row['wall_ratio_on_off']:.3f}x")
        if "step_time_s" in row["on"]:
            print(f"{'':16s} its timed plain step: off {row['off']['step_time_s']['median']:.4f} s, "
                  f"on {row['on']['step_time_s']['median']:.4f} s")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
