"""The planner: measure a model, solve for the fastest plan within a memory budget, apply it, prove it.

Public seam: ``plan`` / ``frontier`` (profile -> solve -> Plan), ``Plan`` and its typed pieces,
``apply_plan``, ``verify_plan``, ``plan_without_side_effects``. ``profile`` (measures, decides nothing),
``costs`` (the cost model, ``CostModel``;
``ChainCosts`` adds ``plan(budget)``), ``solve`` (pure numpy: never imports torch) and ``blocks`` are its parts.
"""

from torchckpt._host import preserved_state
from torchckpt.planner.apply import apply_plan
from torchckpt.planner.blocks import block_paths, describe_paths, find_blocks, positional_form, resolve_blocks
from torchckpt.planner.costs import BlockCosts, CostModel, OpCosts
from torchckpt.planner.from_costs import ChainCosts, no_checkpointing_schedule, plan_from_costs, resolve_budget
from torchckpt.planner.frontier import Frontier, FrontierPoint, frontier, frontier_from_costs
from torchckpt.planner.isolation import plan_without_side_effects
from torchckpt.planner.make_plan import plan
from torchckpt.planner.plan import Plan, PlanMismatchError, PlannedBlock, PlannedRegion, PlanPiece, fingerprint
from torchckpt.planner.profile import profile
from torchckpt.planner.runner import StepFn, StepRunner, call_model, default_loss
from torchckpt.planner.solve import InfeasibleBudgetError
from torchckpt.planner.verify import VerifyReport, verify_plan

__all__ = [
    "plan",
    "frontier",
    "Plan",
    "PlanMismatchError",
    "PlannedBlock",
    "PlannedRegion",
    "PlanPiece",
    "InfeasibleBudgetError",
    "apply_plan",
    "verify_plan",
    "VerifyReport",
    "Frontier",
    "FrontierPoint",
    "plan_without_side_effects",
    "preserved_state",
    "profile",
    "plan_from_costs",
    "frontier_from_costs",
    "no_checkpointing_schedule",
    "resolve_budget",
    "fingerprint",
    "find_blocks",
    "resolve_blocks",
    "block_paths",
    "describe_paths",
    "positional_form",
    "StepRunner",
    "default_loss",
    "call_model",
    "StepFn",
    "BlockCosts",
    "ChainCosts",
    "CostModel",
    "OpCosts",
]
