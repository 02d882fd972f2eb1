"""A rank SIGKILLed during a sharded save: no step is committed, every survivor raises an error naming the
missing rank within the timeout (never hangs), and the restarted job resumes from the last committed step.
Four trials here, one per kill point; ``bench/state/sharded_kill_soak.py`` runs the same harness with random
points and victims (``--trials 20`` and more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .sharded_workers import dead_rank_trial, failing_worker

TIMEOUT_S = 15.0


# One kill point in the fast tier (rank 0 at the commit); the others (and bench/state/sharded_kill_soak.py's
# random ones) in the slow tier.
@pytest.mark.parametrize(("victim", "point"), [pytest.param(2, "before-write", marks=pytest.mark.slow),
                                               pytest.param(1, "after-write", marks=pytest.mark.slow),
                                               pytest.param(1, "vote", marks=pytest.mark.slow), (0, "commit")])
def test_a_killed_rank_leaves_no_step_and_is_named(tmp_path: Path, victim: int, point: str) -> None:
    assert dead_rank_trial(str(tmp_path), victim, point, TIMEOUT_S) == []


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank_at_once(spawn_ranks, tmp_path: Path,
                                                                        failing: int) -> None:
    results = spawn_ranks(failing_worker, 2, str(tmp_path / "ckpt"), failing)
    for result in results:
        assert result["error"] is not None and "No space left on device (injected)" in result["message"], result
        assert result["seconds"] < 20, result  # not the 60 s timeout: the failure is voted at once
        assert result["steps"] == [1]
