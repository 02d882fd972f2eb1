"""The training job's plan: the one stored in its newest checkpoint when it was made for this layout and
budget (plan_record.py's [a plan follows the job]), else the one saved in the run directory when there is no
checkpoint yet, else a new one.

Planning goes through ``torchckpt.planner.plan_without_side_effects``, so a run that plans and a run
that loads a saved plan continue bitwise alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from torchckpt._units import format_bytes
from torchckpt.planner import Plan, PlanMismatchError, plan_without_side_effects
from torchckpt.train.config import TrainConfig
from torchckpt.train.distributed import Ranks
from torchckpt.train.plan_record import Layout, StoredPlan, read_stored_plan

__all__ = ["load_or_make_plan", "options_changed", "plan_job"]

Measure = Callable[[nn.Module, tuple, "list[nn.Module] | None"], dict[str, float]]


def options_changed(plan: Plan, options: dict[str, bool]) -> str:
    """Why ``plan`` was not made with the planning ``options`` (``TrainConfig.plan_options``); empty when it was.

    Example:
        >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
        ...             block_paths=(), fingerprint={})
        >>> options_changed(plan, {"offload": False, "optimizer_offload": True})
        'it was made without --optimizer-offload'
    """
    made = {"offload": "offload" in plan.notes, "optimizer_offload": plan.optimizer_offload}
    changed = [f"{'with' if made[name] else 'without'} --{name.replace('_', '-')}" for name in made
               if made[name] != bool(options.get(name, False))]
    return f"it was made {' and '.join(changed)}" if changed else ""


def _new_plan(model: nn.Module, example_inputs: tuple | dict, budget: int | str, options: dict[str, bool]) -> Plan:
    return plan_without_side_effects(model, example_inputs, budget, offload=bool(options.get("offload")),
                                     optimizer_offload=bool(options.get("optimizer_offload")))


def load_or_make_plan(path: Path, model: nn.Module, example_inputs: tuple | dict, budget: int | str,
                      budget_recorded: object, options: dict[str, bool] | None = None) -> tuple[Plan, str]:
    """Reuse the plan at ``path`` when it fits the model, inputs, budget and planning ``options``
    (``TrainConfig.plan_options``); else make and save a new one.

    Returns the plan and a line saying which happened (and why a saved plan was not reused).

    Example:
        >>> import tempfile
        >>> from torchckpt.models import gpt
        >>> model, tmp = gpt("tiny"), tempfile.TemporaryDirectory()
        >>> batch, path = model.example_batch(batch_size=2, seq_len=16), Path(tmp.name) / "plan.json"
        >>> load_or_make_plan(path, model, batch, "100%", None)[1].startswith("planned")
        True
        >>> load_or_make_plan(path, model, batch, "100%", "100%")[1].startswith("reused")
        True
        >>> tmp.cleanup()
    """
    reason = "no saved plan"
    if path.is_file():
        if budget_recorded != budget:
            reason = f"the budget changed ({budget_recorded!r} -> {budget!r})"
        else:
            try:
                plan = Plan.load(path, model, example_inputs)
            except (PlanMismatchError, ValueError) as error:
                reason = f"the saved plan does not fit ({error})"
            else:
                changed = options_changed(plan, options or {})
                if changed:
                    reason = f"the planning options changed ({changed})"
                elif plan.notes.get("engine") in (None, "None"):
                    return plan, f"reused the plan saved in {path}"
                else:
                    reason = f"the saved plan was made for {plan.notes['engine']}, not one process"
    plan = _new_plan(model, example_inputs, budget, options or {})
    plan.save(path)
    return plan, f"planned ({reason}); saved to {path}"


def plan_job(config: TrainConfig, record: dict[str, Any], model: nn.Module, example: tuple, checkpointer: Any,
             ranks: Ranks | None, measure: Measure | None, say: Callable[[str], None]) -> tuple[Plan, StoredPlan]:
    """The plan this job trains with, and its record for the checkpoints (plan_record.py's [a plan follows the
    job]): reused from the newest checkpoint at the same layout and budget (no profiling), else made now, saying
    why and, when the layout changed, what changed. ``measure(model, batch, blocks)`` measures the baseline of a
    new plan. Writes ``run.json``, ``plan.json`` and ``baseline.json`` (rank 0). A collective in a sharded job.

    Example (a step that stores a plan for this layout and budget: reused, nothing profiled):
        >>> import tempfile
        >>> from torchckpt import Checkpointer
        >>> from torchckpt.models import gpt
        >>> from torchckpt.planner.plan import fingerprint
        >>> from torchckpt.train.plan_record import Layout
        >>> tmp, model = tempfile.TemporaryDirectory(), gpt("tiny")
        >>> config, batch = TrainConfig(size="tiny", batch_size=2, seq_len=16, dir=tmp.name), model.example_batch(2, 16)
        >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
        ...             block_paths=(), fingerprint=fingerprint(model, batch, []))
        >>> stored = StoredPlan(plan, config.budget, Layout(1, "none", (2, 16)), {"peak_bytes": 1.0, "step_s": 0.1})
        >>> with Checkpointer(config.run_dir / "checkpoints") as ckpt:
        ...     ckpt.save(3, plan=stored.record())
        ...     reused, again = plan_job(config, {}, model, batch, ckpt, None, None, print)  # doctest: +ELLIPSIS
        plan reused from step 3 (made for one process, batch 2 x 16, --budget 50%); not profiled
        blocks: ...
        >>> again == stored
        True
        >>> tmp.cleanup()
    """
    if ranks is not None and config.optimizer_offload:  # the same on every rank: all refuse
        raise ValueError("--optimizer-offload is planned on one process only: with --nproc the model is sharded by "
                         "FSDP2, whose own offload_policy=CPUOffloadPolicy() moves the state; train without it, or "
                         "on one process")
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = Layout(world=ranks.world if ranks else 1, sharding="FSDP2" if ranks else "none",
                    batch=(config.batch_size, config.seq_len))
    step, stored, why = read_stored_plan(checkpointer)
    if stored is not None:
        why = stored.differs(layout, config.budget) or options_changed(stored.plan, config.plan_options())
        why = f"the plan stored in step {step}: {why}" if why else ""
        if not why:
            try:
                stored.plan.check_fits(model, example)
            except PlanMismatchError as error:
                why = f"the plan stored in step {step} does not fit this model ({error})"
    if ranks is not None and ranks.largest(int(stored is None or bool(why))) and stored is not None and not why:
        why = "another process could not reuse the stored plan"  # every rank plans, or none
    if stored is not None and not why:
        say(f"plan reused from step {step} (made for {layout.describe()}, --budget {config.budget}); not profiled")
        _write(run_dir, record, config, stored, ranks)
        say(stored.plan.table())
        return stored.plan, stored
    per = f" per process, on each of {ranks.world}" if ranks else ""
    say(f"planning activation checkpointing for a budget of {config.budget}{per} (whole step: parameters, "
        "gradients, AdamW state, activations) ...")
    if step is None and ranks is None:  # no checkpoint yet: the run directory's plan, as a restart before a save
        plan, how = load_or_make_plan(run_dir / "plan.json", model, example, config.budget, record.get("plan_budget"),
                                      config.plan_options())
    else:  # every rank plans (a collective: planner/distributed.py's [a distributed model is planned by all its ranks])
        plan = _new_plan(model, example, config.budget, config.plan_options())
        where = f"planned on {ranks.world} processes, one plan for all" if ranks else "planned"
        how = where + (f" ({why})" if step is not None else "") + f"; saved to {run_dir / 'plan.json'}"
    baseline_path = run_dir / "baseline.json"
    if how.startswith("reused") and baseline_path.is_file():
        baseline = json.loads(baseline_path.read_text())
    else:
        blocks = None if ranks is not None or not plan.block_paths else [  # one process: measured beside the plan
            model.get_submodule(path) for path in plan.block_paths]
        if measure is None:
            raise ValueError("plan_job: a new plan needs measure(model, batch, blocks) for its baseline")
        baseline = measure(model, example, blocks)
        if ranks is not None:  # one figure on every rank, so every rank stores the same record
            baseline["peak_bytes"] = ranks.largest(int(baseline["peak_bytes"]))
            baseline["step_s"] = ranks.mean(baseline["step_s"])
    new = StoredPlan(plan, config.budget, layout, baseline)
    _write(run_dir, record, config, new, ranks)
    say(how)
    if stored is not None and stored.layout != layout:
        say(f"the layout changed since step {step}: {stored.layout.describe()} -> {layout.describe()}; predicted "
            f"peak per process {format_bytes(stored.plan.predicted_peak_bytes)} -> "
            f"{format_bytes(plan.predicted_peak_bytes)} (budget {config.budget}: "
            f"{format_bytes(stored.plan.budget_bytes)} -> {format_bytes(plan.budget_bytes)} per process)")
    say(plan.table())
    return plan, new


def _write(run_dir: Path, record: dict[str, Any], config: TrainConfig, stored: StoredPlan, ranks: Ranks | None) -> None:
    """run.json (with the budget planned for), plan.json and baseline.json: rank 0 writes them
    (train/distributed.py's [rank 0 speaks for the run])."""
    record["plan_budget"] = config.budget
    if ranks is None or ranks.leader:
        stored.plan.save(run_dir / "plan.json")
        (run_dir / "baseline.json").write_text(json.dumps(stored.baseline))
        (run_dir / "run.json").write_text(json.dumps(record, indent=1))
