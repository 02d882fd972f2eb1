"""``bench/compiled.py --quick`` runs end to end: compile's peak measured at each ``activation_memory_budget``, a
torchckpt plan at that peak measured compiled within it, gradients close to compiled no-checkpointing, every
method timed, the results file written with its commit. Times are reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # plans under compile within budget: tests/executor/test_compiled.py
def test_quick_run_plans_at_compiles_peaks_within_them(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "compiled.py"), "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "compiled.json").read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    body = results["results"]
    assert [row["fraction"] for row in body["budgets"]] == [1.0, 0.0]
    planned = [row for row in body["budgets"] if "torchckpt_peak_bytes" in row]
    assert planned, body["budgets"]  # at least compile's default peak admits a plan
    for row in planned:
        assert row["within_budget"] and row["torchckpt_peak_bytes"] <= row["compile_peak_bytes"]
        assert row["torchckpt_max_grad_diff_vs_none"] < 1e-5
        ours = body["timed"][f"torchckpt at compile {row['fraction']:g}"]
        theirs = body["timed"][f"compile {row['fraction']:g}"]
        assert row["ratio"] == ours["median_s"] / theirs["median_s"]
    assert all(method["steps"] == 2 and method["median_s"] > 0 for method in body["timed"].values())


def test_a_fraction_outside_zero_one_is_refused() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "compiled.py"), "--fractions", "1.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "every value must be in [0, 1]" in done.stderr
