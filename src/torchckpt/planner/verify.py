"""verify_plan(): run one step with a plan and one without; compare measured peak, gradients and buffers.

This is the proof a plan carries: the measured peak (MemoryMeter) against the budget and the
prediction, and gradients and buffers (BatchNorm statistics) bitwise against the uncheckpointed model
(same RNG, so the same dropout; both steps start from the same buffers; Note: [checkpointing is exact]).
The reference gradients and buffers are kept as NumPy byte arrays, outside tensor memory, so that
keeping them does not inflate the measured peak of the planned step. The model's parameters, buffers,
gradients and modes come back as they were (``_host.preserved_state``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from torchckpt._host import host_bytes, paused_gc, preserved_rng, preserved_state
from torchckpt._units import format_bytes
from torchckpt.executor import recompute_checks
from torchckpt.executor.compiled import eager_measurement, uncompiled
from torchckpt.executor.kv_cache import kv_cache_off
from torchckpt.executor.optimizer_offload import state_offload_of
from torchckpt.memory import MemoryMeter, synchronize
from torchckpt.planner.apply import apply_plan
from torchckpt.planner.blocks import block_pieces
from torchckpt.planner.plan import Plan, iter_blocks
from torchckpt.planner.runner import StepFn, StepRunner

__all__ = ["VerifyReport", "compare_gradients", "loss_head_parameters", "verify_plan"]


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Measured against predicted for one training step under a plan."""

    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    no_checkpointing_peak_bytes: int
    gradients_equal: bool
    max_gradient_difference: float
    buffers_equal: bool
    first_differing_buffer: str | None  # its name in ``named_buffers()``; None when all are equal
    step_time_s: float
    no_checkpointing_step_time_s: float
    rounding_only: tuple[str, ...] = ()  # parameters compared to rounding: the chunked loss head's, sliced blocks'
    rounding_relative_difference: float = 0.0  # their largest |difference| over their largest |gradient|
    measured_host_peak_bytes: int = 0  # offloaded activations in host memory at most at once (MemoryMeter)
    predicted_host_peak_bytes: int = 0  # ... as the plan predicted (Plan.offload; 0: nothing offloaded)
    host_budget_bytes: int = 0  # ... and the host budget it was made for

    @property
    def within_budget(self) -> bool:
        """Measured peak <= budget."""
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def prediction_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(self.measured_peak_bytes, 1)

    def table(self) -> str:
        """A short human-readable report."""
        return "\n".join([
            f"budget {format_bytes(self.budget_bytes)}; measured peak {format_bytes(self.measured_peak_bytes)} "
            f"({'within' if self.within_budget else 'OVER'} budget); "
            f"predicted {format_bytes(self.predicted_peak_bytes)} ({self.prediction_error:+.1%})",
            f"no checkpointing: {format_bytes(self.no_checkpointing_peak_bytes)}; saving "
            f"{1 - self.measured_peak_bytes / max(self.no_checkpointing_peak_bytes, 1):.0%}",
            f"gradients {'bitwise equal' if self.gradients_equal else 'DIFFER'} "
            f"(max |difference| {self.max_gradient_difference:.3g})"
            + (f"; {self._rounding_names()} (summed in chunks or slices) equal to rounding: relative difference "
               f"{self.rounding_relative_difference:.2g}" if self.rounding_only else "")
            + f"; step {self.step_time_s:.3f} s vs {self.no_checkpointing_step_time_s:.3f} s without checkpointing",
            "buffers bitwise equal" if self.buffers_equal else f"buffers DIFFER (first: {self.first_differing_buffer})",
        ] + ([f"host memory: offloaded activations measured at {format_bytes(self.measured_host_peak_bytes)} "
              f"(predicted {format_bytes(self.predicted_host_peak_bytes)}; host budget "
              f"{format_bytes(self.host_budget_bytes)}, "
              f"{'within' if self.measured_host_peak_bytes <= self.host_budget_bytes else 'OVER'})"]
             if self.predicted_host_peak_bytes else []))

    def _rounding_names(self) -> str:
        names = self.rounding_only
        return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more parameters"

    def __str__(self) -> str:
        return self.table()


def _measured_step(runner: StepRunner, seed: int, optimizer: torch.optim.Optimizer | None = None,
                   ) -> tuple[int, float, list[tuple[np.ndarray | None, torch.dtype]], int]:
    """One measured step; its gradients, or, with ``optimizer`` (a plan with the optimizer in the backward pass or
    its state in host memory), the parameters after ``optimizer.step()`` (inside the meter: with the state offloaded
    the step brings it to the device; a no-op where the update already ran)."""
    runner.clear_grads()
    # The caller's RNG streams (CPU and CUDA) are kept as NumPy bytes, which the meter does not count,
    # and come back however the step ends; every measured step draws from the same seed.
    with preserved_rng():
        torch.manual_seed(seed)
        device = runner.device
        synchronize(device)
        start = time.perf_counter()
        with MemoryMeter(device) as meter:  # on CUDA it synchronizes at exit, so the time is the step's
            runner.forward_backward()
            if optimizer is not None:
                optimizer.step()
        elapsed = time.perf_counter() - start
    grads: list[tuple[np.ndarray | None, torch.dtype]]
    if optimizer is not None:
        grads = [(host_bytes(p.detach()), p.dtype) for p in runner.model.parameters()]
    else:
        grads = [(None if p.grad is None else host_bytes(p.grad), p.dtype) for p in runner.model.parameters()]
    runner.clear_grads()
    return meter.peak_bytes, elapsed, grads, meter.host_peak_bytes


def _buffer_bytes(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: host_bytes(buffer) for name, buffer in model.named_buffers()}


def _put_back_buffers(model: nn.Module, saved: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(torch.from_numpy(saved[name].copy()).view(buffer.dtype).view(buffer.shape))


def _first_difference(found: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> str | None:
    """The first buffer (in ``named_buffers`` order) whose bytes differ, or None."""
    for name, value in reference.items():
        if name not in found or not np.array_equal(found[name], value):
            return name
    return None


ROUNDING_EPS_FACTOR = 32
"""The chunked loss head's weight gradient sums its tokens chunk by chunk (executor/loss_head.py's [the chunked
loss is exact]): it must be within ``ROUNDING_EPS_FACTOR`` machine epsilons of its dtype, relative to its largest
entry (float32: 3.8e-6; measured 0.4-1.0e-6 in tests/executor/test_loss_head.py)."""


def compare_gradients(grads: list, reference: list, rounding: set[int] | frozenset[int] = frozenset(),
                      groups: list[list[int]] | None = None) -> tuple[bool, float, float]:
    """Bitwise equality of all gradients (those at the indices in ``rounding``: within ROUNDING_EPS_FACTOR
    epsilons, relative), the largest absolute difference of the others (as float64) and the largest relative
    difference of those in ``rounding``. A gradient in one of ``groups`` (the parameters of one sliced block) is
    relative to the group's largest reference entry: a sum made slice by slice rounds at the scale of the partial
    sums, so a gradient that is zero in exact arithmetic (a key projection's bias) shows rounding noise that is
    large against itself and tiny against its block's."""
    scale: dict[int, float] = {}
    for group in groups or []:
        largest = max((torch.from_numpy(reference[i][0]).view(reference[i][1]).double().abs().max().item()
                       for i in group if reference[i][0] is not None and reference[i][0].size), default=0.0)
        scale.update({i: largest for i in group})
    equal, difference, relative = True, 0.0, 0.0
    for index, ((a, dtype), (b, _)) in enumerate(zip(grads, reference)):
        if a is None or b is None:
            equal &= a is None and b is None
            continue
        if np.array_equal(a, b):
            continue
        values = [torch.from_numpy(x).view(dtype).double() for x in (a, b)]
        gap = (values[0] - values[1]).abs().max().item()
        if index in rounding:
            share = gap / max(values[1].abs().max().item(), scale.get(index, 0.0), 1e-300)
            relative = max(relative, share)
            equal &= share <= ROUNDING_EPS_FACTOR * torch.finfo(dtype).eps
            continue
        equal = False
        difference = max(difference, gap)
    return equal, difference, relative


def loss_head_parameters(model: nn.Module, plan: Plan) -> list[tuple[int, str]]:
    """(index in ``parameters()``, name) of the parameters that share storage with a chunked loss head's."""
    if not plan.loss_head:
        return []
    head = model.get_submodule(plan.loss_head["path"])
    storages = {p.untyped_storage().data_ptr() for p in head.parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    return [(index, names.get(id(p), f"parameter {index}")) for index, p in enumerate(model.parameters())
            if p.untyped_storage().data_ptr() in storages]


def sliced_modules(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The modules the plan runs in slices of the batch: sliced blocks, and the pieces of nested blocks run so
    (planner/batch_slices.py's [a refused block's pieces may run in slices]).

    Example:
        >>> from torchckpt.planner.plan import PlannedBlock
        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        >>> plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, block_paths=("0",),
        ...             schedule=(PlannedBlock(block=0, plain=False, nested=True, sliced_pieces=(1,), piece_slices=2),),
        ...             fingerprint={})
        >>> sliced_modules(model, plan) == [model[0][1]]
        True
    """
    found: list[nn.Module] = []
    for piece, _ in iter_blocks(plan.schedule):
        block = model.get_submodule(plan.block_paths[piece.block])
        if piece.slices > 1:
            found.append(block)
        elif piece.sliced_pieces:
            inside = block_pieces(block)
            found.extend(inside[j] for j in piece.sliced_pieces)  # in range: apply's check_fits
    return found


def sliced_parameters(model: nn.Module, modules: Sequence[nn.Module]) -> list[tuple[int, str]]:
    """(index in ``parameters()``, name) of the parameters of ``modules`` (those a plan runs in slices of the batch:
    ``sliced_modules``): their gradients are summed slice by slice (executor/batch_slices.py's [slicing must not
    change the values])."""
    sliced = {id(p) for module in modules for p in module.parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    return [(index, names.get(id(p), f"parameter {index}")) for index, p in enumerate(model.parameters())
            if id(p) in sliced]


def verify_plan(model: nn.Module, plan: Plan, example_inputs: tuple | dict, *,
                loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int = 0,
                step_fn: StepFn | None = None, optimizer: torch.optim.Optimizer | None = None) -> VerifyReport:
    """Measure one step with ``plan`` applied and one without, both from the same buffers; compare
    gradients and buffers bitwise. The model's parameters, buffers and gradients are left as they were.

    ``step_fn(model, example_inputs)`` measures the user's own forward and backward instead of the
    built-in step (``runner.StepRunner``); pass the one the plan was made with. ``loss_fn`` and
    ``step_fn`` together are refused (ValueError). With a chunked loss head (``plan.loss_head``) the head's
    weight (and what shares its storage) is compared to rounding (``ROUNDING_EPS_FACTOR``), every other
    gradient bitwise; the report names them. A plan made with the optimizer in the backward pass
    (``plan.optimizer_in_backward``) or its state in host memory (``plan.optimizer_offload``, the optimizer's step
    then inside the measured peak) needs ``optimizer``: the two steps are then compared by the parameters
    after the update (``optimizer.step()`` after the plain one; inside the backward pass with the plan), from the
    same parameters and optimizer state, which come back as they were afterwards. Any other ``optimizer`` (the one
    the plan was made with, ``plan(..., optimizer=...)``) takes one step in the unmeasured warm-up, so that its state
    is alive in both measured steps as it was when profiling; its state comes back as it was.

    Example:
        >>> import torchckpt
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> batch = model.example_batch(batch_size=4, seq_len=128)
        >>> plan = torchckpt.plan(model, batch, budget="75%")
        >>> report = verify_plan(model, plan, batch)
        >>> report.within_budget, report.gradients_equal, report.buffers_equal
        (True, True, True)
    """
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    runner = StepRunner(model, example_inputs, loss_fn, step_fn=step_fn, micro_batches=plan.micro_batches)
    plan.check_fits(model, example_inputs)
    if (plan.optimizer_in_backward or plan.optimizer_offload) and optimizer is None:
        where = "runs the optimizer's update inside the backward pass" if plan.optimizer_in_backward else \
            "keeps the optimizer's state in host memory (its step is measured)"
        raise ValueError(f"this plan {where}: pass verify_plan(..., optimizer=...) (the optimizer the plan was made "
                         "with)")
    updates = optimizer if plan.optimizer_in_backward or plan.optimizer_offload else None
    # Both steps run with HF KV caches off, as profiling measured them (Note: [KV cache off while checkpointing]);
    # preserved_state: the warm-up and both steps update BatchNorm statistics: undo them.
    with preserved_state(model, optimizer), kv_cache_off([model], while_="verify_plan"), paused_gc(), \
            eager_measurement():
        # warm-up: first-call costs out of the way, and the optimizer's state made as profiling made it (one step)
        _measured_step(runner, seed, optimizer)
        start = _buffer_bytes(model)
        with preserved_state(model, updates):  # parameters and optimizer state back before the planned step
            plain_peak, plain_time, plain_grads, _ = _measured_step(runner, seed, updates)
            plain_buffers = _buffer_bytes(model)
        _put_back_buffers(model, start)  # the planned step starts from the same buffers
        # Every region's recomputation is checked op by op here, also those that keep nothing
        # (checkpoint.py's [a region that keeps nothing runs on torch's checkpoint alone]); the step time includes it.
        with preserved_state(model, updates), apply_plan(model, plan, updates), recompute_checks():
            peak, step_time, grads, host_peak = _measured_step(runner, seed, updates)
            differing = _first_difference(_buffer_bytes(model), plain_buffers)
            moved = state_offload_of(optimizer) if optimizer is not None and plan.optimizer_offload else None
            if moved is not None:  # put back by preserved_state: not all copied next to the parameters first
                moved.remove(to_device=False)
    sliced = sliced_modules(model, plan)
    rounding = loss_head_parameters(model, plan) + sliced_parameters(model, sliced)
    groups = [[i for i, _ in sliced_parameters(model, [module])] for module in sliced]
    equal, difference, relative = compare_gradients(grads, plain_grads, {index for index, _ in rounding}, groups)
    return VerifyReport(rounding_only=tuple(dict.fromkeys(name for _, name in rounding)),
                        rounding_relative_difference=relative,
                        budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
                        measured_peak_bytes=peak, no_checkpointing_peak_bytes=plain_peak, gradients_equal=equal,
                        max_gradient_difference=difference, buffers_equal=differing is None,
                        first_differing_buffer=differing, step_time_s=step_time,
                        no_checkpointing_step_time_s=plain_time, measured_host_peak_bytes=host_peak,
                        predicted_host_peak_bytes=plan.offload.get("predicted_host_peak_bytes", 0),
                        host_budget_bytes=plan.offload.get("host_budget_bytes", 0))
