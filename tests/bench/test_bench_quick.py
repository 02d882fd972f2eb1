"""`python bench/run.py --quick` end to end (what CI runs so the harness cannot rot), and the harness's parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import BenchConfig, MethodSpec, chain_reason, evaluate_targets
from harness.models import QUICK_MODELS, get_model

RUN = Path(__file__).resolve().parents[2] / "bench" / "run.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, str(RUN), "--quick", "--out-dir", str(out)], check=False,
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "quick.json").read_text()), out, result


@pytest.mark.slow  # the quick benchmark (45 s); the harness's parts are tested fast in tests/bench
def test_files_are_written(quick: tuple[dict, Path, subprocess.CompletedProcess]) -> None:
    results, out, _ = quick
    assert [m["name"] for m in results["models"]] == list(QUICK_MODELS)
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"  # every results file records its commit
    for model in results["models"]:
        assert (out / f"quick-{model['name']}.png").stat().st_size > 10_000
    report = (out / "quick.md").read_text()
    assert report.count("**met**") + report.count("**not met**") == 6
    for model in results["models"]:
        assert f"### {model['name']}" in report


@pytest.mark.slow  # the quick benchmark (45 s); the harness's parts are tested fast in tests/bench
def test_every_method_is_measured_or_explained(quick: tuple[dict, Path, subprocess.CompletedProcess]) -> None:
    results, _, _ = quick
    for model in results["models"]:
        runs = {run["label"]: run for run in model["runs"]}
        peers = [run for run in model["runs"] if run["kind"] not in ("torchckpt", "compile")]
        assert [run["kind"] for run in peers] == ["none", "every_block", "sequential", "selective_op",
                                                  "dots_saveable"]
        for run in peers:
            if run["status"] == "n/a":  # only checkpoint_sequential, only on non-chain models, with the reason
                assert run["kind"] == "sequential" and "not a plain chain" in run["reason"], run
                continue
            assert run["status"] == "ok", run
            assert run["peak_bytes"] > run["baseline_bytes"] > 0 and run["peak_rss_bytes"] > run["peak_bytes"]
            assert run["step_time"]["min"] <= run["step_time"]["median"] <= run["step_time"]["max"]
        none, every = runs["no checkpointing"], runs["every block (HF)"]
        assert every["peak_bytes"] < none["peak_bytes"]  # recomputing every block lowers the measured peak
        assert none["ratio_to_none"] == 1.0
    chain = {m["name"]: m["runs"][2]["status"] for m in results["models"]}
    assert chain == {"gpt-tiny": "ok", "hf-llama-tiny": "n/a"}


@pytest.mark.slow  # the quick benchmark (45 s); the harness's parts are tested fast in tests/bench
def test_torchckpt_runs_fit_their_budgets_with_exact_gradients(
        quick: tuple[dict, Path, subprocess.CompletedProcess]) -> None:
    results, _, _ = quick
    for model in results["models"]:
        planning = model["planning"]
        assert planning["profile_s"] > 0 and planning["planning_in_steps"] > 0
        plans = [run for run in model["runs"] if run["kind"] == "torchckpt"]
        assert sum(run["label"].startswith("torchckpt sweep") for run in plans) == 2
        ran = 0
        for run in plans:
            if run["status"] != "ok":  # only a peer's peak below the planner's floor may be refused
                assert "InfeasibleBudgetError" in run["reason"], run
                assert run["budget_bytes"] < planning["floor_bytes"]
                continue
            ran += 1
            assert run["peak_bytes"] <= run["budget_bytes"], run
            assert run["predicted_peak_bytes"] <= run["budget_bytes"]
            assert run["equal"] is True, run
            # no schedule of the cost model recomputes less than the bound: the plan never beats it
            assert 0.0 <= run["lower_bound_s"] <= run["predicted_extra_time_s"] + 1e-12, run
        assert ran >= 3
    for model in results["models"]:  # every exact method computes the same gradients, bit for bit
        assert all(run["equal"] for run in model["runs"] if run["status"] == "ok"), model["name"]


@pytest.mark.slow  # the quick benchmark (45 s); the harness's parts are tested fast in tests/bench
def test_targets_are_evaluated_from_the_numbers(quick: tuple[dict, Path, subprocess.CompletedProcess]) -> None:
    results, _, _ = quick
    targets = evaluate_targets(results)
    assert targets["within_budget"]["met"] and targets["within_budget"]["count"] >= 6
    assert 0 <= targets["prediction_error"]["median"] <= targets["prediction_error"]["max"]
    assert set(targets["planning_steps"]["per_model"]) == set(QUICK_MODELS)
    bound = targets["lower_bound"]
    assert bound["count"] == sum(1 for m in results["models"] for r in m["runs"] if "predicted_extra_time_s" in r)
    assert bound["count_met"] == sum(r["met"] for r in bound["rows"]) and bound["count"] >= 6
    assert all(r["ratio"] is None or r["ratio"] >= 1.0 - 1e-9 for r in bound["rows"])
    assert targets["pareto"]["count"] == sum(1 for m in results["models"] for r in m["runs"]
                                             if r["kind"] not in ("torchckpt", "compile") and r["status"] == "ok")


def test_chain_detection_explains_non_chain_models() -> None:
    model, batch = get_model("unet-tiny").build()
    assert "input is not block 0's output" in chain_reason(model, get_model("unet-tiny").blocks(model), batch)
    model, batch = get_model("gpt-tiny").build()
    assert chain_reason(model, get_model("gpt-tiny").blocks(model), batch) is None


@pytest.mark.parametrize("options, message", [
    ({"repeats": 0}, "BenchConfig.repeats must be >= 1; got BenchConfig.repeats=0"),
    ({"models": ("gpt-huge",)}, "unknown model 'gpt-huge'"),
    ({"peers": ("every_block",)}, "always including 'none'"),
    ({"sweep_points": 1}, "sweep_points must be an int >= 2"),
])
def test_bad_options_are_explained(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BenchConfig(**options)


def test_method_spec_is_checked() -> None:
    with pytest.raises(ValueError, match="compile_budget must be in"):
        MethodSpec(kind="compile", label="c")
    with pytest.raises(ValueError, match="needs plan_path"):
        MethodSpec(kind="torchckpt", label="t")


@pytest.mark.slow  # the quick benchmark (45 s); the harness's parts are tested fast in tests/bench
def test_reports_can_be_rewritten_from_the_json(quick: tuple[dict, Path, subprocess.CompletedProcess],
                                                tmp_path: Path) -> None:
    results, out, _ = quick
    (tmp_path / "copy.json").write_text(json.dumps({**results, "name": "copy"}))
    result = subprocess.run([sys.executable, str(RUN), "--from-json", str(tmp_path / "copy.json")], check=False,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "copy.md").read_text().replace("copy", "quick") == (out / "quick.md").read_text()
