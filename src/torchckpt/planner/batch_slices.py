"""Which blocks may run in slices of the batch (``profile(..., batch_slices=k)``): those whose outputs are bitwise
equal run whole and in slices, on the profiled inputs.

Rule **[only blocks measured exact are sliced]**: one forward pass runs the model to its last block (and no
further: no loss, no backward pass); before each block runs, its own inputs are run through it whole and then in
``k`` slices (``executor.batch_slices.run_in_slices``, without gradients), each from the same RNG state and
buffers, and the block may be sliced only where every output, every buffer afterwards and the RNG state
afterwards are bitwise equal (executor/batch_slices.py's [slicing must not change the values]), so are the
gradients of its batch inputs for one output gradient drawn from a private generator (its parameters' to
rounding: ``verify.ROUNDING_EPS_FACTOR`` epsilons of the block's largest; a convolution's backward kernel may sum
in another order for fewer samples), and no tensor
argument that slicing passes whole (no batch dimension) needs a gradient, which would be summed slice by slice
outside the block's parameters (a shared relative-position table). A block that draws random numbers (dropout),
mixes samples (BatchNorm in training), counts its calls in a buffer, or whose kernels sum in another order for
fewer rows fails here and keeps its other options; the reason is noted. Parameters, buffers and RNG streams are
put back afterwards, so the check changes nothing the steps measure.

Rule **[a refused block's pieces may run in slices]**: a block refused for what lies between its pieces (the
dropout on a transformer block's residual branches) may still hold pieces that are exact in slices (its attention,
its MLP): each piece of a refused block (``blocks.block_pieces``) is checked as a block is, on its own inputs in
the same pass, and the block's nested option runs those pieces in slices (costs.py's [pieces nested inside a
block]), the rest of the block whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._host import preserved_state
from torchckpt.executor.batch_slices import run_in_slices
from torchckpt.planner.runner import StepRunner
from torchckpt.planner.verify import ROUNDING_EPS_FACTOR

__all__ = ["check_batch_slices", "sliceable_blocks"]


def check_batch_slices(batch_slices: object) -> int:
    """``batch_slices`` checked: an int >= 1 (1: blocks are never sliced).

    Example:
        >>> check_batch_slices(4)
        4
    """
    if isinstance(batch_slices, bool) or not isinstance(batch_slices, int) or batch_slices < 1:
        raise ValueError(f"batch_slices={batch_slices!r}: give an int >= 1, the number of slices of the batch a "
                         "block may be recomputed in (1, the default, never slices)")
    return batch_slices


class _Stop(Exception):
    """Raised after the last block ran: the check needs no loss and no backward pass."""


def sliceable_blocks(runner: StepRunner, blocks: list[nn.Module], slices: int,
                     pieces: list[list[nn.Module]] | None = None) -> list[str]:
    """Per block, why it may not run in ``slices`` slices of the batch ("" where it may), by the module
    docstring's [only blocks measured exact are sliced].

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> runner = StepRunner(model, model.example_batch(batch_size=4, seq_len=16))
        >>> reasons = sliceable_blocks(runner, list(model.blocks), 2)
        >>> len(reasons)
        2
        >>> gpt_with_dropout = gpt("tiny", dropout=0.1)
        >>> runner = StepRunner(gpt_with_dropout, gpt_with_dropout.example_batch(batch_size=4, seq_len=16))
        >>> sliceable_blocks(runner, list(gpt_with_dropout.blocks), 2)[0][:40]
        'its outputs differ run whole and in 2 sl'

    With ``pieces`` (per block, the pieces it may nest: ``blocks.block_pieces``), the same pass also checks the
    pieces of every block refused, each on its own inputs, and lists their reasons after the blocks' (block 0's
    pieces first): [a refused block's pieces may run in slices].
    """
    pieces = pieces or [[] for _ in blocks]
    if len(pieces) != len(blocks):
        raise ValueError(f"pieces: give one list per block ({len(blocks)}); got {len(pieces)}")
    owner = [None] * len(blocks) + [i for i, inside in enumerate(pieces) for _ in inside]
    modules = [*blocks, *(piece for inside in pieces for piece in inside)]
    unreached = "not reached by the forward pass"
    reasons = [unreached] * len(modules)
    batches = [0] * len(blocks)  # each block's batch, as its pieces must see it (the plan slices them so)
    checking = [False]

    def check(index: int) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            block = owner[index]
            if checking[0] or (block is not None and not reasons[block]):  # a sliced block's pieces run whole
                return
            if reasons[index] not in ("", unreached):  # a module called again keeps the failure of any call
                return
            first = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 0
            if block is None:
                batches[index] = first
            elif not first:
                reasons[index] = "it is called without a tensor with a batch dimension as its first positional argument"
                return
            elif first != batches[block]:
                reasons[index] = (f"its first argument's first dimension ({first}) is not its block's batch "
                                  f"({batches[block]})")
                return
            checking[0] = True
            try:
                reasons[index] = _reason(module, args, kwargs, slices)
            except Exception as error:  # noqa: BLE001 - this block only loses the option
                reasons[index] = f"the check failed ({type(error).__name__}: {str(error)[:120]})"
            finally:
                checking[0] = False
        return pre_hook

    def stop(module: nn.Module, args: tuple, output: Any) -> None:
        if not checking[0]:
            raise _Stop

    handles = [module.register_forward_pre_hook(check(i), with_kwargs=True) for i, module in enumerate(modules)]
    if blocks:
        handles.append(blocks[-1].register_forward_hook(stop))
    try:
        # gradients on, so that an argument that needs one is seen ([only blocks measured exact are sliced]);
        # the runs it compares go without; the forward pass stops after the last block, before any backward pass
        with preserved_state(runner.model), contextlib.suppress(_Stop):
            runner.forward_backward()
    except Exception as error:  # noqa: BLE001 - a model that cannot run this way only loses the option
        return [reason or f"the check failed ({type(error).__name__}: {str(error)[:120]})" for reason in reasons]
    finally:
        for handle in handles:
            handle.remove()
    return [reason if block is None or reasons[block] else "its block runs in slices"
            for reason, block in zip(reasons, owner)]


@torch.no_grad()
def _reason(block: nn.Module, args: tuple, kwargs: dict, slices: int) -> str:
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
        return "its first argument is not a tensor with a batch dimension"
    if args[0].shape[0] < 2:
        return "a batch of one sample"
    batch = args[0].shape[0]
    shared = [name for name, value in _unsplit_tensors(args, kwargs, batch) if value.requires_grad]
    if shared:  # its gradient would be summed slice by slice, outside the block's own parameters
        return (f"its argument {shared[0]} needs a gradient and has no batch dimension, so its gradient would be "
                "summed slice by slice")
    devices = [args[0].device] if args[0].device.type == "cuda" else []
    buffers = [b for b in block.buffers()]
    start = [b.detach().clone() for b in buffers]
    try:
        with torch.random.fork_rng(devices=devices):
            whole = block(*args, **kwargs)
            after_whole = (torch.get_rng_state(), [b.detach().clone() for b in buffers])
        for b, value in zip(buffers, start):
            b.copy_(value)
        with torch.random.fork_rng(devices=devices):
            sliced = run_in_slices(block, *args, slices=slices, **kwargs)
            after_sliced = (torch.get_rng_state(), [b.detach().clone() for b in buffers])
        for b, value in zip(buffers, start):
            b.copy_(value)
        count = min(slices, batch)
        backward = _backward_reason(block, args, kwargs, slices) if _equal(whole, sliced) else ""
    except Exception as error:  # noqa: BLE001 - any failure only means: not this block
        return f"it cannot run in slices of the batch ({type(error).__name__}: {str(error)[:120]})"
    finally:
        for b, value in zip(buffers, start):
            b.copy_(value)
    if not _equal(whole, sliced):
        return (f"its outputs differ run whole and in {count} slices of the batch (random ops such as dropout, "
                "samples that see each other such as BatchNorm, or kernels that sum in another order for fewer rows)")
    if not _equal(after_whole, after_sliced):
        return (f"run in {count} slices it leaves its buffers or the random number generator otherwise than run "
                "whole (a buffer it writes, or random numbers it draws)")
    return backward


def _backward_reason(block: nn.Module, args: tuple, kwargs: dict, slices: int) -> str:
    """Why the block's backward pass is not exact in slices: its inputs' gradients must be bitwise equal, its
    parameters' equal to rounding (``verify.ROUNDING_EPS_FACTOR`` epsilons of the block's largest gradient), for
    one output gradient drawn from a private generator."""
    batch = args[0].shape[0]
    params = [p for p in block.parameters() if p.requires_grad]

    def gradients(fn: Callable[..., Any]) -> list[torch.Tensor | None]:
        leaves: list[torch.Tensor] = []

        def leaf(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch and \
                    value.is_floating_point():
                leaves.append(value.detach().requires_grad_())
                return leaves[-1]
            if isinstance(value, (tuple, list)):
                return type(value)(leaf(item) for item in value)
            return value
        call_args, call_kwargs = leaf(args), {name: leaf(value) for name, value in kwargs.items()}
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            outputs = [t for t in tree_flatten(fn(*call_args, **call_kwargs))[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
        generator = torch.Generator().manual_seed(0)
        seeds = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t.device) for t in outputs]
        wanted: list[torch.Tensor] = [*leaves, *params]
        found = torch.autograd.grad(outputs, wanted, seeds, allow_unused=True) if outputs else ()
        return list(found)

    whole = gradients(block)
    sliced = gradients(lambda *a, **k: run_in_slices(block, *a, slices=slices, **k))
    inputs = len(whole) - len(params)
    if not all(_equal(a, b) for a, b in zip(whole[:inputs], sliced[:inputs])):
        return (f"its inputs' gradients differ run whole and in {min(slices, batch)} slices of the batch (a backward "
                "kernel that sums in another order for fewer samples, as some convolutions do)")
    largest = max((g.abs().max().item() for g in whole[inputs:] if g is not None and g.numel()), default=0.0)
    for param, a, b in zip(params, whole[inputs:], sliced[inputs:]):
        if (a is None) != (b is None):
            return "its parameters' gradients differ run whole and in slices"
        if a is not None and b is not None and (a - b).abs().max().item() > (
                ROUNDING_EPS_FACTOR * torch.finfo(param.dtype).eps * largest):
            return (f"its parameters' gradients differ run whole and in {min(slices, batch)} slices by more than "
                    f"rounding ({ROUNDING_EPS_FACTOR} epsilons of the block's largest gradient)")
    return ""


def _unsplit_tensors(args: tuple, kwargs: dict, batch: int) -> list[tuple[str, torch.Tensor]]:
    """The tensor arguments (by name) that slicing passes whole: those without the batch as first dimension."""
    found: list[tuple[str, torch.Tensor]] = []

    def visit(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if not (value.dim() and value.shape[0] == batch):
                found.append((name, value))
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                visit(f"{name}[{i}]", item)
    for i, value in enumerate(args):
        visit(f"#{i}", value)
    for key, value in kwargs.items():
        visit(key, value)
    return found


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a is b or a == b
