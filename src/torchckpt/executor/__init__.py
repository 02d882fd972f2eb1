"""The executor: checkpoint a function or modules with JAX-style save policies, and inspect what is kept.

Public seam: ``checkpoint``, ``checkpoint_sequential``, ``checkpoint_modules`` (+ ``CheckpointHandle``,
``wrap_forward``, ``recompute_checks``), ``Offloader`` (saved activations moved to host memory),
``OptimizerOffload`` (the optimizer's state in host memory between steps), the
policies (``Policy``, ``OpInfo``, ``tag`` and the named policies) and
``saved_residuals``. The planner lowers its plans onto these; it never reaches inside.
"""

from torchckpt.executor.checkpoint import (
    RecomputationMismatchError,
    RematError,
    checkpoint,
    checkpoint_sequential,
)
from torchckpt.executor.offload import Offloader
from torchckpt.executor.optimizer_offload import OptimizerOffload
from torchckpt.executor.plain_regions import recompute_checks
from torchckpt.executor.policies import (
    POLICIES,
    OpInfo,
    Policy,
    PolicyLike,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    resolve_policy,
    save_anything_except_these_names,
    save_from_both_policies,
    save_only_these_names,
    save_ops,
    tag,
)
from torchckpt.executor.residuals import Residual, SavedResiduals, saved_residuals
from torchckpt.executor.wrap import CheckpointHandle, checkpoint_modules, wrap_forward

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_modules",
    "recompute_checks",
    "Offloader",
    "OptimizerOffload",
    "wrap_forward",
    "CheckpointHandle",
    "RematError",
    "RecomputationMismatchError",
    "POLICIES",
    "OpInfo",
    "Policy",
    "PolicyLike",
    "resolve_policy",
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
    "SavedResiduals",
    "Residual",
]
