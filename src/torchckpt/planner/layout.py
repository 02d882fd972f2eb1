"""A plan applied before ``fully_shard`` (torchtitan's order: checkpointing, then compile, then sharding).

torchtitan applies activation checkpointing to each block, compiles it, and only then shards it with FSDP2's
``fully_shard``. A plan applied that way was made (or loaded from a file) for blocks that were not FSDP2 units
when it was applied; they become units afterwards. Two things follow, each kept here.

Rules (collected in ``docs/design.md``):

1. **[a region over FSDP2 units runs block by block]** FSDP2 all-gathers a unit's parameters in hooks around
   that unit's own call, so a region that runs its later blocks inside the first block's call would compute
   with their sharded ``DTensor`` parameters (PyTorch's "got mixed torch.Tensor and DTensor"). When, at a call,
   any block of a region is an FSDP2 unit (``fsdp_units_among``), each block of the region runs inside its own
   call, as its own checkpoint keeping nothing: the model calls every block, so each recomputes after its own
   unit's all-gather, and the gradients stay bitwise those of the plain sharded step (checkpointing is exact).
2. **[a plan names the layout it was made for]** A plan records whether it was made on one process or by the
   ranks of a DDP or FSDP2 job (``Plan.notes["engine"]`` and ``["ranks"]``, ``made_for``). The first time a
   block it wraps runs as an FSDP2 unit under a plan that was not made under FSDP2, ``PlanLayoutWarning`` says
   so, once per applied plan: its per-rank peak was predicted for another layout (sharded parameters,
   all-gathered blocks and regions run block by block change it), and the fix measures it on this one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from torchckpt.planner.plan import Plan

__all__ = ["LayoutWatch", "PlanLayoutWarning", "fsdp_units_among", "made_for"]


class PlanLayoutWarning(UserWarning):
    """A plan runs on a layout other than the one it was made for (e.g. made unsharded, run under FSDP2)."""


def fsdp_units_among(modules: Sequence[nn.Module]) -> bool:
    """Whether any of ``modules`` is an FSDP2 unit (``fully_shard`` was applied to it).

    Example:
        >>> fsdp_units_among([nn.Linear(2, 2)])
        False
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build of torch without torch.distributed
        return False
    return any(isinstance(module, FSDPModule) for module in modules)


def made_for(plan: Plan) -> str:
    """The layout ``plan`` was made for, in words: one process, or the engine and ranks of a distributed job.

    Example:
        >>> made_for(Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
        ...             block_paths=(), fingerprint={}))
        'one process (no DDP, no FSDP2)'
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"made_for(plan) takes a torchckpt Plan; got {type(plan).__name__}")
    engine = plan.notes.get("engine")
    if not engine or engine == "None":
        return "one process (no DDP, no FSDP2)"
    ranks = re.match(r"(\d+) ranks", plan.notes.get("ranks", ""))
    return f"{engine} over {ranks.group(1)} ranks" if ranks else str(engine)


class LayoutWatch:
    """Watches the blocks an applied plan wraps: warns once (``PlanLayoutWarning``) when one first runs as an
    FSDP2 unit under a plan made for another layout ([a plan names the layout it was made for]).

    Example:
        >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(),
        ...             block_paths=(), fingerprint={})
        >>> watch = LayoutWatch(plan)
        >>> watch.see([nn.Linear(2, 2)])  # not an FSDP2 unit: nothing to say
        >>> watch.warned
        False
    """

    def __init__(self, plan: Plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"LayoutWatch(plan) takes a torchckpt Plan; got {type(plan).__name__}")
        self.plan = plan
        self.warned = plan.notes.get("engine") == "FSDP2"  # made for FSDP2 units: nothing to say

    def see(self, modules: Sequence[nn.Module]) -> None:
        """Warn, the first time only, if any of ``modules`` is an FSDP2 unit and the plan was not made for one."""
        if self.warned or torch.compiler.is_compiling() or not fsdp_units_among(modules):
            return
        self.warned = True
        plan = self.plan
        warnings.warn(
            f"this plan was made for {made_for(plan)} and now runs on FSDP2 units (fully_shard after "
            "torchckpt.apply, torchtitan's order); it computes the same gradients, bitwise, but its per-rank peak "
            f"({plan.predicted_peak_bytes} bytes predicted for a budget of {plan.budget_bytes}) was predicted for "
            "that layout, not this one, and its regions run block by block. Fix: measure it here, on every rank, "
            "with torchckpt.verify_plan(model, plan, batch) after fully_shard, or plan after fully_shard "
            "(torchckpt.plan on the sharded model, every rank) for a per-rank budget", PlanLayoutWarning,
            stacklevel=3)
