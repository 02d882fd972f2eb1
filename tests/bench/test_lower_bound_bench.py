"""bench/lower_bound.py: plans against the fractional-knapsack bound, on a tiny model, into a temporary file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "lower_bound.py"


def _script():  # noqa: ANN202 - a module loaded from a path
    spec = importlib.util.spec_from_file_location("bench_lower_bound", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_writes_each_budget_with_its_bound(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "lb.json"
    assert _script().main(["--models", "gpt-tiny", "--budgets", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    (model,) = results["models"]
    assert model["name"] == "gpt-tiny" and len(model["rows"]) == 4 and not model["refused"]
    budgets = [row["budget_bytes"] for row in model["rows"]]
    assert budgets == sorted(budgets) and budgets[0] == model["floor_bytes"]
    for row in model["rows"]:
        assert 0.0 <= row["lower_bound_s"] <= row["predicted_extra_s"] + 1e-12
    assert model["rows"][-1]["detail"] == "recomputes nothing"  # the sweep ends at no checkpointing's peak
    assert results["count"] == 4 and results["count_met"] == sum(row["met"] for row in model["rows"])
    assert "gpt-tiny" in capsys.readouterr().out


def test_too_few_budgets_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _script().main(["--models", "gpt-tiny", "--budgets", "1", "--out", "/nonexistent/x.json"])
    assert "--budgets must be at least 2" in capsys.readouterr().err
