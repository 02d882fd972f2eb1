"""torchckpt: activation checkpointing under an absolute memory budget, and crash-proof training state.

Public API (everything else is private and may change):

    plan, apply, verify, frontier, Plan
                                     plan activation checkpointing against an absolute memory budget

    MemoryMeter                      exact live tensor bytes (CPU), allocator stats (CUDA), process RSS
    checkpoint, checkpoint_sequential, checkpoint_modules
                                     the non-reentrant executor with save policies
    nothing_saveable, everything_saveable, dots_saveable, dots_with_no_batch_dims_saveable,
    save_only_these_names, save_anything_except_these_names, save_from_both_policies, save_ops, tag
                                     JAX-style save policies
    saved_residuals                  what a call keeps for backward under a policy
    checkpointed_loop, checkpointed_while
                                     binomial (Revolve) checkpointing of long loops
    models                           built-in GPT, U-Net and MLP (``torchckpt.models``)
    Checkpointer, list_checkpoints, verify_checkpoint, export_model_weights, import_torch_save
                                     crash-proof, pickle-free training-state checkpoints (``torchckpt.state``)
"""

from torchckpt import models, state
from torchckpt._version import __version__
from torchckpt.memory import MemoryBreakdown, MemoryMeter
from torchckpt.remat.apply import apply_plan as apply
from torchckpt.remat.frontier import Frontier, frontier
from torchckpt.remat.plan import Plan, PlanMismatchError
from torchckpt.remat.planner import plan
from torchckpt.remat.solve import InfeasibleBudgetError
from torchckpt.remat.verify import VerifyReport, verify
from torchckpt.state import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFallbackWarning,
    CheckpointInfo,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    Checkpointer,
    CheckpointerConfig,
    CheckpointWriteError,
    RetentionPolicy,
    UnsafeFileError,
    UnsupportedStateError,
    export_model_weights,
    import_torch_save,
    list_checkpoints,
    verify_checkpoint,
)
from torchckpt.remat import (
    CheckpointHandle,
    OpInfo,
    Policy,
    RecomputationMismatchError,
    RematError,
    checkpoint,
    checkpoint_modules,
    checkpoint_sequential,
    checkpointed_loop,
    checkpointed_while,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    save_anything_except_these_names,
    save_from_both_policies,
    save_only_these_names,
    save_ops,
    saved_residuals,
    tag,
)

__all__ = [
    "__version__",
    "models",
    "plan",
    "apply",
    "verify",
    "frontier",
    "Plan",
    "PlanMismatchError",
    "InfeasibleBudgetError",
    "VerifyReport",
    "Frontier",
    "MemoryMeter",
    "MemoryBreakdown",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_modules",
    "CheckpointHandle",
    "RecomputationMismatchError",
    "RematError",
    "OpInfo",
    "Policy",
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
    "state",
    "Checkpointer",
    "CheckpointerConfig",
    "CheckpointInfo",
    "RetentionPolicy",
    "list_checkpoints",
    "verify_checkpoint",
    "export_model_weights",
    "import_torch_save",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointLockedError",
    "CheckpointWriteError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "UnsafeFileError",
    "UnsupportedStateError",
    "CheckpointFallbackWarning",
]
