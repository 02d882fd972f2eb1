"""Realise a Plan on an unmodified model with the executor: ``apply_plan`` (``torchckpt.apply``).

A plan is lowered onto the executor's own pieces: a recomputed block is wrapped (``wrap_forward``) in
a ``checkpoint`` whose policy keeps the plan's ops (``save_ops``), and a region runs its blocks inside
one checkpoint, nesting further checkpoints as its inner plan says. Nothing here measures or decides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt.executor import CheckpointHandle, checkpoint, save_ops, wrap_forward
from torchckpt.executor.batch_slices import sliced_checkpoint
from torchckpt.executor.compiled import EAGER_ONLY, any_compiled, uncompiled
from torchckpt.executor.kv_cache import disable_kv_cache
from torchckpt.executor.loss_head import ChunkedHeadHandle
from torchckpt.executor.offload import Offloader
from torchckpt.executor.optimizer_in_backward import optimizer_in_backward
from torchckpt.executor.optimizer_offload import OptimizerOffload, state_offload_of
from torchckpt.memory.meter import device_of
from torchckpt.planner.blocks import block_pieces, positional_form
from torchckpt.planner.layout import LayoutWatch, fsdp_units_among
from torchckpt.planner.plan import Plan, PlannedBlock, PlannedRegion, PlanPiece, iter_blocks

__all__ = ["apply_plan", "wrap_region"]


def apply_plan(model: nn.Module, plan: Plan, optimizer: torch.optim.Optimizer | None = None) -> CheckpointHandle:
    """Realise ``plan`` on ``model`` in place; returns the handle that undoes it.

    Single blocks are wrapped in a checkpoint that keeps the plan's ops (``save_ops``). A region of
    blocks ``a..b-1`` runs, from block ``a``'s forward, all of its blocks inside one checkpoint (the
    inner plan applied inside), and blocks ``a+1..b-1`` pass their input through. This needs the model
    to call its blocks as a chain (each block's first argument is the previous block's output, the
    other arguments are shared), which the profiler checks before a plan with regions is made. A block whose
    pieces are nested (``PlannedBlock.nested``) also checkpoints each of ``blocks.block_pieces(block)`` inside
    it (those in ``sliced_pieces`` as ``piece_slices`` checkpoints over slices of the batch), and one with
    ``slices`` > 1 runs as that many checkpoints over slices of the batch (``executor/batch_slices.py``). A plan with a
    chunked loss head (``plan.loss_head``) makes that head return deferred logits whose cross-entropy is
    computed in chunks (``executor/loss_head.py``); a loop that reads them whole gets them, with a warning that
    the plan's peak assumed otherwise. A plan made with ``optimizer_in_backward=True`` runs ``optimizer``'s update
    per parameter inside the backward pass (``executor/optimizer_in_backward.py``) until ``remove()``; one made with
    ``optimizer_offload=True`` keeps ``optimizer``'s state in host memory (``executor/optimizer_offload.py``) until
    then. Its offloaded
    blocks (``PlannedBlock.offload``) run through one ``executor/offload.py`` ``Offloader`` with the plan's window
    and host budget; a plan with any is refused on a compiled model (executor/offload.py runs eagerly only).

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> batch = model.example_batch(batch_size=2, seq_len=16)
        >>> plan = torchckpt.plan(model, batch, budget="100%")
        >>> handle = apply_plan(model, plan)
        >>> handle.remove()
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan: expected a torchckpt Plan; got {type(plan).__name__} "
                        "(make one with torchckpt.plan(model, inputs, budget=...) or Plan.load(path))")
    offloaded = [piece for piece in plan.schedule if isinstance(piece, PlannedBlock) and piece.offload]
    compiled = any_compiled(model)  # torch.compile(model), or blocks compiled one by one or in place
    if offloaded and compiled:
        raise ValueError("this plan offloads blocks' activations to host memory, which runs eagerly only (its "
                         "saved-tensor hooks do not run inside compiled graphs): apply it to the model before "
                         "torch.compile, or make a plan with offload=False")
    eager = [piece for piece, _ in iter_blocks(plan.schedule) if piece.nested or piece.slices > 1]
    # Note: [checkpoints nested or sliced are planned for eager runs]
    if eager and compiled:
        raise ValueError(f"this plan has blocks with their pieces nested or run in slices of the batch, which "
                         f"{EAGER_ONLY}: apply it to a model that is not compiled and run it without torch.compile, "
                         "or plan the compiled model (torchckpt.plan(torch.compile(model), ...) leaves these "
                         "options out)")
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    plan.check_fits(model)
    if plan.optimizer_in_backward and optimizer is None:
        raise ValueError("this plan was made with the optimizer's update inside the backward pass "
                         "(optimizer_in_backward=True): pass the optimizer, "
                         "torchckpt.apply(model, plan, optimizer=...)")
    if plan.optimizer_offload and optimizer is None:
        raise ValueError("this plan was made with the optimizer's state in host memory (optimizer_offload=True): "
                         "pass the optimizer, torchckpt.apply(model, plan, optimizer=...)")
    blocks = [uncompiled(model.get_submodule(path)) for path in plan.block_paths]
    wrapped: list[nn.Module] = []
    watch = LayoutWatch(plan)  # planner/layout.py's [a plan names the layout it was made for]
    offloader = Offloader(device_of(model), model, window_bytes=plan.offload.get("window_bytes", 0),
                          host_limit_bytes=plan.offload.get("host_budget_bytes"),
                          offload_inputs=bool(plan.offload.get("inputs", 0))) if offloaded else None
    for piece in plan.schedule:
        if isinstance(piece, PlannedRegion):
            wrap_region(piece, blocks, wrapped, watch)
        elif piece.offload and offloader is not None:  # costs.py's [offloaded blocks]
            wrap_forward(blocks[piece.block], functools.partial(offloader.run, blocks[piece.block].forward), wrapped)
        elif piece.recomputes:
            block = blocks[piece.block]
            policy = save_ops(piece.keep, name=f"plan:{plan.block_paths[piece.block]}",
                              ops=piece.keep_ops if piece.keep_ops or not piece.keep else None)
            if piece.slices > 1:  # executor/batch_slices.py's [a slice is a checkpoint of its own]
                call = functools.partial(sliced_checkpoint, block.forward, slices=piece.slices,
                                         batch=piece.slice_batch, policy=policy)
            else:
                call = functools.partial(checkpoint, block.forward, policy=policy)
            wrap_forward(block, call, wrapped)
            if piece.nested:  # costs.py's [pieces nested inside a block]
                # planner/batch_slices.py's [a refused block's pieces may run in slices]
                for j, child in enumerate(block_pieces(block)):
                    call = functools.partial(sliced_checkpoint, child.forward, slices=piece.piece_slices,
                                             batch=piece.slice_batch) if j in piece.sliced_pieces else \
                        functools.partial(checkpoint, child.forward)
                    wrap_forward(child, call, wrapped)
    if plan.loss_head:  # checked by check_fits: an nn.Linear at that path
        head = model.get_submodule(plan.loss_head["path"])
        chunked = ChunkedHeadHandle(head=head, chunk_tokens=plan.loss_head["chunk_tokens"], warn=True)
        wrap_forward(head, chunked.forward, wrapped)
    # Note: [KV cache off while checkpointing]
    # The profiler measured every step, the plain one too, with the cache off: so is the model under any plan,
    # even one that recomputes nothing, or its peak would differ from the prediction.
    cache_configs = disable_kv_cache([model], while_="a plan is applied", undo="handle.remove()")
    # planner/layout.py's [a plan names the layout it was made for]: seen from the model's own call, outside
    # compiled blocks
    undo = [model.register_forward_pre_hook(lambda _module, _args: watch.see(blocks)).remove]
    try:  # the state offloaded first: the updates inside the backward pass bring it to the device
        if plan.optimizer_offload and state_offload_of(optimizer) is None:  # type: ignore[arg-type]
            undo.append(OptimizerOffload(optimizer).remove)  # type: ignore[arg-type]
        if plan.optimizer_in_backward:
            undo.append(optimizer_in_backward(optimizer).remove)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        CheckpointHandle(wrapped, cache_configs, undo).remove()
        raise
    return CheckpointHandle(wrapped, cache_configs, undo)


def _hidden(output: Any) -> Any:
    """The hidden state a block passes on: the output itself, or its first item when it is a tuple."""
    return output[0] if isinstance(output, tuple) and output else output


def _run_pieces(pieces: Sequence[PlanPiece], forwards: list[Callable[..., Any]], args: tuple, kwargs: dict) -> Any:
    """Run ``pieces`` as a chain from ``args``; nested pieces are checkpointed
    (checkpoint.py's [nested checkpoints keep nothing])."""
    output: Any = None
    for piece in pieces:
        if isinstance(piece, PlannedRegion):
            output = checkpoint(_run_pieces, piece.inner, forwards, args, kwargs)
        elif piece.plain:
            output = forwards[piece.block](*args, **kwargs)
        else:
            output = checkpoint(forwards[piece.block], *args, **kwargs)
        args = (_hidden(output), *args[1:])
    return output


def wrap_region(piece: PlannedRegion, blocks: list[nn.Module], wrapped: list[nn.Module],
                watch: LayoutWatch | None = None) -> None:
    """Wrap ``blocks[piece.start:piece.stop]`` so that they run as one checkpointed region.

    Block ``start`` runs the whole region; the others pass their input through. Wrapped modules are
    appended to ``wrapped`` (``CheckpointHandle(wrapped).remove()`` undoes it). Once any of these blocks is an
    FSDP2 unit (``fully_shard`` after the plan was applied), each runs in its own call, as its own checkpoint
    (planner/layout.py's [a region over FSDP2 units runs block by block]), and ``watch`` is told.

    Example:
        >>> from torchckpt.planner.plan import PlannedBlock
        >>> blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
        >>> inner = (PlannedBlock(block=0, plain=True), PlannedBlock(block=1, plain=True))
        >>> wrapped: list[nn.Module] = []
        >>> wrap_region(PlannedRegion(start=0, stop=2, inner=inner), blocks, wrapped)
        >>> CheckpointHandle(wrapped).remove()
    """
    start, stop = piece.start, piece.stop
    if stop > len(blocks):
        raise ValueError(f"region {start}..{stop - 1} reaches past the model's {len(blocks)} blocks")
    forwards: list[Callable[..., Any]] = [block.forward for block in blocks]
    # What pass-through blocks must return besides the hidden state: the region output's other tuple
    # items. Only those are kept (not the output itself, which would hold the region's graph), and the
    # last pass-through block drops them.
    shape_of_output: dict[str, Any] = {}

    region = blocks[start:stop]

    def region_forward(*args: Any, **kwargs: Any) -> Any:
        if fsdp_units_among(region):  # planner/layout.py's [a region over FSDP2 units runs block by block]
            if watch is not None:
                watch.see(region)
            return checkpoint(forwards[start], *args, **kwargs)
        args, kwargs = positional_form(blocks[start], args, kwargs)  # the hidden state, even if passed by keyword
        if not args:
            raise TypeError(f"a checkpointed region starting at block {start} needs the hidden state as the first "
                            "argument; this call passes none, so plan without regions (regions=False)")
        output = checkpoint(_run_pieces, piece.inner, forwards, args, kwargs)
        shape_of_output["rest"] = tuple(output[1:]) if isinstance(output, tuple) else None
        return output

    def pass_through(*args: Any, index: int, **kwargs: Any) -> Any:
        if fsdp_units_among(region):
            return checkpoint(forwards[index], *args, **kwargs)
        args, kwargs = positional_form(blocks[index], args, kwargs)
        rest = shape_of_output.pop("rest", None) if index == stop - 1 else shape_of_output.get("rest")
        return args[0] if rest is None else (args[0], *rest)

    wrap_forward(blocks[start], region_forward, wrapped)
    for index in range(start + 1, stop):
        wrap_forward(blocks[index], functools.partial(pass_through, index=index), wrapped)
