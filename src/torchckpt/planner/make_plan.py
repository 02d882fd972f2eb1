"""plan(): profile -> solve -> Plan. Measuring lives in profile.py, deciding in solve/, turning a solution into a
Plan in from_costs.py.

Budgets are the whole step's peak (parameters, gradients, optimizer state, activations, transients):
an int of bytes, a size string ("6GiB", "800MB"), or a percentage ("60%") of the predicted peak
without checkpointing (which the profiler measures, so it equals the measured plain peak).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchckpt._progress import phase
from torchckpt._units import parse_bytes, parse_percent
from torchckpt.executor.compiled import any_compiled, uncompiled
from torchckpt.planner.batch_slices import check_batch_slices
from torchckpt.planner.from_costs import check_margin_form, plan_from_costs
from torchckpt.planner.offload_step import check_offload_args
from torchckpt.planner.optimizer_options import check_optimizer_options
from torchckpt.planner.plan import Plan, fingerprint
from torchckpt.planner.profile import profile
from torchckpt.planner.runner import StepFn, check_micro_batches

__all__ = ["plan"]


def plan(model: nn.Module, example_inputs: tuple | dict, budget: int | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
         blocks: str | Sequence[nn.Module] = "auto", regions: bool = True, step_fn: StepFn | None = None,
         margin: int | float | str = "auto", loss_head: bool | str = True, pieces: bool = True,
         optimizer_in_backward: bool = False, micro_batches: int = 1, batch_slices: int = 1,
         offload: bool = False, host_budget: int | str | None = None, optimizer_offload: bool = False) -> Plan:
    """Measure ``model`` and return the plan with the least predicted recompute time within ``budget``.

    The budget covers the whole step as the profiler runs it: by default ``loss = (loss_fn or
    default_loss)(model(*inputs))``, the output deleted before ``loss.backward()``. A loop that keeps the
    output (the logits) through backward peaks that much higher: pass it as ``step_fn(model,
    example_inputs)``, which runs the forward, calls ``backward()`` itself and returns the loss
    (``runner.StepRunner``; not together with ``loss_fn``), and the plan is made for that loop.

    ``regions=False`` plans single blocks only (no blocks checkpointed together as a region); plans have
    no regions either when the profiler cannot prove that a region computes exactly what the model does
    (``Plan.notes["regions"]`` says why).

    ``loss_head``: the LM head may compute its logits and cross-entropy in chunks of tokens where the budget needs
    it and the loop never reads the logits whole (True: the head is found; a module path; False: never).
    Every gradient stays bitwise but the head weight's (and what it is tied to), equal to rounding.
    ``pieces``: a block may also be checkpointed with its pieces (attention, MLP, norms: ``blocks.block_pieces``)
    checkpointed inside it, so that recomputing it peaks lower (False: never).
    ``optimizer_in_backward=True`` (opt-in; needs ``optimizer``) plans with the optimizer's update run per
    parameter inside the backward pass, so gradients do not all live at once; apply the plan with
    ``torchckpt.apply(model, plan, optimizer=optimizer)``. Not with gradient clipping, GradScaler or gradient
    accumulation (executor/optimizer_in_backward.py's [what needs every gradient is refused]).

    ``optimizer_offload=True`` (opt-in; needs ``optimizer``) keeps the optimizer's state (AdamW's: twice the
    parameters) in host memory between steps and brings one parameter's state to the device at a time for its
    update (executor/optimizer_offload.py), bitwise the optimizer's own step; the profiler measures that step's peak.
    Apply the plan with ``torchckpt.apply(model, plan, optimizer=optimizer)``. Not with ``step(closure)``.

    ``micro_batches`` (gradient accumulation: backward passes per optimizer step, 1 by default): the budget then
    holds on every micro-batch, the later ones finding the earlier ones' gradients alive (Note: [a later
    micro-batch peaks highest]); ``step_fn`` then runs one micro-batch.

    ``batch_slices`` k > 1 (opt-in, one process): a block whose outputs are bitwise equal run whole and in k
    slices of the batch may be recomputed slice by slice (``profile``), so that its recomputation holds one
    slice's activations; the gradients of such a block's parameters, summed slice by slice, then equal the
    unsliced ones to rounding (``verify_plan`` compares them so), every other gradient stays bitwise. Not with
    ``optimizer_in_backward=True`` (the update inside the backward pass can magnify that rounding).

    ``offload=True`` (opt-in, one process, eager): a block may instead run plainly with the activations it saves
    moved to host memory in its forward pass and brought back, bitwise, for its backward (executor/offload.py),
    where that is faster than recomputing it; ``host_budget`` (bytes or a size string; None: half the host memory
    available when planning) bounds the host memory the plan's offloaded activations take at once
    (``Plan.offload``). On the CPU the "host" is a second, separately counted pool of the same memory, which tests
    and teaches the plans; on CUDA it is pinned host memory, the copies overlapping compute on a side stream.

    ``margin`` is kept below the budget by plans the profiler did not measure (``resolve_margin``):
    ``"auto"`` (64 KiB plus 0.5% of the plain step's activations), bytes, or a share of the budget. No
    checkpointing and every block checkpointed (``gradient_checkpointing_enable()``) are measured, so
    they need none: a budget equal to the measured peak of checkpointing every block is always feasible.

    Raises ``InfeasibleBudgetError`` (a ValueError) naming the smallest feasible peak and its parts when
    the budget is below the floor; a malformed budget or margin is refused before anything is measured.
    To plan several budgets from one measurement, ``torchckpt.profile(...)`` then
    ``ChainCosts.plan(budget)``. The model,
    ``optimizer`` and RNG streams are left exactly as they were (Note: [planning changes nothing]).

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> batch = model.example_batch(batch_size=2, seq_len=32)
        >>> torchckpt.plan(model, batch, budget="100%").predicted_extra_time_s
        0.0
    """
    if parse_percent(budget, option="budget") is None:  # a bad budget fails before minutes of profiling
        parse_bytes(budget, option="budget")
    check_margin_form(margin)
    check_micro_batches(micro_batches)
    check_batch_slices(batch_slices)
    check_offload_args(offload, host_budget)
    check_optimizer_options(optimizer, optimizer_in_backward=optimizer_in_backward, optimizer_offload=optimizer_offload,
                            micro_batches=micro_batches, batch_slices=batch_slices)
    if offload and any_compiled(model):
        raise ValueError("offload=True plans run eagerly only (saved-tensor hooks do not run inside compiled "
                         "graphs): plan the model before torch.compile, or plan with offload=False")
    # the blocks as profiled: "auto" is taken in the order the blocks run (profile's rule)
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    costs = profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, blocks=blocks, regions=regions,
                    step_fn=step_fn, loss_head=loss_head, pieces=pieces,
                    optimizer_in_backward=optimizer_in_backward, micro_batches=micro_batches,
                    batch_slices=batch_slices, offload=offload, host_budget=host_budget,
                    optimizer_offload=optimizer_offload)
    paths = list(costs.block_paths)
    phase("solving")  # _progress.py's [quiet unless an application listens]
    return plan_from_costs(costs, budget, block_paths=paths,
                           model_fingerprint=fingerprint(model, example_inputs, paths), regions=regions, margin=margin)

