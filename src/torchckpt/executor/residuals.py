"""``saved_residuals``: what a call keeps for its backward pass under a policy, like JAX's
``print_saved_residuals``.

Counting rules: a residual is a storage, counted once however many tensors view it. Inputs of a
checkpointed call are residuals (the checkpoint holds them for recomputation); parameters are listed
but are not activation memory; everything else is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchckpt._units import format_bytes
from torchckpt.executor.checkpoint import CheckpointRecord, function_name, run_recorded
from torchckpt.executor.policies import PolicyLike, everything_saveable, op_name, resolve_policy

__all__ = ["Residual", "SavedResiduals", "saved_residuals"]


@dataclass(frozen=True, kw_only=True)
class Residual:
    """One tensor kept for the backward pass.

    ``source`` is ``"input"``, ``"parameter"`` or the op that produced it (``"aten.mm"``); ``nbytes`` is
    its storage's size, 0 when an earlier residual already counted that storage.
    """

    source: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class SavedResiduals:
    """The residuals of one call; ``str()`` is a table."""

    function: str
    policy: str
    residuals: tuple[Residual, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of every distinct storage kept, parameters excluded."""
        return sum(r.nbytes for r in self.residuals if r.source != "parameter")

    @property
    def input_bytes(self) -> int:
        """Bytes of kept inputs (memory the caller's tensors already occupy)."""
        return sum(r.nbytes for r in self.residuals if r.source == "input")

    @property
    def activation_bytes(self) -> int:
        """Bytes the call adds to memory until backward: kept values that are neither inputs nor parameters."""
        return self.total_bytes - self.input_bytes

    def table(self) -> str:
        """A fixed-width table: one row per residual, then the totals."""
        rows = [f"saved residuals of {self.function} under policy {self.policy}",
                f"{'source':<48} {'shape':<22} {'dtype':<10} {'bytes':>12}"]
        for r in self.residuals:
            shared = "" if r.nbytes or r.source == "parameter" else " (shares storage)"
            rows.append(f"{r.source + shared:<48} {str(tuple(r.shape)):<22} {str(r.dtype).replace('torch.', ''):<10} "
                        f"{format_bytes(r.nbytes):>12}")
        rows.append(f"total {format_bytes(self.total_bytes)} = inputs {format_bytes(self.input_bytes)} "
                    f"+ activations {format_bytes(self.activation_bytes)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


class _Producers(TorchDispatchMode):
    """Remember which op produced each storage (for naming what autograd saves)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_storage: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.by_storage.setdefault(value.untyped_storage().data_ptr(), op_name(func))
        return out


class _Collector:
    def __init__(self, parameters: set[int]) -> None:
        self.parameters = parameters
        self.seen: set[int] = set()
        self.residuals: list[Residual] = []

    def add(self, tensor: torch.Tensor, source: str) -> None:
        key = tensor.untyped_storage().data_ptr()
        if key in self.parameters or isinstance(tensor, torch.nn.Parameter):
            source = "parameter"
        nbytes = 0 if key in self.seen or source == "parameter" else tensor.untyped_storage().nbytes()
        self.seen.add(key)
        self.residuals.append(Residual(source=source, shape=tuple(tensor.shape), dtype=tensor.dtype, nbytes=nbytes))


def saved_residuals(fn: Callable[..., Any], *args: Any, policy: PolicyLike = None, **kwargs: Any) -> SavedResiduals:
    """Run ``checkpoint(fn, *args, policy=policy, **kwargs)`` forward once and list what it keeps.

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> report = saved_residuals(layer, x, policy="dots_saveable")
        >>> [r.source for r in report.residuals]
        ['input', 'aten.addmm', 'aten.addmm']
        >>> report.activation_bytes
        384
    """
    resolved = resolve_policy(policy)
    parameters = {p.untyped_storage().data_ptr() for p in _parameters_of(fn)}
    collector = _Collector(parameters)
    with torch.enable_grad():
        if resolved is everything_saveable:
            _collect_plain(fn, args, kwargs, collector)
        else:
            region = CheckpointRecord(policy=resolved, fn_name=function_name(fn))
            output = run_recorded(region, fn, args, kwargs, preserve_rng_state=True)
            for value in tree_flatten((args, kwargs))[0]:
                if isinstance(value, torch.Tensor):
                    collector.add(value, "input")
            for index in sorted(region.cache):
                for value in region.cache[index][1]:
                    collector.add(value, region.records[index].name)
            del output
    return SavedResiduals(function=function_name(fn), policy=resolved.name, residuals=tuple(collector.residuals))


def _collect_plain(fn: Callable[..., Any], args: tuple, kwargs: dict, collector: _Collector) -> None:
    inputs = {v.untyped_storage().data_ptr() for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor.detach()  # not the tensor itself: see planner/probe.py's pack (a cycle the collector misses)

    with _Producers() as producers, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = fn(*args, **kwargs)
    for tensor in saved:
        key = tensor.untyped_storage().data_ptr()
        collector.add(tensor, "input" if key in inputs else producers.by_storage.get(key, "unknown"))
    # autograd keeps ``pack`` (and so this list) alive as long as the graph; the list holds the graph's own
    # outputs: empty it, or the two keep each other alive in a cycle the collector cannot see
    saved.clear()
    del output


def _parameters_of(fn: Callable[..., Any]) -> list[torch.Tensor]:
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []
