"""torch.compile and torchckpt: how a checkpointed region is lowered while Dynamo traces it, and how a
compiled module is seen through.

Note: [under torch.compile a region is torch's checkpoint] When ``torch.compile`` traces a checkpointed region
(``torch.compiler.is_compiling()``), ``checkpoint`` runs none of its own dispatch modes, which Dynamo cannot
trace: a region that keeps nothing becomes ``torch.utils.checkpoint.checkpoint(fn, use_reentrant=False)``,
which Dynamo captures as one higher-order op and AOTAutograd's partitioner recomputes in the backward graph; a
region that keeps ops becomes the same call with ``context_fn=create_selective_checkpoint_contexts(...)``,
whose policy answers ``MUST_SAVE`` for the ops the torchckpt policy keeps and ``PREFER_RECOMPUTE`` for the
rest (torch's selective activation checkpointing, the mechanism torchtitan uses). ``context_fn`` is
``functools.partial`` of a module-level function and the policy's ``key`` (a string), which Dynamo guards on:
blocks compiled one by one share code, and each policy still gets its own graph (a closure would be guarded by
its code only, and a second block would reuse the first block's choices). Higher-order ops inside a region are
never kept. The executor rules that need no dispatch mode of ours hold there too: views, in-place and random
ops are never kept. Buffers written inside a region (BatchNorm statistics) are functionalised by AOTAutograd
and written once by the forward graph, so recomputation cannot write them twice (checkpoint.py's [recomputation leaves
buffers alone] holds by construction). Not carried over: the op-by-op recompute check (``debug=True``,
``recompute_checks``; run ``verify_plan`` eagerly), ``tag`` names (``OpInfo.tag_name`` is None under compile,
so ``save_only_these_names`` keeps nothing and ``save_anything_except_these_names`` keeps every keepable op),
checkpoint.py's [nested checkpoints keep nothing] (a checkpoint nested in another keeps what its policy says under
compile; plans' regions nest only regions that keep nothing), and a policy that combines ``save_ops``
positions (refused).

Note: [Python side effects run once under compile] Dynamo refuses a checkpointed region whose forward
mutates a Python object from outside it (HF transformers' output-capturing hooks set a context variable
in every decoder layer) and graph-breaks there, because eager checkpointing replays such side effects in
recomputation. A compiled region recomputes inside the backward graph, where no Python runs, so the effect
happens once, as without checkpointing: while any torchckpt handle is applied (``checkpoint_modules``,
``apply``), ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is True, and set back
when the last handle is removed (``SideEffectsOnce``).

Note: [compiled plans keep ops by name and occurrence] A plan's kept ops are positions in the block's
eager forward pass (``save_ops``); a traced graph numbers its ops differently (functionalisation and
decompositions add ops such as ``clone``). So each kept op also carries ``"name#k:bytes"``: it is the k-th
op of that name in the block, with that many output bytes (``PlannedBlock.keep_ops``), and the compiled
policy keeps exactly those occurrences when their bytes agree (else it recomputes them, with a warning).
Random and in-place ops are rewritten by tracing (eager dropout's ``bernoulli_``, ``div_``, ``mul`` are one
``native_dropout`` there, which decompositions may split again), so an op that runs after one in its block
cannot be numbered: it is written ``"-"`` and recomputed under compile (one warning per block). A
``save_ops`` policy without ``ops=`` (a plan saved by an older torchckpt, a hand-made ``save_ops([...])``)
is refused under compile with the fix: re-plan, or pass ``ops=``.

Note: [a compiled model is planned through its original] ``plan``, ``profile``, ``frontier``,
``verify_plan``, ``apply`` and ``checkpoint_modules`` accept a module made by ``torch.compile`` (an
``OptimizedModule``, the original in ``._orig_mod``) and blocks compiled one by one: they act on the
original modules (``uncompiled``), measure eagerly (``torch.compiler.set_stance("force_eager")``, since
the CPU meter is a dispatch mode and cannot see inductor's kernels), and the plan's wraps sit inside the
compiled code, where Dynamo traces them. A module compiled and already run before a plan is applied picks
the plan up at its next call: Dynamo's guards see the blocks' new ``forward`` and recompile (and again after
``remove()``). ``set_stance`` is process-wide: do not profile in one thread while another trains compiled.
Blocks compiled one by one share one code object, so blocks with different kept ops recompile it; past
Dynamo's ``recompile_limit`` (8 by default) the remaining blocks run eagerly (raise
``torch._dynamo.config.recompile_limit`` for deep models with many distinct blocks).
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

from torchckpt.executor.policies import OpInfo, Policy, can_keep, op_name, policy_by_key

__all__ = ["EAGER_ONLY", "SideEffectsOnce", "any_compiled", "checkpoint_while_compiling", "eager_measurement",
           "is_compiled_module", "sac_contexts", "uncompiled"]

EAGER_ONLY = ("is planned for eager runs only: torch.compile's partitioner decides what a checkpoint nested in "
              "another, or one per slice of the batch, recomputes (on a compiled gpt tiny a plan with pieces "
              "nested peaked as one recomputing every block whole, over its budget)")
"""Note: [checkpoints nested or sliced are planned for eager runs]: why ``apply`` refuses a plan with nested pieces
or slices of the batch on a compiled model, and why a compiled model's profile leaves them out
(planner/options_step.py). Dynamo turns an error raised while it traces into a fallback to eager for that frame,
so a plan applied first and compiled after cannot be refused when it is traced; docs/planner.md says so."""


class SideEffectsOnce:
    """Hold Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` True while any holder is alive
    (Note: [Python side effects run once under compile]); ``release()`` once per holder, idempotent.

    Example:
        >>> hold = SideEffectsOnce()
        >>> torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
        True
        >>> hold.release()
    """

    _lock = threading.Lock()
    _holders = 0
    _before: bool = False

    def __init__(self) -> None:
        config = torch._dynamo.config
        with SideEffectsOnce._lock:
            if SideEffectsOnce._holders == 0:
                SideEffectsOnce._before = bool(config.skip_fwd_side_effects_in_bwd_under_checkpoint)
            SideEffectsOnce._holders += 1
            config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        self._held = True

    def release(self) -> None:
        """Let go; the last holder puts the user's setting back."""
        with SideEffectsOnce._lock:
            if not self._held:
                return
            self._held = False
            SideEffectsOnce._holders -= 1
            if SideEffectsOnce._holders == 0:
                torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = SideEffectsOnce._before


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is what ``torch.compile(an nn.Module)`` returns (it holds the original as ``_orig_mod``).

    Example:
        >>> is_compiled_module(nn.Linear(2, 2))
        False
    """
    return isinstance(module, nn.Module) and type(module).__name__ == "OptimizedModule" and \
        isinstance(getattr(module, "_orig_mod", None), nn.Module)


def uncompiled(module: nn.Module) -> nn.Module:
    """The original module behind ``torch.compile(module)`` (unwrapped repeatedly), or ``module`` itself.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> uncompiled(torch.compile(layer)) is layer, uncompiled(layer) is layer
        (True, True)
    """
    while is_compiled_module(module):
        original = module._orig_mod
        assert isinstance(original, nn.Module)  # is_compiled_module checked it
        module = original
    return module


def any_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it is compiled: made by ``torch.compile(module)``, or compiled in
    place (``module.compile()``).

    Example:
        >>> layer = nn.Sequential(nn.Linear(2, 2))
        >>> any_compiled(layer), any_compiled(torch.compile(layer))
        (False, True)
    """
    return is_compiled_module(module) or any(
        is_compiled_module(m) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


@contextmanager
def eager_measurement() -> Iterator[None]:
    """Run compiled code eagerly inside (``torch.compiler.set_stance("force_eager")``), so that the planner's
    dispatch modes see every op (Note: [a compiled model is planned through its original]).

    Example:
        >>> with eager_measurement():
        ...     torch.compile(nn.Linear(2, 2))(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    with torch.compiler.set_stance("force_eager"):
        yield


def sac_contexts(policy: Policy) -> tuple[Any, Any]:
    """The forward and recompute contexts of torch's selective checkpoint for ``policy``, as ``context_fn``
    returns them (Note: [under torch.compile a region is torch's checkpoint]).

    Each call starts counting ops afresh, as each trace of the region does. A plan's kept op whose traced
    output has other bytes than the plan measured is recomputed instead, with one warning per policy
    (Note: [compiled plans keep ops by name and occurrence]).

    Example:
        >>> from torchckpt.executor.policies import save_ops
        >>> forward, recompute = sac_contexts(save_ops([1], ops=["aten.mm#0"]))
    """

    seen: collections.Counter[str] = collections.Counter()
    position = itertools.count()

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return CheckpointPolicy.PREFER_RECOMPUTE  # its inner ops are not ours to name; never kept
        name = op_name(func)
        occurrence, index = seen[name], next(position)
        seen[name] += 1
        flat = tree_flatten(ctx.op_output)[0]
        if not can_keep(func, flat, None):
            keep = False  # policies.py's [no view, in-place or random op is kept]
        elif policy.occurrences is not None:
            keep = (name, occurrence) in policy.occurrences
            expected = policy.occurrences.get((name, occurrence))
            found = _output_bytes(flat)
            if keep and expected is not None and found is not None and found != expected:
                keep = False
                _warn_once(policy, f"torchckpt: under torch.compile, {name}#{occurrence} of {policy.name} has "
                                   f"{found} output bytes where the plan measured {expected} eagerly (the traced "
                                   "graph orders ops differently); it is recomputed instead of kept")
        else:
            keep = policy(OpInfo(func, args, kwargs, index, None))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    if policy.unnamed_under_compile:
        _warn_once(policy, f"torchckpt: under torch.compile, {policy.name} recomputes {policy.unnamed_under_compile} "
                           "op(s) the plan keeps eagerly: they run after a random or in-place op, which the traced "
                           "graph rewrites, so their position there is unknown (Note: [compiled plans keep ops by "
                           "name and occurrence])")
    return torch_checkpoint.create_selective_checkpoint_contexts(decide)


def _output_bytes(flat: list[Any]) -> int | None:
    """Bytes of an op's tensor outputs, or None when a size is symbolic (dynamic shapes)."""
    total = 0
    for value in flat:
        if isinstance(value, torch.Tensor):
            size = value.numel() * value.element_size()
            if not isinstance(size, int):
                return None
            total += size
    return total


_WARNED: set[str] = set()


def _warn_once(policy: Policy, message: str) -> None:
    if policy.key not in _WARNED:
        _WARNED.add(policy.key)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _contexts_for_key(key: str) -> tuple[Any, Any]:
    """``context_fn`` under torch.compile: a module-level function and the policy's key, which Dynamo guards
    on, so that policies sharing code (blocks compiled one by one) each get their own graph."""

    return sac_contexts(policy_by_key(key))


def _refuse_positions(policy: Policy) -> None:
    """Raise outside Dynamo's trace (``checkpoint_while_compiling`` calls it through ``torch.compiler.disable``,
    applied there rather than as a decorator: decorating imports ``torch._dynamo`` with this module)."""
    raise RuntimeError(
        f"torchckpt: policy {policy.name!r} keeps ops by their position in the eager forward pass (save_ops without "
        "ops=, or combined with one), which torch.compile's traced graph numbers differently. Fix: make the plan "
        "again with this torchckpt (plans record each kept op as 'name#k:bytes'), or build the policy with "
        "save_ops(indices, ops=['aten.mm#0', ...]); or run the model without torch.compile")


def checkpoint_while_compiling(fn: Callable[..., Any], args: tuple, kwargs: dict, policy: Policy) -> Any:
    """``checkpoint``'s body while Dynamo traces it (Note: [under torch.compile a region is torch's checkpoint]).

    Example:
        >>> from torchckpt.executor.policies import nothing_saveable
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> checkpoint_while_compiling(torch.sin, (x,), {}, nothing_saveable).shape  # eager works too
        torch.Size([2, 2])
    """
    if policy.keeps_nothing:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if policy.by_position and policy.occurrences is None:
        torch.compiler.disable(_refuse_positions)(policy)
    context_fn = functools.partial(_contexts_for_key, policy.key)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
