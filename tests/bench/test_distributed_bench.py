"""bench/distributed.py: its summary and table from a results file, and docs/distributed.md shows the table of
the committed results (bench/results/distributed.json) as that file gives it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("bench_distributed", ROOT / "bench" / "distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_the_committed_results_table() -> None:
    results = json.loads((ROOT / "bench" / "results" / "distributed.json").read_text())
    table = _script().results_table(results)
    page = (ROOT / "docs" / "distributed.md").read_text()
    assert table in page
    assert f"Commit {results['commit'][:7]}" in page


def test_the_committed_results_meet_the_targets() -> None:
    results = json.loads((ROOT / "bench" / "results" / "distributed.json").read_text())
    assert len(results["commit"]) == 40 and results["all_met"] is True
    kinds = {(run["kind"], run["model"], run["world"]) for run in results["runs"]}
    for model in ("gpt-small", "hf-llama"):  # the runs: FSDP2 on 2 and 4 processes at 4 budgets each
        assert {("fsdp", model, 2), ("fsdp", model, 4)} <= kinds
    for run in results["runs"]:
        assert len(run["ranks"]) == run["world"]
        assert len(run["ranks"][0]["plans"]) >= (4 if run["kind"] == "fsdp" else 2)
        summary = _script().summarize(run["ranks"])  # recomputed from the per-process records, not trusted
        assert summary == run["summary"]
        assert summary["within_budget"] and summary["exact"] and summary["median_abs_error"] <= 0.05


@pytest.mark.parametrize(("run", "words"), [("zero:gpt-tiny:2:2", "kind one of"), ("fsdp:gpt-tiny:x:2", "integers")])
def test_a_bad_run_is_named(run: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _script().main(["--run", run])
    assert words in capsys.readouterr().err
