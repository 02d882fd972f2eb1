"""The optimizer options of a profile: its update inside the backward pass, its state in host memory between steps.

Rule: **[the optimizer step's peak is measured with its state offloaded]** With ``optimizer_offload=True`` the
optimizer's step brings each parameter's state to the device in turn (executor/optimizer_offload.py), beside every
gradient. The profiler measures that step under the meter (the one after its first measured step; where that step
makes the state, a second on the same gradients too, which brings it, and takes the larger), with the storage of
the step's loss alive beside it as a loop keeps its loss through the step to log it (a scalar, which can be a view
of a larger reduction buffer), and raises the costs' backward-end peak
(costs.py's [backward-end peak], ``tail_bytes``) to it, so every plan's predicted peak and the floor include it;
the measured peak of checkpointing every block (costs.py's [measured schedules are predicted as measured]), taken
over the forward and backward passes alone, is raised to it too. Without the option the step is not measured (with
the state on the device it adds only the update's temporaries, which on the CPU's one-tensor-at-a-time optimizers
stay below the backward pass's peak; on CUDA, where AdamW's default multi-tensor update allocates temporaries for
all parameters at once, that is not shown and is open work).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchckpt.executor.optimizer_in_backward import optimizer_in_backward as optimizer_in_backward_of
from torchckpt.executor.optimizer_offload import OptimizerOffload, state_offload_of
from torchckpt.memory import MemoryMeter
from torchckpt.planner.runner import StepRunner

__all__ = ["check_optimizer_options", "optimizer_options", "optimizer_step_peak"]


def check_optimizer_options(optimizer: object, *, optimizer_in_backward: object, optimizer_offload: object,
                            micro_batches: int, batch_slices: int) -> None:
    """Refuse, with the fix, optimizer options that cannot be planned together.

    Example:
        >>> try:
        ...     check_optimizer_options(None, optimizer_in_backward=False, optimizer_offload=True, micro_batches=1,
        ...                             batch_slices=1)
        ... except ValueError as error:
        ...     print(str(error)[:60])
        optimizer_offload=True keeps the optimizer's state in host m
    """
    for name, value in (("optimizer_in_backward", optimizer_in_backward), ("optimizer_offload", optimizer_offload)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False; got {value!r}")
    if optimizer_in_backward and optimizer is None:
        raise ValueError("optimizer_in_backward=True runs the optimizer's update inside the backward pass: pass "
                         "optimizer=... (the one your loop steps)")
    if optimizer_offload and optimizer is None:
        raise ValueError("optimizer_offload=True keeps the optimizer's state in host memory between steps: pass "
                         "optimizer=... (the one your loop steps)")
    if batch_slices > 1 and optimizer_in_backward:  # measured: AdamW's first update magnified rounding to 1e-5
        raise ValueError("batch_slices > 1 with optimizer_in_backward=True: sliced blocks' weight gradients equal the "
                         "unsliced ones only to rounding, which the update inside the backward pass can magnify past "
                         "what verify_plan can check; plan with one of the two")
    if optimizer_in_backward and micro_batches > 1:
        raise ValueError(f"optimizer_in_backward=True updates each parameter as soon as its gradient is ready, so "
                         f"gradients cannot accumulate over micro_batches={micro_batches}; plan without "
                         "optimizer_in_backward, or with one micro-batch per optimizer step")


@contextlib.contextmanager
def optimizer_options(optimizer: torch.optim.Optimizer | None, *, in_backward: bool,
                      offload: bool) -> Iterator[None]:
    """Inside: ``optimizer``'s state in host memory (``offload``, unless it is there already) and its update inside
    the backward pass (``in_backward``); both undone on exit, the state left in host memory for the caller to put
    back (``preserved_state``: no copy of it all next to the parameters first).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        >>> with optimizer_options(optimizer, in_backward=False, offload=True):
        ...     state_offload_of(optimizer) is not None
        True
        >>> state_offload_of(optimizer) is None
        True
    """
    with contextlib.ExitStack() as stack:
        if offload and optimizer is not None and state_offload_of(optimizer) is None:
            # left in host memory at the end: the profiler puts the optimizer's own state back right after
            stack.callback(OptimizerOffload(optimizer).remove, to_device=False)
        if in_backward and optimizer is not None:
            stack.enter_context(optimizer_in_backward_of(optimizer))
        yield


def optimizer_step_peak(runner: StepRunner) -> int | None:
    """Take the runner's optimizer step (``runner.optimizer_step()``); with its state offloaded, under the meter,
    returning the step's device peak ([the optimizer step's peak is measured with its state offloaded]); else None.

    Example:
        >>> layer = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> runner = StepRunner(layer, (torch.ones(1, 4),), lambda output: output.sum(), optimizer)
        >>> _ = runner.forward_backward()
        >>> optimizer_step_peak(runner) is None  # the state on the device: the step is not measured
        True
        >>> with OptimizerOffload(optimizer):
        ...     _ = runner.forward_backward()
        ...     optimizer_step_peak(runner) > 0
        True
    """
    optimizer = runner.optimizer
    if optimizer is None or state_offload_of(optimizer) is None:
        runner.optimizer_step()
        return None
    # The first step makes the state and later ones bring it to the device (its step counters too, 8 bytes more
    # on a small MLP): with the state yet to be made, both are measured, on the same gradients.
    missing = any(p.grad is not None and not optimizer.state.get(p) for group in optimizer.param_groups
                  for p in group["params"])
    peaks = []
    for _ in range(2 if missing else 1):
        with MemoryMeter(runner.device) as meter:
            # a loop keeps its loss through the step, to log it: a scalar, with the storage it holds
            loss = torch.empty(max(runner.loss_bytes, 4), dtype=torch.uint8, device=runner.device)
            optimizer.step()
            del loss
        peaks.append(meter.peak_bytes)
    runner.clear_grads()
    return max(peaks)
