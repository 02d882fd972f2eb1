"""torchckpt: activation checkpointing under an absolute memory budget, and crash-proof training state.

Public API (everything else is private and may change):

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
"""

from torchckpt import models
from torchckpt._version import __version__
from torchckpt.memory import MemoryBreakdown, MemoryMeter
from torchckpt.remat import (
    CheckpointError,
    CheckpointHandle,
    OpInfo,
    Policy,
    RecomputationMismatchError,
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
    "MemoryMeter",
    "MemoryBreakdown",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_modules",
    "CheckpointHandle",
    "CheckpointError",
    "RecomputationMismatchError",
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
]
