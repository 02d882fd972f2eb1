"""``bench/executor_overhead.py --quick`` runs end to end: every method timed, each pair's gradients
bitwise equal (same decisions through torchckpt and by hand with torch's API), the results file written
with its commit. Times are reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_writes_every_method_and_bitwise_pairs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "executor_overhead.py"), "--quick", "--out",
                           str(tmp_path)], cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "executor_overhead.json").read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    assert [row["model"] for row in results["models"]] == ["gpt", "vit"]
    for row in results["models"]:
        assert set(row["methods"]) == {"none", "torch: every block", "torchckpt: nothing_saveable",
                                       "torch SAC: dots", "torchckpt: dots_saveable"}
        assert all(method["steps"] == 2 and method["median_s"] > 0 for method in row["methods"].values())
        assert [pair["gradients_bitwise_equal"] for pair in row["pairs"]] == [True, True]
        for pair in row["pairs"]:
            ours, theirs = row["methods"][pair["torchckpt"]], row["methods"][pair["torch"]]
            assert pair["ratio"] == ours["median_s"] / theirs["median_s"]


def test_unknown_model_is_refused_naming_the_choices() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "executor_overhead.py"), "--models", "resnet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "choose from gpt, vit" in done.stderr
