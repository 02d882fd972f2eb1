"""One training step of a model on example inputs, as the profiler and ``verify`` run it.

``StepRunner`` is the one place that turns (model, inputs, loss_fn or step_fn, optimizer) into a
forward, a loss and a backward; ``default_loss`` is how torchckpt finds the loss when none is given;
``call_model`` is how the example inputs are passed to the model.

The built-in step is ``loss = loss_fn(model(*inputs))``, then the output is deleted and
``loss.backward()`` runs: the model output (the logits) is not alive during the backward pass. A loop
that keeps it (``logits, loss = model(x, y); loss.backward()``) peaks one output higher; give such a
loop as ``step_fn`` and the profiler measures that loop instead (Note: [the budget is the loop's
step]; docs/planner.md, "What the budget covers").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchckpt.memory import device_of
from torchckpt.memory.host_pool import is_host_tensor

__all__ = ["StepFn", "StepRunner", "call_model", "check_micro_batches", "default_loss"]

StepFn = Callable[[nn.Module, Any], Any]
"""``step_fn(model, example_inputs)``: one forward and backward of the user's loop (see ``StepRunner``)."""

_FIX = ("pass loss_fn=lambda output: ... returning the scalar loss, or step_fn=lambda model, inputs: ... "
        "running your own forward and backward")


def default_loss(output: Any) -> torch.Tensor:
    """The loss torchckpt uses when no ``loss_fn`` is given, found in the model output without guessing.

    In this order: the output itself when it is a scalar tensor; ``output.loss`` when it is a tensor
    (HF ``ModelOutput``, any object); ``output["loss"]`` when the output is a mapping (a dict) holding a
    tensor there; of a tuple or list, the first item when it is a scalar tensor (HF ``return_dict=False``
    with labels), else its only scalar tensor (nanoGPT's ``(logits, loss)``). Anything else, a non-scalar
    tensor included (a classifier's logits), is refused with a ``TypeError`` naming ``loss_fn=``: summing
    the output would plan for a loss the user never computes.

    Example:
        >>> default_loss(torch.tensor(2.0))
        tensor(2.)
        >>> default_loss({"loss": torch.tensor(1.5), "logits": torch.ones(2, 3)})
        tensor(1.5000)
        >>> default_loss(torch.ones(2, 3))
        Traceback (most recent call last):
        TypeError: the model returned a tensor of shape (2, 3), not a scalar loss, and no loss_fn was given; ...
    """
    if isinstance(output, torch.Tensor):
        if output.dim() == 0:
            return output
        raise TypeError(f"the model returned a tensor of shape {tuple(output.shape)}, not a scalar loss, and no "
                        f"loss_fn was given; torchckpt does not guess a loss (such as its sum): {_FIX}")
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping):
        loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
        raise TypeError(f"the model returned a {type(output).__name__} without a tensor 'loss' (keys: "
                        f"{', '.join(map(str, output.keys())) or 'none'}); pass the labels in the batch so that the "
                        f"model computes its loss, or {_FIX}")
    if isinstance(output, (tuple, list)):
        scalars = [item for item in output if isinstance(item, torch.Tensor) and item.dim() == 0]
        if output and any(item is output[0] for item in scalars):
            return output[0]
        if len(scalars) == 1:
            return scalars[0]
    raise TypeError(f"cannot find a loss in a model output of type {type(output).__name__} (neither a scalar "
                    f"tensor, nor .loss, nor ['loss'], nor a tuple holding one scalar); {_FIX}")


def _takes_keywords(signature: inspect.Signature, keys: list[str]) -> bool:
    kinds = {name: p.kind for name, p in signature.parameters.items()}
    if inspect.Parameter.VAR_KEYWORD in kinds.values():
        return True
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return all(kinds.get(key) in named for key in keys)


def _takes_one_positional(signature: inspect.Signature) -> bool:
    params = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    required_keywords = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY
                         and p.default is inspect.Parameter.empty]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return not required_keywords and (len(required) == 1 or (not required and varargs))


def call_model(model: nn.Module, inputs: tuple | dict) -> Any:
    """Call ``model`` on example inputs: a tuple as positional arguments, a dict as keyword arguments when
    ``forward`` takes its keys as keywords, else as the one positional argument of a ``forward(self,
    batch)``; a dict that fits neither is refused with a ``TypeError`` saying what to pass.

    Example:
        >>> class Net(nn.Module):
        ...     def forward(self, batch):
        ...         return batch["x"].sum()
        >>> call_model(Net(), {"x": torch.ones(2)})
        tensor(2.)
        >>> class Pair(nn.Module):
        ...     def forward(self, a, b):
        ...         return a + b
        >>> call_model(Pair(), {"x": torch.ones(2)})
        Traceback (most recent call last):
        TypeError: Pair.forward(a, b) takes neither the batch's keys (x) as keyword arguments nor one dict ...
    """
    if not isinstance(inputs, dict):
        return model(*inputs)
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # not inspectable (a C extension): pass the keys as keywords
        return model(**inputs)
    keys = [str(key) for key in inputs]
    if all(isinstance(key, str) for key in inputs) and _takes_keywords(signature, keys):
        return model(**inputs)
    if _takes_one_positional(signature):
        return model(inputs)
    names = ", ".join(signature.parameters)
    raise TypeError(f"{type(model).__name__}.forward({names}) takes neither the batch's keys ({', '.join(keys)}) as "
                    "keyword arguments nor one dict as its only required argument; pass a dict whose keys are "
                    "forward's parameter names, a tuple of positional arguments, or (batch,) to pass the dict as "
                    "the first positional argument")


@dataclass
class StepRunner:
    """Runs one training step of ``model`` on ``example_inputs`` (a tuple of args or a dict of kwargs).

    Without ``step_fn`` the step is ``loss = (loss_fn or default_loss)(call_model(model, inputs))``, the
    output deleted, then ``loss.backward()``. With ``step_fn`` the step is ``step_fn(model,
    example_inputs)``: it runs the forward and calls ``backward()`` itself, may hold anything it likes
    (the logits) through the backward pass, leaves the gradients in ``.grad`` (no optimizer step, no
    ``zero_grad``) and returns the loss (a tensor) or None. ``loss_fn`` and ``step_fn`` together are
    refused: the loss belongs inside ``step_fn``.

    ``micro_batches`` > 1 (gradient accumulation) measures the step as every micro-batch after the first runs it:
    with the gradients of the earlier micro-batches already alive from its start (Note: [a later micro-batch
    peaks highest]). ``clear_grads`` then leaves zero gradients on the parameters the last step gave one, not None.

    Example:
        >>> runner = StepRunner(nn.Linear(3, 1), (torch.ones(2, 3),), loss_fn=lambda out: out.square().mean())
        >>> runner.forward_backward().dim()
        0
        >>> def step(model, inputs):
        ...     out = model(*inputs)             # held through backward, as many loops do
        ...     loss = out.square().mean()
        ...     loss.backward()
        ...     return loss
        >>> StepRunner(nn.Linear(3, 1), (torch.ones(2, 3),), step_fn=step).forward_backward().dim()
        0
        >>> runner.clear_grads()
    """

    model: nn.Module
    example_inputs: tuple | dict
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    optimizer: torch.optim.Optimizer | None = None
    step_fn: StepFn | None = None
    micro_batches: int = 1
    _grad_params: list[nn.Parameter] = field(default_factory=list, init=False, repr=False)
    # the bytes of the storage the last step's loss holds: a scalar, but it can be a view of a larger reduction
    # buffer (256 bytes for an MSE loss of 64 values), which a loop that keeps its loss keeps through the step
    loss_bytes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        check_micro_batches(self.micro_batches)
        if not isinstance(self.example_inputs, (tuple, dict)):
            raise TypeError(f"example_inputs must be a tuple of positional arguments or a dict of keyword "
                            f"arguments; got {type(self.example_inputs).__name__} (wrap one tensor as (x,))")
        if self.loss_fn is not None and self.step_fn is not None:
            raise ValueError("pass loss_fn= or step_fn=, not both: step_fn runs the whole forward and backward, so "
                             "compute the loss inside it (loss = my_loss(model(*inputs)); loss.backward())")
        for name in ("loss_fn", "step_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable; got {type(value).__name__}")

    @property
    def device(self) -> torch.device:
        """The device the model lives on, whose memory a measured step watches (``memory.device_of``)."""
        return device_of(self.model)

    def forward_backward(self) -> torch.Tensor | None:
        """Forward, loss, backward; returns the detached loss (None when ``step_fn`` returns none). Gradients
        are left in ``.grad``."""
        if self.step_fn is not None:
            return self._user_step(self.step_fn)
        output = call_model(self.model, self.example_inputs)
        loss = (self.loss_fn or default_loss)(output)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shown = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            source = "loss_fn's result" if self.loss_fn else "the model's loss"
            raise TypeError(f"the loss must be a scalar tensor; got {shown} ({source}): reduce it, e.g. .mean()")
        del output
        loss.backward()
        self._note_grads()
        self.loss_bytes = self._kept_bytes(loss)
        return loss.detach()

    def _kept_bytes(self, loss: torch.Tensor) -> int:
        """The bytes of the step's device memory a loop that keeps ``loss`` keeps (its storage's), or 0."""
        if loss.layout != torch.strided or loss.device != self.device:
            return 0
        return loss.untyped_storage().nbytes()

    def _note_grads(self) -> None:
        if self.micro_batches > 1:
            self._grad_params = [p for p in self.model.parameters() if p.grad is not None]

    def _user_step(self, step_fn: StepFn) -> torch.Tensor | None:
        trained = [p for p in self.model.parameters() if p.requires_grad]
        before = [None if p.grad is None else (id(p.grad), p.grad._version) for p in trained]
        result = step_fn(self.model, self.example_inputs)
        after = [None if p.grad is None else (id(p.grad), p.grad._version) for p in trained]
        if trained and before == after:  # no gradient made or added to (later micro-batches find zeros there)
            raise ValueError("step_fn left no gradient in the model's parameters: it must call loss.backward() "
                             "itself (and neither step an optimizer nor zero the gradients)")
        self._note_grads()
        if not isinstance(result, torch.Tensor):
            return None
        self.loss_bytes = self._kept_bytes(result)
        return result.detach()

    def clear_grads(self) -> None:
        """Drop gradients (``set_to_none``), as a training loop does between steps; with ``micro_batches`` > 1,
        zero gradients (fresh tensors) on the parameters the last step gave one, as the next micro-batch finds them."""
        for param in self.model.parameters():
            param.grad = None
        for param in self._grad_params:
            param.grad = torch.zeros_like(param)

    def state_bytes(self) -> dict[str, int]:
        """What training keeps whatever the plan: ``parameters``, ``gradients`` (those of trainable parameters,
        once all exist) and ``optimizer_state``, each storage counted once (a tied weight once; a sharded
        parameter by its local shard).

        Example:
            >>> runner = StepRunner(nn.Linear(4, 2), (torch.ones(1, 4),))
            >>> runner.state_bytes()
            {'parameters': 40, 'gradients': 40, 'optimizer_state': 0}
        """
        def storages(tensors: Any) -> int:
            seen: dict[int, int] = {}
            for tensor in tensors:
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
                storage = local.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
            return sum(seen.values())

        params = list(self.model.parameters())
        state = [] if self.optimizer is None else [  # state offloaded to host memory is not the device's
            value for entry in self.optimizer.state.values() for value in entry.values()
            if isinstance(value, torch.Tensor) and not is_host_tensor(value)]
        return {"parameters": storages(params), "gradients": storages(p for p in params if p.requires_grad),
                "optimizer_state": storages(state)}

    def optimizer_step(self) -> None:
        """Take one optimizer step (so its state exists) and clear gradients."""
        if self.optimizer is not None:
            self.optimizer.step()
        self.clear_grads()


def check_micro_batches(micro_batches: Any) -> int:
    """``micro_batches`` checked: an int >= 1 (the backward passes per optimizer step).

    Example:
        >>> check_micro_batches(4)
        4
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1 (backward passes per optimizer step, gradient "
                         f"accumulation); got {micro_batches!r}")
    return micro_batches
