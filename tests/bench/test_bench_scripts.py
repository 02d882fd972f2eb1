"""The benchmark scripts whose runs are in the slow tier still start, and what they look up still exists.

``bench/sharded_io.py`` times parts of a save and a restore by wrapping functions it names by module and
attribute (newest layout first, older commits after): a renamed module would make a part silently read zero,
so the first name of every part must resolve on this commit.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _resolves(module: str, attribute: str) -> bool:
    target: object = importlib.import_module(module)
    for name in attribute.split("."):
        if not hasattr(target, name):
            return False
        target = getattr(target, name)
    return callable(target)


def test_sharded_io_times_parts_that_exist() -> None:
    import sharded_io  # bench/ is on sys.path (tests/conftest.py)

    parts = {**sharded_io.SAVE_PARTS, **sharded_io.RESTORE_PARTS}
    assert len(parts) >= 6
    missing = [(label, where[0]) for label, where in parts.items() if not _resolves(*where[0])]
    assert missing == []
    assert not _resolves("torchckpt.state.sharded", "_no_such_function")  # the check can fail


@pytest.mark.parametrize("script", ["state/sharded_kill_soak.py", "compiled.py", "sharded_io.py",
                                    "state/kill9_soak.py", "progress_overhead.py"])
def test_script_starts(script: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow  # two rounds of a tiny profile and a 20 MiB save + restore each way (~30 s on 2 busy cores)
def test_progress_overhead_quick_writes_both_modes(tmp_path: Path) -> None:
    import json

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "progress_overhead.py"), "--quick", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cases = json.loads((tmp_path / "progress_overhead.json").read_text())["cases"]
    assert sorted(cases) == ["profile", "save + restore"]
    for row in cases.values():
        assert row["on"]["wall_s"]["median"] > 0 and row["off"]["wall_s"]["median"] > 0
    assert set(cases["profile"]["on"]) == {"wall_s", "step_time_s", "every_block_step_time_s"}


def test_state_throughput_small_run_records_every_issue_29_ratio(tmp_path: Path) -> None:
    """docs/state.md's command for the issue-29 ratios (bench/state/bench_throughput.py), at 8 MB and one repeat
    (~6 s): it writes every ratio it reports, each with its value and target."""
    import json

    out = tmp_path / "throughput.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "state" / "bench_throughput.py"), "--mb", "8",
                           "--repeats", "1", "--methods", "raw,torch,torchckpt", "--tiny", "1000", "--dir",
                           str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ratios = {row["ratio"]: row for row in json.loads(out.read_text())["against_torch"]}
    assert {"restore verify=full / torch.load (time)", "sync save / torch.save (time)",
            "tiny tensors: restore / torch.load (time)"} <= set(ratios), sorted(ratios)
    assert all(row["value"] == row["value"] and row["target"] for row in ratios.values()), ratios  # no NaN
