"""The executor: non-reentrant activation checkpointing with save policies and a recompute check.

``checkpoint(fn, *args, policy=...)`` runs ``fn`` without keeping its intermediate activations, except
the op outputs the policy keeps, and recomputes the rest when the backward pass needs them.

Design rules (named so code and tests can point at them; collected in docs/design.md):

1. **[non-reentrant only]** Always non-reentrant: built on
   ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so kwargs, nested structures, non-tensor
   outputs, inputs that do not require grad, nested checkpoints and ``torch.autograd.grad`` all work.
   The reentrant variant is refused (it loses parameter gradients when no input requires grad, and it
   does not support ``torch.autograd.grad``).
2. **[recomputation replays the RNG]** RNG state is stashed at the forward and restored for
   recomputation, so dropout inside gives the same masks, and gradients bitwise equal to the
   uncheckpointed function.
3. **[recomputation is checked]** A region runs under two dispatch modes of ours: the forward mode
   records every op (name, output shapes and dtypes) and keeps the outputs the policy chooses; the
   recompute mode replays them in order, serves kept outputs from the cache and checks every recomputed
   op against the record, so a function whose recomputation differs from its forward fails loudly,
   naming the op and the tensor.
4. **[detach is invisible]** ``aten.detach`` is invisible to both modes: autograd's own bookkeeping
   detaches saved tensors during recomputation but not during the forward pass.
5. **[the executor overrides the policy]** The policy rules of ``policies.py`` hold whatever the policy
   says: policies.py's [no view, in-place or random op is kept] and policies.py's [a value written in place is
   recomputed]
   (views, in-place and random ops are never kept; kept values modified in place later, inside or after
   the region, are recomputed instead of served).
6. **[nested checkpoints keep nothing]** A checkpoint nested inside another checkpointed region keeps
   nothing (its policy acts as ``nothing_saveable``). Its cache would be a plain Python reference that
   the enclosing region's saved-tensor hooks cannot see, so it would stay alive through the whole
   forward pass and defeat the enclosing checkpoint; the enclosing region recomputes the inner one
   anyway. Inputs of the inner region are saved through autograd by PyTorch, so the enclosing region
   holds only its own inputs, as nesting promises.
7. **[kept outputs are handed over once]** A kept output is handed over once: recomputation takes it
   out of the cache, so autograd frees it as the backward pass goes, exactly like a tensor it saved
   itself. A second backward through the same graph (``retain_graph=True``) recomputes it instead.
8. **[recomputation leaves buffers alone]** Recomputation writes nothing that outlives it: a tensor that
   existed before recomputation began (a BatchNorm's ``running_mean``, ``running_var`` and
   ``num_batches_tracked``, a counter buffer, anything the function writes in place but did not create)
   and is written in place during it is copied when it is first written and put back when recomputation
   ends (``outer_writes.py``: ``WriteLog``, ``UndoOuterWrites``). So buffers end exactly as after the
   forward pass (updated once, as without checkpointing), while the recomputed activations are bitwise
   the forward's: a BatchNorm in training mode normalises with the batch's statistics in both, and only
   its bookkeeping writes are undone. Only what recomputation writes is copied (BatchNorm statistics are
   small), and only while it runs.
9. **[a region that keeps nothing runs on torch's checkpoint alone]** When the policy keeps nothing
   (``nothing_saveable``, a plan's block that keeps no op, any nested region) and no check was asked
   for, the forward pass runs under torch's non-reentrant checkpoint with no dispatch mode of ours:
   nothing is recorded, so the forward costs what ``torch.utils.checkpoint`` costs. Its recomputation
   runs under ``UndoOuterWrites`` only (rule 8 holds; the per-op check of rule 3 is skipped, torch's
   own ``determinism_check`` still compares the recomputed tensors' shapes and dtypes). Rule 3's check
   runs for every region inside ``recompute_checks()`` (``verify_plan`` uses it) or with
   ``checkpoint(..., debug=True)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchckpt.executor.compiled import checkpoint_while_compiling
from torchckpt.executor.outer_writes import WriteLog
from torchckpt.executor.plain_regions import CountsRegion, plain_contexts
from torchckpt.executor.policies import (
    TAG_STATE,
    OpInfo,
    Policy,
    PolicyLike,
    can_keep,
    everything_saveable,
    nothing_saveable,
    op_name,
    resolve_policy,
)

__all__ = ["CheckpointRecord", "RecomputationMismatchError", "RematError", "checkpoint",
           "checkpoint_sequential", "function_name", "run_recorded"]

_IGNORED_OPS = frozenset({torch.ops.aten.detach.default})
_TAG_OP = torch.ops.aten.alias.default
_DEBUG_TIP = ("Debugging tip: run the function twice on the same inputs outside checkpoint and compare; "
              "anything that changes between the calls changes between forward and recomputation.")


class RematError(RuntimeError):
    """An activation-checkpointed region was used in a way torchckpt cannot make correct.

    (Errors about saved training state are ``torchckpt.CheckpointError``.)
    """


class RecomputationMismatchError(RematError):
    """Recomputation of a checkpointed function did not reproduce its forward pass."""


@dataclass(frozen=True)
class _OpRecord:
    name: str
    outputs: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]  # per flat output: (shape, dtype)


def _describe_outputs(flat: list[Any]) -> tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]:
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in flat)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


@dataclass
class CheckpointRecord:
    """What one checkpoint call remembers between its forward pass and its recomputation.

    ``records`` lists every op of the forward pass in order; ``cache`` holds the outputs the policy kept,
    by op index. ``saved_residuals`` reads both after a forward pass run with :func:`run_recorded`.

    Example:
        >>> record = CheckpointRecord(policy=resolve_policy("dots_saveable"), fn_name="`f`")
        >>> len(record.records), len(record.cache)
        (0, 0)
    """

    policy: Policy
    fn_name: str
    records: list[_OpRecord] = field(default_factory=list)
    cache: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict)  # index -> (spec, flat outputs)
    cache_storages: dict[int, set[int]] = field(default_factory=dict)  # storage key -> cached indices
    cache_versions: dict[int, list[int]] = field(default_factory=dict)  # index -> version counters at keep

    def keep(self, index: int, flat: list[Any], spec: Any) -> None:
        # Below autograd, detach() would get a fresh version counter; with ADInplaceOrView re-enabled it
        # shares the output's, so writes made later (even by the caller, after the region) are visible.
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            kept = [v.detach() for v in flat]
        self.cache[index] = (spec, kept)
        self.cache_versions[index] = [v._version for v in kept]
        for value in flat:
            key = _storage_key(value)
            if key is not None:
                self.cache_storages.setdefault(key, set()).add(index)

    def forget_mutated(self, args: tuple, kwargs: dict) -> None:
        """A kept value written in place is dropped, so recomputation rebuilds it.
        [the executor overrides the policy]."""
        for value in tree_flatten((args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                key = _storage_key(value)
                for index in self.cache_storages.pop(key, ()) if key is not None else ():
                    self.cache.pop(index, None)

    def serve(self, index: int) -> Any | None:
        """Hand a kept output to recomputation and drop the cache's reference; None when the value was
        modified in place since it was kept (even after the region returned): recompute it.
        [kept outputs are handed over once]."""
        spec, flat = self.cache.pop(index)
        versions = self.cache_versions.pop(index)
        for value in flat:
            key = _storage_key(value)
            indices = self.cache_storages.get(key) if key is not None else None
            if indices is not None:
                indices.discard(index)
        if [v._version for v in flat] != versions:
            return None
        return tree_unflatten([v.detach() for v in flat], spec)


class _RegionMode(CountsRegion, TorchDispatchMode):
    """A region's dispatch mode; entering it counts an active region so ``tag`` knows whether to act."""

    def __init__(self, region: CheckpointRecord) -> None:
        super().__init__()
        self.region = region


class _ForwardMode(_RegionMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED_OPS:
            return func(*args, **kwargs)
        region = self.region
        tag_name = TAG_STATE.pending_name if func is _TAG_OP else None
        if func._schema.is_mutable and region.cache:
            region.forget_mutated(args, kwargs)
        out = func(*args, **kwargs)
        flat, spec = tree_flatten(out)
        index = len(region.records)
        region.records.append(_OpRecord(op_name(func), _describe_outputs(flat)))
        if can_keep(func, flat, tag_name) and region.policy(OpInfo(func, args, kwargs, index, tag_name)):
            region.keep(index, flat, spec)
        return out


class _RecomputeMode(_RegionMode):
    def __init__(self, region: CheckpointRecord) -> None:
        super().__init__(region)
        self.position = 0
        self.writes = WriteLog()

    def __enter__(self) -> _RecomputeMode:
        self.position = 0
        return super().__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
        self.writes.restore()  # [recomputation leaves buffers alone]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED_OPS:
            return func(*args, **kwargs)
        region, index = self.region, self.position
        self.position += 1
        name = op_name(func)
        if index >= len(region.records):
            raise RecomputationMismatchError(
                f"checkpoint: recomputing {region.fn_name} ran more ops than its forward pass "
                f"({len(region.records)}); op #{index} is {name}. Likely cause: control flow that depends on "
                f"global state (a flag, a counter, a module attribute) changed between forward and backward. "
                f"Fix: pass such values as arguments. {_DEBUG_TIP}")
        record = region.records[index]
        if record.name != name:
            raise RecomputationMismatchError(
                f"checkpoint: recomputing {region.fn_name} diverged from its forward pass at op #{index}: "
                f"the forward pass ran {record.name}, recomputation ran {name}. Likely cause: control flow "
                f"that depends on global state or randomness outside torch's RNG. Fix: make the function depend "
                f"only on its inputs. {_DEBUG_TIP}")
        out = region.serve(index) if index in region.cache else None
        served = out is not None
        if out is None:
            self.writes.before(func, args, kwargs)
            out = func(*args, **kwargs)
        flat = tree_flatten(out)[0]
        self.writes.note_outputs(func, flat, served)
        self._check(index, record, flat)
        return out

    def _check(self, index: int, record: _OpRecord, flat: list[Any]) -> None:
        found = _describe_outputs(flat)
        if found == record.outputs:
            return
        # the first output that differs; when every paired one matches, the counts differ
        before: Any
        after: Any
        position, before, after = len(found), record.outputs, found
        for i, (recorded, recomputed) in enumerate(zip(record.outputs, found)):
            if recorded != recomputed:
                position, before, after = i, recorded, recomputed
                break
        raise RecomputationMismatchError(
            f"checkpoint: recomputing {self.region.fn_name} produced a different tensor than its forward pass: "
            f"output {position} of op #{index} ({record.name}) had {_fmt(before)} in the forward pass and "
            f"{_fmt(after)} in recomputation. Likely cause: nondeterminism or global state that changed between "
            f"forward and backward (a shape read from a mutable attribute, a dtype flag, a data-dependent "
            f"branch). Fix: make the function depend only on its inputs. {_DEBUG_TIP}")


def _fmt(meta: Any) -> str:
    if isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], torch.dtype):
        return f"shape {tuple(meta[0])} dtype {meta[1]}"
    return repr(meta)


def function_name(fn: Callable) -> str:
    """How error messages name ``fn``: its qualified name in backquotes.

    Example:
        >>> function_name(len)
        '`len`'
    """
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"`{name}`"


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
    use_reentrant: bool = False,
    debug: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only what ``policy`` saves; recompute the rest in backward.

    Args:
        fn: any callable (a module, a function); its outputs may be any nested structure.
        *args, **kwargs: passed to ``fn`` unchanged.
        policy: what to keep: None (= ``"nothing_saveable"``), a policy name, a :class:`Policy` or a
            callable ``(OpInfo) -> bool``. ``"everything_saveable"`` runs ``fn`` plainly.
        preserve_rng_state: restore RNG state for recomputation (dropout gives identical masks).
        use_reentrant: only ``False`` is accepted ([non-reentrant only]).
        debug: record the forward pass and check its recomputation op by op
            (``RecomputationMismatchError``) even when the policy keeps nothing; see
            ``recompute_checks()`` and [a region that keeps nothing runs on torch's checkpoint alone].

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = checkpoint(layer, x, policy="dots_saveable")
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    if use_reentrant:
        raise ValueError(
            "checkpoint(use_reentrant=True) is not supported: the reentrant variant drops parameter gradients "
            "when no input requires grad (frozen embeddings, LoRA), cannot be used with torch.autograd.grad, "
            "and cannot nest or keep selected activations. torchckpt always uses the non-reentrant "
            "implementation; remove the use_reentrant argument.")
    if not callable(fn):
        raise TypeError(f"checkpoint(fn, ...): fn must be callable; got {type(fn).__name__}")
    if not isinstance(debug, bool):
        raise TypeError(f"checkpoint(debug=...): expected a bool; got {type(debug).__name__}")
    resolved = resolve_policy(policy)
    if resolved is everything_saveable or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():  # Note: [under torch.compile a region is torch's checkpoint]
        return checkpoint_while_compiling(fn, args, kwargs, resolved)
    if TAG_STATE.active_regions:  # [nested checkpoints keep nothing]
        resolved = nothing_saveable
    if resolved.keeps_nothing and not debug and not TAG_STATE.checks:
        # [a region that keeps nothing runs on torch's checkpoint alone]
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                           context_fn=plain_contexts, **kwargs)
    region = CheckpointRecord(policy=resolved, fn_name=function_name(fn))
    return run_recorded(region, fn, args, kwargs, preserve_rng_state)


def run_recorded(region: CheckpointRecord, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 preserve_rng_state: bool) -> Any:
    """Run ``fn`` under a non-reentrant checkpoint whose forward and recompute modes share ``region``.

    Example:
        >>> record = CheckpointRecord(policy=resolve_policy("dots_saveable"), fn_name="`f`")
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> y = run_recorded(record, torch.nn.Linear(3, 3), (x,), {}, preserve_rng_state=True)
        >>> [record.records[index].name for index in record.cache]
        ['aten.addmm']
    """
    context_fn = functools.partial(_region_contexts, region)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                       context_fn=context_fn, **kwargs)


def _region_contexts(region: CheckpointRecord) -> tuple[_ForwardMode, _RecomputeMode]:
    return _ForwardMode(region), _RecomputeMode(region)


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,  # noqa: A002 - the name torch.utils.checkpoint uses
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
) -> Any:
    """Run a chain of functions in ``segments`` pieces, checkpointing every piece but the last.

    Like ``torch.utils.checkpoint.checkpoint_sequential``: the last segment runs plainly because its
    activations are needed first in the backward pass. Segments are as equal as possible.

    Example:
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> checkpoint_sequential(chain, 3, x).shape
        torch.Size([2, 8])
    """
    layers = list(functions.children()) if isinstance(functions, torch.nn.Sequential) else list(functions)
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= max(len(layers), 1):
        raise ValueError(f"checkpoint_sequential: segments must be an int from 1 to the number of functions "
                         f"({len(layers)}); got {segments!r}")
    if not layers:
        raise ValueError("checkpoint_sequential: functions is empty; give at least one callable")
    bounds = [round(i * len(layers) / segments) for i in range(segments + 1)]

    def run(start: int, stop: int, value: Any) -> Any:
        for layer in layers[start:stop]:
            value = layer(value)
        return value

    for start, stop in zip(bounds[:-2], bounds[1:-1]):
        input = checkpoint(functools.partial(run, start, stop), input, policy=policy,
                           preserve_rng_state=preserve_rng_state)
    return run(bounds[-2], bounds[-1], input)
