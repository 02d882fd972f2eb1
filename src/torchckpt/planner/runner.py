"""One training step of a model on example inputs, as the profiler and ``verify`` run it.

``StepRunner`` is the one place that turns (model, inputs, loss_fn, optimizer) into a forward, a loss
and a backward; ``default_loss`` is how torchckpt finds the loss when none is given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["StepRunner", "default_loss"]


def default_loss(output: Any) -> torch.Tensor:
    """The loss torchckpt uses when none is given: the output if scalar, else ``output.loss``, else ``sum()``.

    Example:
        >>> default_loss(torch.ones(3))
        tensor(3.)
    """
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0] if output[0].dim() == 0 else output[0].sum()
    raise TypeError(f"cannot derive a loss from a model output of type {type(output).__name__}; pass "
                    "loss_fn=lambda output: ... returning a scalar tensor")


@dataclass
class StepRunner:
    """Runs one training step of ``model`` on ``example_inputs`` (a tuple of args or a dict of kwargs).

    Example:
        >>> runner = StepRunner(nn.Linear(3, 1), (torch.ones(2, 3),))
        >>> runner.forward_backward().dim()
        0
        >>> runner.clear_grads()
    """

    model: nn.Module
    example_inputs: tuple | dict
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.example_inputs, (tuple, dict)):
            raise TypeError(f"example_inputs must be a tuple of positional arguments or a dict of keyword "
                            f"arguments; got {type(self.example_inputs).__name__} (wrap one tensor as (x,))")

    def forward_backward(self) -> torch.Tensor:
        """Forward, loss, backward; returns the detached loss. Gradients are left in ``.grad``."""
        if isinstance(self.example_inputs, dict):
            output = self.model(**self.example_inputs)
        else:
            output = self.model(*self.example_inputs)
        loss = (self.loss_fn or default_loss)(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a scalar tensor; got {type(loss).__name__}")
        del output
        loss.backward()
        return loss.detach()

    def clear_grads(self) -> None:
        """Drop gradients (``set_to_none``), as a training loop does between steps."""
        for param in self.model.parameters():
            param.grad = None

    def optimizer_step(self) -> None:
        """Take one optimizer step (so its state exists) and clear gradients."""
        if self.optimizer is not None:
            self.optimizer.step()
        self.clear_grads()
