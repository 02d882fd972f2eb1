"""A checkpointed call run in slices of the batch, one checkpoint per slice, so that its recomputation in the
backward pass rebuilds one slice's activations at a time.

Rules:

1. **[a slice is a checkpoint of its own]** ``sliced_checkpoint`` splits every tensor argument whose first
   dimension is the batch (the first positional argument's first dimension) into ``slices`` parts
   (``Tensor.tensor_split``: views, no copy), runs ``checkpoint(fn, ...)`` on each part in order and concatenates the
   outputs along the batch. The forward pass keeps what each part's checkpoint keeps (its inputs, views of
   the whole), and the backward pass recomputes the parts one at a time, in reverse.
2. **[slicing must not change the values]** Slicing is exact only for a call whose every sample's output depends
   on that sample alone and that draws no random numbers: no BatchNorm in training, no dropout. This module
   cannot see that; the planner runs the call whole and sliced on the profiled inputs and offers slices only
   where the outputs are bitwise equal (planner/batch_slices.py; a matrix product's kernel may sum in another
   order for another number of rows, so even a plain ``nn.Linear`` is not always exact). Gradients of the
   call's inputs then stay bitwise; those of its parameters are sums over the batch made slice by slice, so
   they equal the unsliced ones to rounding only.
3. **[outputs are joined or refused]** Tensor outputs (also inside tuples and lists) are concatenated along the
   batch; a tensor output without the slice's batch dimension, or any other output that differs between
   slices, raises ``ValueError`` naming it, since no single value would be right.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchckpt.executor.checkpoint import checkpoint
from torchckpt.executor.policies import PolicyLike

__all__ = ["run_in_slices", "sliced_checkpoint"]


def sliced_checkpoint(fn: Callable[..., Any], *args: Any, slices: int, policy: PolicyLike = None,
                      batch: int = 0, **kwargs: Any) -> Any:
    """``checkpoint(fn, *args, **kwargs)`` run as ``slices`` checkpoints over slices of the batch, outputs joined.

    The batch is the first dimension of ``args[0]``; a batch smaller than ``slices`` runs in as many slices as it
    has samples. Only for calls whose samples do not see each other and that draw no random numbers (the
    module docstring's [slicing must not change the values]). ``batch`` > 0: the batch size slicing was checked
    on; a call with another batch (a short last batch) runs as one plain checkpoint, with a ``UserWarning``, since
    another argument's first dimension might then equal the batch by chance and be split wrongly.

    Example:
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(6, 8, requires_grad=True)
        >>> y = sliced_checkpoint(layer, x, slices=3)
        >>> torch.allclose(y, layer(x))  # bitwise where kernels sum alike for any batch (the planner checks)
        True
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([6, 8])
    """
    if batch and args and isinstance(args[0], torch.Tensor) and args[0].dim() and args[0].shape[0] != batch:
        warnings.warn(f"a call planned to run in slices of a batch of {batch} got a batch of {args[0].shape[0]}: it "
                      "runs unsliced (exact, but its recomputation holds the whole batch; the plan's peak was "
                      "predicted for the planned batch)", UserWarning, stacklevel=2)
        return checkpoint(fn, *args, policy=policy, **kwargs)
    return run_in_slices(functools.partial(checkpoint, fn, policy=policy), *args, slices=slices, **kwargs)


def run_in_slices(fn: Callable[..., Any], *args: Any, slices: int, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run on ``slices`` slices of the batch in turn (no checkpoint), outputs joined:
    what ``sliced_checkpoint`` runs inside each of its checkpoints, and what the planner compares with the whole
    call ([slicing must not change the values]).

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> x = torch.randn(4, 4)
        >>> run_in_slices(layer, x, slices=2).shape
        torch.Size([4, 2])
    """
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise ValueError(f"slices={slices!r}: give an int >= 1 (1 runs the call whole)")
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
        raise ValueError("running in slices of the batch: the first positional argument must be a tensor whose "
                         f"first dimension is the batch; got {type(args[0]).__name__ if args else 'no arguments'}")
    batch = args[0].shape[0]
    count = min(slices, batch)
    if count <= 1:
        return fn(*args, **kwargs)
    parts = [fn(*_slice(args, batch, count, i), **{name: _slice(value, batch, count, i)
                                                    for name, value in kwargs.items()})
             for i in range(count)]
    return _join(parts, "the output")


def _slice(value: Any, batch: int, count: int, index: int) -> Any:
    """Part ``index`` of ``count`` of every batch-first tensor in ``value`` (tuples and lists too)."""
    if isinstance(value, torch.Tensor):  # tensor_split: always ``count`` parts (chunk gives fewer for 6 in 4)
        return value.tensor_split(count)[index] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(item, batch, count, index) for item in value)
    return value


def _join(parts: list[Any], where: str) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) and p.dim() and p.dim() == first.dim() for p in parts):
            raise ValueError(f"running in slices of the batch: {where} is a tensor without a batch dimension in "
                             "some slice; this call cannot run in slices of the batch")
        return torch.cat(parts)
    if isinstance(first, (tuple, list)) and all(type(p) is type(first) and len(p) == len(first) for p in parts):
        return type(first)(_join([p[i] for p in parts], f"{where}[{i}]") for i in range(len(first)))
    if all(p is first or (type(p) is type(first) and isinstance(p, (bool, int, float, str)) and p == first)
           for p in parts):
        return first
    raise ValueError(f"running in slices of the batch: {where} ({type(first).__name__}) differs between slices "
                     "and cannot be joined; this call cannot run in slices")
