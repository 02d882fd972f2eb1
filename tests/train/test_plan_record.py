"""A plan that follows the job (plan_record.py's [a plan follows the job]): each step ``torchckpt train`` saves
holds its plan, budget, baseline and per-process layout; a resume at the same layout reuses it without
profiling, one at another layout or budget re-plans and says what changed, and a missing, foreign or corrupt
stored plan is re-planned with the reason said. One process here (real Checkpointer steps); the 2 -> 1 process
resume is in tests/train/test_train_distributed.py (slow tier), the end-to-end reuse in test_train.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchckpt import Checkpointer
from torchckpt.models import gpt
from torchckpt.planner import Plan, plan_without_side_effects
from torchckpt.train import TrainConfig
from torchckpt.train import planning as job_planning
from torchckpt.train.plan_record import Layout, StoredPlan, read_stored_plan
from torchckpt.train.planning import plan_job

BATCH = (2, 16)
ONE = Layout(world=1, sharding="none", batch=BATCH)


@pytest.fixture(scope="module")
def planned() -> tuple[torch.nn.Module, tuple, Plan]:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    example = model.example_batch(batch_size=BATCH[0], seq_len=BATCH[1])
    return model, example, plan_without_side_effects(model, example, "100%")


class Job:
    """plan_job on a real Checkpointer; counts the plans made and baselines measured (a reuse makes neither)."""

    def __init__(self, tmp_path: Path, planned: tuple[torch.nn.Module, tuple, Plan],
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.model, self.example, self.plan = planned
        self.dir, self.plans_made, self.measured = tmp_path / "run", 0, 0
        self.checkpointer = Checkpointer(self.dir / "checkpoints")

        def plan_again(model: Any, example: Any, budget: Any, **options: Any) -> Plan:
            self.plans_made += 1
            assert model is self.model and budget in ("90%", "95%")
            return self.plan

        monkeypatch.setattr(job_planning, "plan_without_side_effects", plan_again)

    def measure(self, *args: Any) -> dict[str, float]:
        self.measured += 1
        return {"peak_bytes": 1000.0 + self.measured, "step_s": 0.5}

    def run(self, budget: str = "90%") -> tuple[Plan, StoredPlan, str]:
        said: list[str] = []
        config = TrainConfig(size="tiny", batch_size=BATCH[0], seq_len=BATCH[1], budget=budget, dir=str(self.dir))
        plan, stored = plan_job(config, {}, self.model, self.example, self.checkpointer, None, self.measure,
                                said.append)
        return plan, stored, "\n".join(said)

    def save(self, step: int, **items: Any) -> None:
        self.checkpointer.save(step, model=self.model, **items)


def test_a_resume_at_the_same_layout_reuses_the_stored_plan_without_profiling(
        tmp_path: Path, planned: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, planned, monkeypatch)
    plan, stored, said = job.run()
    assert job.plans_made == 1 and job.measured == 1 and "planned" in said
    assert stored.layout == ONE and stored.budget == "90%" and stored.plan is plan
    job.save(2, plan=stored.record())
    again, reused, said = job.run()
    assert "plan reused from step 2 (made for one process, batch 2 x 16, --budget 90%); not profiled" in said
    assert "planning" not in said and job.plans_made == 1 and job.measured == 1
    assert again.to_json() == plan.to_json() and reused.baseline == stored.baseline == {"peak_bytes": 1001.0,
                                                                                        "step_s": 0.5}
    assert json.loads((job.dir / "baseline.json").read_text()) == stored.baseline
    job.checkpointer.close()


def test_a_resume_at_another_layout_or_budget_replans_and_says_what_changed(
        tmp_path: Path, planned: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path, planned, monkeypatch)
    made_on_two = StoredPlan(job.plan, "90%", Layout(world=2, sharding="FSDP2", batch=BATCH), {"peak_bytes": 9.0,
                                                                                                "step_s": 1.0})
    job.save(4, plan=made_on_two.record())
    _, stored, said = job.run()
    assert job.plans_made == 1 and job.measured == 1 and stored.layout == ONE
    assert "planned (the plan stored in step 4: the layout changed)" in said
    peak = f"{job.plan.predicted_peak_bytes / 2**20:.2f} MiB"
    assert (f"the layout changed since step 4: FSDP2 over 2 processes, batch 2 x 16 per process -> one process, "
            f"batch 2 x 16; predicted peak per process {peak} -> {peak}") in said
    job.save(6, plan=stored.record())
    _, _, said = job.run(budget="95%")
    assert "the plan stored in step 6: the budget changed ('90%' -> '95%')" in said and job.plans_made == 2
    job.checkpointer.close()


@pytest.mark.parametrize(("record", "why"), [
    (None, "step 8 holds no stored plan (saved by an earlier torchckpt)"),
    ({"format": "someone else's"}, "is unusable: it is not a torchckpt train plan record (format \"someone else's\""),
    ("version", "is unusable: its record version 99 is not one this torchckpt reads"),
    ("plan", "is unusable: not a torchckpt plan: invalid JSON"),
    ("layout", "is unusable: its layout is malformed"),
    ("fingerprint", "does not fit this model (this plan was made for a different structure"),
])
def test_a_missing_foreign_or_corrupt_stored_plan_is_replanned_with_the_reason(
        tmp_path: Path, planned: tuple, monkeypatch: pytest.MonkeyPatch, record: Any, why: str) -> None:
    job = Job(tmp_path, planned, monkeypatch)
    good = StoredPlan(job.plan, "90%", ONE, {"peak_bytes": 9.0, "step_s": 1.0}).record()
    if isinstance(record, str):  # one field of a good record spoilt
        spoilt = {"version": 99, "plan": good["plan"][:-9], "layout": {"world": 0, "sharding": "none", "batch": [2]}}
        if record == "fingerprint":
            other = json.loads(good["plan"])
            other["fingerprint"]["structure"] = "0" * 16
            spoilt["fingerprint"] = json.dumps(other)
        record = {**good, ("plan" if record == "fingerprint" else record): spoilt[record]}
    job.save(8, **({} if record is None else {"plan": record}))
    plan, stored, said = job.run()
    assert job.plans_made == 1 and job.measured == 1 and plan is job.plan, said
    assert why in said, said
    assert StoredPlan.from_record(stored.record()) == stored  # what the next step saves reads back
    job.checkpointer.close()


def test_no_checkpoint_reads_as_none_and_a_record_reads_back(tmp_path: Path, planned: tuple) -> None:
    with Checkpointer(tmp_path) as checkpointer:
        assert read_stored_plan(checkpointer) == (None, None, "no checkpoint")
        stored = StoredPlan(planned[2], 1 << 20, ONE, {"peak_bytes": 3.0})
        checkpointer.save(1, plan=stored.record())
        assert read_stored_plan(checkpointer) == (1, stored, "")
    assert (tmp_path / "step-000000001").is_dir()
