"""Activation checkpointing: the executor, save policies and residual inspection."""

from torchckpt.remat.apply import CheckpointHandle, checkpoint_modules
from torchckpt.remat.checkpoint import RematError, RecomputationMismatchError, checkpoint, checkpoint_sequential
from torchckpt.remat.loop import LoopStats, checkpointed_loop, checkpointed_while
from torchckpt.remat.residuals import Residual, SavedResiduals, saved_residuals
from torchckpt.remat.revolve import online_schedule, optimal_step_evaluations, revolve_schedule
from torchckpt.remat.policies import (
    PolicyLike,
    POLICIES,
    OpInfo,
    Policy,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    save_anything_except_these_names,
    save_from_both_policies,
    save_only_these_names,
    save_ops,
    tag,
)

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_modules",
    "CheckpointHandle",
    "RematError",
    "RecomputationMismatchError",
    "POLICIES",
    "OpInfo",
    "Policy",
    "PolicyLike",
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_only_these_names",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_ops",
    "tag",
    "saved_residuals",
    "checkpointed_loop",
    "checkpointed_while",
    "LoopStats",
    "revolve_schedule",
    "online_schedule",
    "optimal_step_evaluations",
    "SavedResiduals",
    "Residual",
]
