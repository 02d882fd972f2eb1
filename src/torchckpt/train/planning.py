"""The training job's plan: reuse the one saved in the run directory when it fits, else plan anew.

Planning goes through ``torchckpt.planner.plan_without_side_effects``, so a run that plans and a run
that loads a saved plan continue bitwise alike.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from torchckpt.planner import Plan, PlanMismatchError, plan_without_side_effects

__all__ = ["load_or_make_plan"]


def load_or_make_plan(path: Path, model: nn.Module, example_inputs: tuple | dict, budget: int | str,
                      budget_recorded: object) -> tuple[Plan, str]:
    """Reuse the plan at ``path`` when it fits the model, inputs and budget; else make and save a new one.

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
                return Plan.load(path, model, example_inputs), f"reused the plan saved in {path}"
            except (PlanMismatchError, ValueError) as error:
                reason = f"the saved plan does not fit ({error})"
    plan = plan_without_side_effects(model, example_inputs, budget)
    plan.save(path)
    return plan, f"planned ({reason}); saved to {path}"
