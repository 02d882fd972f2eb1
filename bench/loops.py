"""Memory vs time of a long RNN-style recurrence: plain loop, checkpoint_sequential, checkpointed_loop.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/loops.py                # 10,000 steps, ~3 min on 2 cores
    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/loops.py --steps 2000   # quicker

Each method runs forward + backward of ``h = tanh(W h + U x_t)`` over ``--steps`` steps. Peak memory is
the exact live tensor bytes above the entry baseline (``MemoryMeter`` on CPU), taken in one run; time
is the best of ``--repeats`` separate runs without the meter (its dispatch mode slows every op).
Timing is reported as a ratio to the plain loop measured in the same process
(Note: [timing is never asserted]).
Writes ``loops.md`` (table), ``loops.json`` and ``loops.png`` (memory vs time) under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from torchckpt.loops.revolve import optimal_step_evaluations
from torchckpt.loops.runner import LoopStats, checkpointed_loop
from torchckpt.memory import MemoryMeter


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    steps: int
    batch: int
    hidden: int

    @property
    def carry_bytes(self) -> int:
        return self.batch * self.hidden * 4


class Cell(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w = nn.Linear(hidden, hidden)
        self.u = nn.Linear(hidden, hidden, bias=False)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.w(h) + self.u(x))


@dataclasses.dataclass(frozen=True)
class Row:
    method: str
    peak_bytes: int
    time_s: float
    step_evaluations: int


def build(problem: Problem) -> tuple[Cell, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cell = Cell(problem.hidden)
    xs = torch.randn(problem.steps, problem.batch, problem.hidden)
    h0 = torch.zeros(problem.batch, problem.hidden)
    return cell, xs, h0


def run_plain(cell: Cell, xs: torch.Tensor, h0: torch.Tensor) -> int:
    h = h0
    for t in range(xs.shape[0]):
        h = cell(h, xs[t])
    h.square().sum().backward()
    return xs.shape[0]


def run_sequential(cell: Cell, xs: torch.Tensor, h0: torch.Tensor) -> int:
    steps = xs.shape[0]
    segments = max(1, round(math.sqrt(steps)))
    functions = [_bound_step(cell, xs[t]) for t in range(steps)]
    h = checkpoint_sequential(functions, segments, h0, use_reentrant=False)
    h.square().sum().backward()
    last_segment = steps - (steps // segments) * (segments - 1)
    return 2 * steps - last_segment  # every segment but the last is recomputed once


def _bound_step(cell: Cell, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda h: cell(h, x)


def run_revolve(cell: Cell, xs: torch.Tensor, h0: torch.Tensor, checkpoints: int) -> int:
    def step(carry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, t = carry
        return cell(h, xs[t]), t + 1

    stats = LoopStats()
    h, _ = checkpointed_loop(step, (h0, torch.zeros((), dtype=torch.int64)), steps=xs.shape[0],
                             checkpoints=checkpoints, stats=stats)
    h.square().sum().backward()
    return stats.step_evaluations


def measure(run: Callable[[Cell, torch.Tensor, torch.Tensor], int], problem: Problem, repeats: int,
            method: str) -> Row:
    cell, xs, h0 = build(problem)
    gc.collect()
    with MemoryMeter() as meter:
        base = meter.current_bytes
        evaluations = run(cell, xs, h0)
        peak = meter.peak_bytes - base
    best = math.inf
    for _ in range(repeats):
        cell.zero_grad(set_to_none=True)
        gc.collect()
        start = time.perf_counter()
        run(cell, xs, h0)
        best = min(best, time.perf_counter() - start)
    return Row(method, peak, best, evaluations)


def table(rows: list[Row], problem: Problem) -> str:
    plain = rows[0]
    lines = [
        (
            f"{problem.steps} steps, batch {problem.batch}, hidden {problem.hidden}: one carry = "
            f"{problem.carry_bytes / 1024:.0f} KiB; forward + backward; {torch.get_num_threads()} intra-op thread(s)."
        ),
        "",
        "| method | peak MiB | x plain | carries | time s | x plain | step evals |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.method} | {row.peak_bytes / 2**20:.1f} | {row.peak_bytes / plain.peak_bytes:.3f} | "
            f"{row.peak_bytes / problem.carry_bytes:.0f} | {row.time_s:.2f} | {row.time_s / plain.time_s:.2f} | "
            f"{row.step_evaluations} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], problem: Problem, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.scatter(row.time_s, row.peak_bytes / 2**20)
        ax.annotate(row.method, (row.time_s, row.peak_bytes / 2**20), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("forward + backward time (s)")
    ax.set_ylabel("peak live tensor memory (MiB)")
    ax.set_yscale("log")
    ax.set_title(f"{problem.steps}-step recurrence: memory vs time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[10, 40, 100, 400])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; ops here are tiny, and more threads mostly add contention")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    problem = Problem(steps=args.steps, batch=args.batch, hidden=args.hidden)
    segments = max(1, round(math.sqrt(problem.steps)))
    methods: list[tuple[str, Callable[[Cell, torch.Tensor, torch.Tensor], int]]] = [
        ("plain loop", run_plain),
        (f"checkpoint_sequential, {segments} segments", run_sequential),
    ]
    for count in args.checkpoints:
        methods.append((f"checkpointed_loop, {count} checkpoints",
                        lambda c, x, h, count=count: run_revolve(c, x, h, count)))
    rows = []
    for name, run in methods:
        rows.append(measure(run, problem, args.repeats, name))
        print(f"{name}: {rows[-1].peak_bytes / 2**20:.1f} MiB, {rows[-1].time_s:.2f} s", flush=True)
    for row, count in zip(rows[2:], args.checkpoints):
        assert row.step_evaluations == optimal_step_evaluations(problem.steps, count), row
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(rows, problem)
    (args.out / "loops.md").write_text(text)
    (args.out / "loops.json").write_text(json.dumps(
        {"problem": dataclasses.asdict(problem), "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    plot(rows, problem, args.out / "loops.png")
    print(text)


if __name__ == "__main__":
    main()
