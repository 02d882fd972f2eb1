"""torchckpt: activation checkpointing under an absolute memory budget, and crash-proof training state.

The names a user starts with (everything else lives in a namespace below):

    plan, apply, verify_plan, frontier, Plan, InfeasibleBudgetError
                                     plan activation checkpointing against an absolute memory budget,
                                     apply it to an unmodified model, prove it
    profile                          measure once (a ``ChainCosts``), then ``costs.plan(budget)`` per budget
    MemoryMeter                      exact live tensor bytes (CPU), allocator stats (CUDA), process RSS
    checkpoint, checkpoint_sequential, checkpoint_modules, saved_residuals, tag
                                     the executor with JAX-style save policies (``torchckpt.policies``)
    checkpointed_loop, checkpointed_while
                                     binomial (Revolve) checkpointing of long loops
    Checkpointer, CheckpointError    crash-proof, pickle-free training-state checkpoints

Namespaces: ``policies`` (the save policies), ``executor``, ``planner``, ``loops``, ``state`` (every
state error, ``list_checkpoints``, ``verify_checkpoint``, import/export), ``memory``, ``models``.
"""

from torchckpt import executor, loops, memory, models, planner, state
from torchckpt._version import __version__
from torchckpt.executor import checkpoint, checkpoint_modules, checkpoint_sequential, policies, saved_residuals, tag
from torchckpt.loops import checkpointed_loop, checkpointed_while
from torchckpt.memory import MemoryMeter
from torchckpt.planner import InfeasibleBudgetError, Plan, frontier, plan, profile, verify_plan
from torchckpt.planner import apply_plan as apply
from torchckpt.state import Checkpointer, CheckpointError

__all__ = [
    "__version__",
    "plan",
    "apply",
    "verify_plan",
    "frontier",
    "profile",
    "Plan",
    "InfeasibleBudgetError",
    "MemoryMeter",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_modules",
    "saved_residuals",
    "tag",
    "checkpointed_loop",
    "checkpointed_while",
    "Checkpointer",
    "CheckpointError",
    "policies",
    "executor",
    "planner",
    "loops",
    "state",
    "memory",
    "models",
]
