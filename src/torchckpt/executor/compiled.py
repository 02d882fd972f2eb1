"""torch.compile and torchckpt: how a checkpointed region is lowered while Dynamo traces it, and how a
compiled module is seen through.

Note: [under torch.compile a region is torch's checkpoint] When ``torch.compile`` traces a checkpointed
region (``torch.compiler.is_compiling()``), ``checkpoint`` runs none of its own dispatch modes, which
Dynamo cannot trace: a region that keeps nothing becomes ``torch.utils.checkpoint.checkpoint(fn,
use_reentrant=False)``, which Dynamo captures as one higher-order op and AOTAutograd's partitioner
recomputes in the backward graph; a region that keeps ops becomes the same call with
``context_fn=create_selective_checkpoint_contexts(...)``, whose policy answers ``MUST_SAVE`` for the ops
the torchckpt policy keeps and ``PREFER_RECOMPUTE`` for the rest (torch's selective activation
checkpointing, the mechanism torchtitan uses). The executor rules that need no dispatch mode of ours hold
there too: views, in-place and random ops are never kept. Buffers written inside a region (BatchNorm
statistics) are functionalised by AOTAutograd and written once by the forward graph, so recomputation
cannot write them twice (Note: [recomputation leaves buffers alone] holds by construction). Not carried
over: the op-by-op recompute check (``debug=True``, ``recompute_checks``; run ``verify_plan`` eagerly) and
``tag`` names (a tag is a no-op under compile, so name-based policies keep nothing there).

Note: [Python side effects run once under compile] Dynamo refuses a checkpointed region whose forward
mutates a Python object from outside it (HF transformers' output-capturing hooks set a context variable
in every decoder layer) and graph-breaks there, because eager checkpointing replays such side effects in
recomputation. A compiled region recomputes inside the backward graph, where no Python runs, so the effect
happens once, as without checkpointing: while any torchckpt handle is applied (``checkpoint_modules``,
``apply``), ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is True, and set back
when the last handle is removed (``SideEffectsOnce``).

Note: [compiled plans keep ops by name and occurrence] A plan's kept ops are positions in the block's
eager forward pass (``save_ops``); a traced graph numbers its ops differently (functionalisation and
decompositions add ops such as ``clone``). So each kept op also carries ``"name#k"``: it is the k-th op of
that name in the block (``PlannedBlock.keep_ops``), and the compiled policy keeps exactly those
occurrences. A ``save_ops`` policy without them (a plan saved by an older torchckpt, a hand-made
``save_ops([...])``) is refused under compile with the fix: re-plan, or pass ``ops=``.

Note: [a compiled model is planned through its original] ``plan``, ``profile``, ``frontier``,
``verify_plan``, ``apply`` and ``checkpoint_modules`` accept a module made by ``torch.compile`` (an
``OptimizedModule``, the original in ``._orig_mod``) and blocks compiled one by one: they act on the
original modules (``uncompiled``), measure eagerly (``torch.compiler.set_stance("force_eager")``, since
the CPU meter is a dispatch mode and cannot see inductor's kernels), and the plan's wraps sit inside the
compiled code, where Dynamo traces them. A module compiled and already run before a plan is applied keeps
its old graph until Dynamo's guards notice the new ``forward``; ``apply`` therefore resets the compiled
module's cache (``torch._dynamo.reset()`` is not needed; see ``forget_compiled_code``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy

if TYPE_CHECKING:
    from torchckpt.executor.policies import Policy

__all__ = ["SideEffectsOnce", "checkpoint_while_compiling", "eager_measurement", "is_compiled_module", "sac_contexts",
           "uncompiled"]


class SideEffectsOnce:
    """Hold Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` True while any holder is alive
    (Note: [Python side effects run once under compile]); ``release()`` once per holder, idempotent.

    Example:
        >>> hold = SideEffectsOnce()
        >>> torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
        True
        >>> hold.release()
    """

    _holders = 0
    _before: bool = False

    def __init__(self) -> None:
        config = torch._dynamo.config
        if SideEffectsOnce._holders == 0:
            SideEffectsOnce._before = bool(config.skip_fwd_side_effects_in_bwd_under_checkpoint)
        SideEffectsOnce._holders += 1
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        self._held = True

    def release(self) -> None:
        """Let go; the last holder puts the user's setting back."""
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

    Each call starts counting ops afresh, as each trace of the region does.

    Example:
        >>> from torchckpt.executor.policies import save_ops
        >>> forward, recompute = sac_contexts(save_ops([1], ops=["aten.mm#0"]))
    """
    from torchckpt.executor.checkpoint import can_keep
    from torchckpt.executor.policies import OpInfo, op_name

    seen: collections.Counter[str] = collections.Counter()
    position = itertools.count()

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op_name(func)
        occurrence, index = seen[name], next(position)
        seen[name] += 1
        if not can_keep(func, tree_flatten(ctx.op_output)[0], None):
            keep = False  # Note: [no view, in-place or random op is kept]
        elif policy.occurrences is not None:
            keep = (name, occurrence) in policy.occurrences
        else:
            keep = policy(OpInfo(func, args, kwargs, index, None))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_checkpoint.create_selective_checkpoint_contexts(decide)


@torch.compiler.disable
def _refuse_positions(policy: Policy) -> None:
    raise RuntimeError(
        f"torchckpt: policy {policy.name!r} keeps ops by their position in the eager forward pass (save_ops without "
        "ops=), which torch.compile's traced graph numbers differently. Fix: make the plan again with this "
        "torchckpt (plans record each kept op as 'name#k'), or build the policy with "
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
        _refuse_positions(policy)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=policy.sac_context_fn, **kwargs)
