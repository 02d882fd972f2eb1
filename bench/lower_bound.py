"""How far from the model's optimum are plans? Predicted extra time vs the fractional-knapsack lower bound.

For each model: profile once (with AdamW, as ``bench/run.py`` does), then for each budget solve and
compute ``solve.recompute_lower_bound`` (docs/planner_solver.md, "A lower bound"): no schedule of the
cost model has less extra time. Budgets: a sweep from the floor to no checkpointing's predicted peak,
plus the peers' measured peaks from an earlier ``bench/run.py`` results file when given. Nothing is
timed but the profile, so this runs in minutes where the full benchmark runs in half an hour.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python bench/lower_bound.py \\
        --models gpt-small-8x512,hf-llama-8x256,hf-gpt2-8x256,hf-vit-224,unet-small-b8 \\
        --budgets 8 --peers-from bench/results/regime.json

Writes bench/results/lower_bound.json (``--out``) with the commit it ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from harness.models import REGIME_MODELS
from harness.provenance import run_record, write_results
from harness.report import BOUND_TARGET, bound_rows
from harness.worker import make_plans


def _peer_peaks(path: str | None, model: str) -> dict[str, int]:
    if not path:
        return {}
    results = json.loads(Path(path).read_text())
    for entry in results.get("models", []):
        if entry["name"] == model:
            return {f"at {run['label']} peak": int(run["peak_bytes"]) for run in entry.get("runs", [])
                    if run["kind"] not in ("torchckpt", "compile") and run.get("peak_bytes") is not None}
    return {}


def main(argv: list[str] | None = None) -> int:
    """Profile, plan and bound each model; print one line per budget; write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(REGIME_MODELS))
    parser.add_argument("--budgets", type=int, default=8, help="sweep points from the floor to the plain peak")
    parser.add_argument("--peers-from", default=None, help="a bench/run.py results JSON: add its peers' peaks")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "lower_bound.json"))
    args = parser.parse_args(argv)
    if args.budgets < 2:
        parser.error(f"--budgets must be at least 2 (the floor and the plain peak); got {args.budgets}")
    results = run_record(Path(__file__).parent, models=args.models.split(","), sweep_points=args.budgets,
                         peers_from=args.peers_from, target=BOUND_TARGET)
    entries = []
    for name in results["models"]:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            made = make_plans(name, _peer_peaks(args.peers_from, name), args.budgets, folder)
        runs = [{**item, "kind": "torchckpt", "label": f"torchckpt {item['label']}"} for item in made["plans"]]
        rows = bound_rows([{"name": name, "runs": runs}])
        for row in rows:
            print(f"{name:18s} {row['plan'][10:]:34s} budget {row['budget_bytes'] / 2**20:9.1f} MiB  {row['detail']}")
        errors = [f"{item['label']}: {item['error']}" for item in made["plans"] if "error" in item]
        entries.append({"name": name, "profile_s": made["profile_s"], "floor_bytes": made["floor_bytes"],
                        "plain_predicted_peak_bytes": made["plain_predicted_peak_bytes"], "rows": rows,
                        "refused": errors, "wall_s": time.perf_counter() - start})
    rows = [row for entry in entries for row in entry["rows"]]
    ratios = [row["ratio"] for row in rows if row["ratio"] is not None]
    results.update(models=entries, count=len(rows), count_met=sum(row["met"] for row in rows),
                   worst_ratio=max(ratios, default=None))
    out = Path(args.out)
    path = write_results(results, out.parent, out.name)
    print(f"within {BOUND_TARGET}x of the bound: {results['count_met']} of {results['count']} plans, worst "
          f"{results['worst_ratio']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
