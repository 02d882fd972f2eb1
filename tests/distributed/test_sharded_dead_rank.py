"""A rank SIGKILLed during a sharded save: no step is committed, every survivor raises an error naming the
missing rank within the timeout (never hangs), and the restarted job resumes from the last committed step.
``bench/sharded_kill_soak.py`` runs the same harness with more trials and random kill points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .sharded_workers import kill_worker, resume_worker, run_processes

TIMEOUT_S = 15.0


@pytest.mark.parametrize(("victim", "point"), [(2, "before-write"), (1, "after-write"), (1, "vote"), (0, "commit")])
def test_a_killed_rank_leaves_no_step_and_is_named(tmp_path: Path, victim: int, point: str) -> None:
    directory = str(tmp_path / "ckpt")
    out = tmp_path / "kill"
    out.mkdir()
    codes = run_processes(kill_worker, 3, directory, victim, point, TIMEOUT_S, out_dir=str(out),
                          deadline_s=3 * TIMEOUT_S + 60)
    assert codes[victim] == -9
    assert all(code == 0 for rank, code in enumerate(codes) if rank != victim), codes  # none hung
    for rank in range(3):
        if rank == victim:
            continue
        result = json.loads((out / f"{rank}.json").read_text())
        assert result["error"] is not None, result
        assert f"[{victim}]" in result["message"] or f"rank {victim} " in result["message"], result
        assert result["seconds"] < 2 * TIMEOUT_S + 15, result
    assert sorted(p.name for p in Path(directory).glob("step-*")) == ["step-000000001"]
    resumed = tmp_path / "resume"
    resumed.mkdir()
    assert run_processes(resume_worker, 3, directory, out_dir=str(resumed), deadline_s=120) == [0, 0, 0]
    assert [json.loads((resumed / f"{r}.json").read_text())["step"] for r in range(3)] == [1, 1, 1]
    assert not list(Path(directory).glob(".tmp-*"))  # rank 0 cleaned the killed save's temp directory
