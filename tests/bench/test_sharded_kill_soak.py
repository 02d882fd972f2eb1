"""bench/state/sharded_kill_soak.py runs as bench/README.md shows it, here with one trial (rank 0 SIGKILLed just
before its commit, the quickest point) and writes its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the same kill harness at one point: tests/distributed/test_sharded_dead_rank.py
def test_one_trial_passes_and_is_recorded(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "state" / "sharded_kill_soak.py"), "--trials", "1",
                           "--seed", "0", "--timeout-s", "10", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 trials, 0 with violations" in done.stdout
    results = json.loads((tmp_path / "sharded_kill_soak.json").read_text())
    assert results["violations"] == 0 and results["results"][0]["point"] == "commit"
    assert results["results"][0]["violations"] == [] and results["commit"]
