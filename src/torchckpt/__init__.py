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

A light import: ``import torchckpt`` imports neither torch nor the library: each name is imported on
first use (PEP 562's module ``__getattr__``), so ``torchckpt --help`` and the state commands start without
PyTorch's import time, and nothing of ``torch.compile`` (``torch._dynamo``) loads until a model is compiled
or a handle is applied (``tests/test_startup.py``; ``bench/startup.py`` measures it).

Renamed names keep working: a public name that was renamed or moved keeps working for at least one
release through ``_MOVED``, with a ``DeprecationWarning`` naming the new one; ``tests/test_public_api.py``
snapshots the public API so that a change to it is deliberate (and gets a CHANGELOG entry).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from torchckpt._version import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers; imported on first use at run time
    from torchckpt import executor, loops, memory, models, planner, state
    from torchckpt.executor import (
        checkpoint,
        checkpoint_modules,
        checkpoint_sequential,
        policies,
        saved_residuals,
        tag,
    )
    from torchckpt.loops import checkpointed_loop, checkpointed_while
    from torchckpt.memory import MemoryMeter
    from torchckpt.planner import InfeasibleBudgetError, Plan, frontier, plan, profile, verify_plan
    from torchckpt.planner import apply_plan as apply
    from torchckpt.state import Checkpointer, CheckpointError

# name -> (module, attribute in it; None for the module itself)
_NAMES: dict[str, tuple[str, str | None]] = {
    "plan": ("torchckpt.planner", "plan"),
    "apply": ("torchckpt.planner", "apply_plan"),
    "verify_plan": ("torchckpt.planner", "verify_plan"),
    "frontier": ("torchckpt.planner", "frontier"),
    "profile": ("torchckpt.planner", "profile"),
    "Plan": ("torchckpt.planner", "Plan"),
    "InfeasibleBudgetError": ("torchckpt.planner", "InfeasibleBudgetError"),
    "MemoryMeter": ("torchckpt.memory", "MemoryMeter"),
    "checkpoint": ("torchckpt.executor", "checkpoint"),
    "checkpoint_sequential": ("torchckpt.executor", "checkpoint_sequential"),
    "checkpoint_modules": ("torchckpt.executor", "checkpoint_modules"),
    "saved_residuals": ("torchckpt.executor", "saved_residuals"),
    "tag": ("torchckpt.executor", "tag"),
    "checkpointed_loop": ("torchckpt.loops", "checkpointed_loop"),
    "checkpointed_while": ("torchckpt.loops", "checkpointed_while"),
    "Checkpointer": ("torchckpt.state", "Checkpointer"),
    "CheckpointError": ("torchckpt.state", "CheckpointError"),
    "policies": ("torchckpt.executor.policies", None),
    "executor": ("torchckpt.executor", None),
    "planner": ("torchckpt.planner", None),
    "loops": ("torchckpt.loops", None),
    "state": ("torchckpt.state", None),
    "memory": ("torchckpt.memory", None),
    "models": ("torchckpt.models", None),
}

# Renamed or moved public names (see the module docstring): old top-level name -> its new home,
# written as a user writes it. Release 0.1's top level held these until the layout of 2026-12-03 (8973022).
_MOVED: dict[str, str] = {
    "verify": "torchckpt.verify_plan",
    **{name: f"torchckpt.planner.{name}" for name in ("PlanMismatchError", "VerifyReport", "Frontier")},
    "MemoryBreakdown": "torchckpt.memory.MemoryBreakdown",
    **{name: f"torchckpt.executor.{name}"
       for name in ("CheckpointHandle", "RecomputationMismatchError", "RematError")},
    **{name: f"torchckpt.policies.{name}"
       for name in ("OpInfo", "Policy", "nothing_saveable", "everything_saveable", "dots_saveable",
                    "dots_with_no_batch_dims_saveable", "save_only_these_names",
                    "save_anything_except_these_names", "save_from_both_policies", "save_ops")},
    **{name: f"torchckpt.state.{name}"
       for name in ("CheckpointerConfig", "CheckpointInfo", "RetentionPolicy", "list_checkpoints",
                    "verify_checkpoint", "export_model_weights", "import_torch_save", "CheckpointCorruptError",
                    "CheckpointLockedError", "CheckpointWriteError", "CheckpointExistsError",
                    "CheckpointMismatchError", "CheckpointNotFoundError", "UnsafeFileError",
                    "UnsupportedStateError", "CheckpointFallbackWarning")},
}


def _resolve(dotted: str) -> Any:
    """The object a dotted public name (``torchckpt.planner.VerifyReport``) refers to."""
    owner, _, attribute = dotted.rpartition(".")
    if owner == "torchckpt":
        return __getattr__(attribute)
    return getattr(__getattr__("policies") if owner == "torchckpt.policies" else importlib.import_module(owner),
                   attribute)


def __getattr__(name: str) -> Any:
    """Import a public name on first use (the module docstring's light import); a moved name warns and still works.

    Example:
        >>> import torchckpt
        >>> torchckpt.verify_plan.__name__
        'verify_plan'
        >>> torchckpt.no_such_name
        Traceback (most recent call last):
        AttributeError: module 'torchckpt' has no attribute 'no_such_name'
    """
    if name in _NAMES:
        module_name, attribute = _NAMES[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value  # the next access is a plain attribute
        return value
    if name in _MOVED:
        new = _MOVED[name]
        warnings.warn(f"torchckpt.{name} is deprecated and will be removed in a future release; use {new}",
                      DeprecationWarning, stacklevel=2)
        return _resolve(new)
    raise AttributeError(f"module 'torchckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))


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
