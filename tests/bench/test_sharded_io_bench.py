"""bench/sharded_io.py --quick: a tiny model through every phase and method, into a temporary file. Only the
structure of the results is checked (every method, finite positive numbers), never a timing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAVE = ("torchckpt save", "dcp.save (FileSystemWriter)", "raw write (write+fsync)")
RESTORE = ("torchckpt restore", "dcp.load (FileSystemReader) + set_state_dict",
           "raw read (page cache, into fresh memory)", "raw read (page cache, into a reused buffer)",
           "torchckpt restore less its optimizer state init (derived from the parts)")
SAVE_PARTS = ("snapshot: get_state_dict and rank-local state",
              "dcp.save: plans exchanged over gloo, write_data, results gathered",
              "of which write_data: hash + write + fsync of the shard file",
              "commit (rank 0: state.json, manifest, rename, fsync)")
RESTORE_PARTS = ("live state dicts (includes the optimizer state init)",
                 "dcp.load: plans exchanged over gloo, read_data",
                 "of which read_data: read + verify + copy into the targets",
                 "of which pread: the shards' byte ranges (and the small index)",
                 "of which preadv straight into the targets (part_reads.py)",
                 "apply into the live model and optimizer (apply_restore)")
REST = "rest: index, manifest, rank-local files, store vote, waits for the other ranks"


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow  # a benchmark's quick run; sharded save and restore are tested in tests/distributed
def test_quick_run_writes_every_method(tmp_path: Path) -> None:
    out = tmp_path / "sharded_io.json"
    # a script run, not an import: its spawned ranks find their worker functions in the script's __main__
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sharded_io.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    assert "sharded_io.py" in results["command"] and "--quick" in results["command"]
    assert [(p["kind"], p["world"]) for p in results["phases"]] == [("save", 2), ("restore", 1), ("restore", 4)]
    for phase in results["phases"]:
        names = SAVE if phase["kind"] == "save" else RESTORE
        assert set(names) <= set(phase["methods"])
        for name in names:
            row = phase["methods"][name]
            assert len(row["bytes_per_rank"]) == phase["world"]
            assert all(_positive(b) for b in row["bytes_per_rank"])
            for key in ("seconds", "mb_per_s"):
                assert all(_positive(row[key][stat]) for stat in ("median", "min", "max"))
        # every timed part of torchckpt's save / restore was found where the script looks for it
        parts = phase["torchckpt_parts"]
        assert set(parts) == {*(SAVE_PARTS if phase["kind"] == "save" else RESTORE_PARTS), REST}
        reads = [label for label in parts if "pread" in label]  # one of the two read paths may not be taken
        assert all(_positive(part["median"]) for label, part in parts.items() if label != REST and label not in reads)
        assert _positive(sum(parts[label]["median"] for label in reads)) or phase["kind"] == "save"
        if phase["kind"] == "restore":
            assert phase["restored_equal"] is True
    assert len(results["targets"]) == 3 and len(results["reference_ratios"]) == 1 + 3 * 2
    for target in results["targets"] + results["reference_ratios"]:
        assert _positive(target["ratio"]["worst_rank"]) and isinstance(target["ratio"]["met"], bool)
    assert "torchckpt save" in done.stdout and "| target |" in done.stdout
