"""Python examples in docs/ run as written (in a temporary directory)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("page", ["planner.md", pytest.param("loops.md", marks=pytest.mark.slow), "train.md", "hf.md"])
def test_first_python_example_runs(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    block = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.DOTALL)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    threads = torch.get_num_threads()
    try:
        exec(compile(block, str(DOCS / page), "exec"), namespace)  # noqa: S102 - our own docs
    finally:
        torch.set_num_threads(threads)  # train.md's example sets --threads 1
    if page == "planner.md":
        assert namespace["report"].within_budget and namespace["report"].gradients_equal
        assert (tmp_path / "frontier.png").stat().st_size > 0
    elif page == "train.md":
        assert namespace["summary"]["step"] == 4 and sorted(namespace["losses"]) == [1, 2, 3, 4]
    elif page == "hf.md":
        from torchckpt.integrations import hf

        assert not hf.is_enabled(namespace["model"]) and namespace["handle"].plan.predicted_extra_time_s > 0
    else:
        assert namespace["stats"].step_evaluations > 10_000
    assert os.getcwd() == str(tmp_path)


def test_train_md_commands_run_as_written(tmp_path: Path) -> None:
    """Every command in docs/train.md's "Commands" block, in order, in a temporary directory."""
    import subprocess
    import sys

    section = (DOCS / "train.md").read_text().split("## Commands", 1)[1]
    block = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)[0]
    commands = [line.split() for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["torchckpt", "train"], ["torchckpt", "train"], ["torchckpt", "ls"]]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", COLUMNS="120")
    outputs = []
    for command in commands:
        result = subprocess.run([sys.executable, "-m", "torchckpt.cli.main", *command[1:]], check=False, cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, (command, result.stderr)
        outputs.append(result.stdout)
    assert "step 4/4" in outputs[0] and "validation loss" in outputs[0]
    assert "plan reused from step 4" in outputs[1] and "planning" not in outputs[1]
    assert "resumed from runs/tiny/checkpoints/step-000000004" in outputs[1] and "step 6/6" in outputs[1]
    assert "step-000000006" not in outputs[0] and all(f"{s}" in outputs[2] for s in (2, 4, 6))


def _run_planner_md_section(heading: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run the first Python block under ``heading`` of docs/planner.md in ``tmp_path``; its namespace."""
    section = (DOCS / "planner.md").read_text().split(heading, 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, str(DOCS / "planner.md"), "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


@pytest.mark.slow  # 31 s: profiles an HF Llama with a 32k head; the loss head is planned in the fast tier
# (tests/planner/test_loss_head_plans.py)
def test_planner_md_loss_head_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/planner.md's "The loss head in chunks" example: half of every block's peak, the head chunked."""
    pytest.importorskip("transformers")
    namespace = _run_planner_md_section("## The loss head in chunks", tmp_path, monkeypatch)
    plan = namespace["plan"]
    assert plan.loss_head == {"path": "lm_head", "chunk_tokens": 256}
    report = namespace["torchckpt"].verify_plan(namespace["model"], plan, namespace["batch"])
    assert report.within_budget and report.gradients_equal and report.rounding_only == ("lm_head.weight",)


@pytest.mark.slow  # 21 s: profiles gpt("mini") with offload; offload plans are verified in the fast tier
# (tests/planner/test_offload_plans.py)
def test_planner_md_offload_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/planner.md's offload example: a plan at every block's peak that offloads, verified bitwise."""
    namespace = _run_planner_md_section("## Offload: keep, recompute, or move to host memory", tmp_path, monkeypatch)
    plan, report = namespace["plan"], namespace["report"]
    assert plan.offload and "offloaded to host" in str(plan)
    assert report.within_budget and report.gradients_equal and report.buffers_equal
    assert report.measured_host_peak_bytes == report.predicted_host_peak_bytes > 0


def test_planner_md_stem_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/planner.md's stem example: the work before the first block is planned as a block, and says so."""
    namespace = _run_planner_md_section("## The stem: the work before the first block", tmp_path, monkeypatch)
    costs = namespace["costs"]
    assert costs.block_paths[0] == "stem" and costs.notes["stem"].startswith("stem taken as the first block")
