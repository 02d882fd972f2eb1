"""The optimizer's update inside the backward pass, one parameter at a time: gradients never all live at once.

``optimizer_in_backward(optimizer)`` gives every parameter of ``optimizer`` a hook
(``Tensor.register_post_accumulate_grad_hook``) that, as soon as the backward pass has accumulated that
parameter's gradient, runs the optimizer's own update on that parameter alone and drops the gradient. Rules:

1. **[the update is the optimizer's own]** Each parameter's update is a one-parameter optimizer of the same class
   and hyperparameters, sharing the optimizer's ``state`` (so ``optimizer.state_dict()``, checkpoints and LR
   schedulers work as before: the hyperparameters are read from the optimizer's group at every update). On CPU,
   where optimizers take one tensor at a time by default, the updated parameters and state are bitwise those of
   ``optimizer.step()`` after the plain backward pass (tests/executor/test_optimizer_in_backward.py).
2. **[the loop is unchanged]** The loop's own ``optimizer.step()`` then finds no gradients and changes nothing,
   and ``zero_grad()`` finds none to clear, so a loop runs as written.
3. **[what needs every gradient is refused]** While it is on, ``torch.nn.utils.clip_grad_norm_`` and
   ``clip_grad_value_`` (they need the gradients the update already used) and ``GradScaler.scale`` (the update
   would see scaled gradients) raise an error naming the conflict; an optimizer whose ``step`` needs a closure
   (LBFGS) and sparse or fused optimizers are refused at once. Gradient accumulation over several backward
   passes cannot be seen from here: it must not be combined (each backward pass updates).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from torchckpt.executor.one_parameter import hyperparameters, one_parameter_optimizer, refuse_unsplittable
from torchckpt.executor.optimizer_offload import state_offload_of

__all__ = ["OptimizerInBackward", "optimizer_in_backward"]

_ACTIVE: list[OptimizerInBackward] = []
_REFUSED = {
    "clip_grad_norm_": "clips by the norm of all gradients together",
    "clip_grad_value_": "clips gradients after the update has used them",
}


class OptimizerInBackward:
    """What ``optimizer_in_backward`` returns: ``remove()`` takes the hooks off (idempotent); ``updates`` counts
    the per-parameter updates run so far.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> handle = optimizer_in_backward(torch.optim.SGD(layer.parameters(), lr=0.1))
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> handle.updates, layer.weight.grad is None
        (2, True)
        >>> handle.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.updates = 0
        self._hooks: list[Any] = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                single = one_parameter_optimizer(optimizer, group, param)
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    functools.partial(self._update, single=single, group=group)))
        _ACTIVE.append(self)

    def _update(self, param: torch.Tensor, *, single: torch.optim.Optimizer, group: dict) -> None:
        single.state = self.optimizer.state  # load_state_dict replaces the dict: share the current one
        single.param_groups[0].update(hyperparameters(group))  # an LR schedule's changes included
        offload = state_offload_of(self.optimizer)  # executor/optimizer_offload.py: its state comes to the device
        with offload.on_device(param) if offload is not None else contextlib.nullcontext():
            single.step()
        param.grad = None
        self.updates += 1

    def remove(self) -> None:
        """Take every hook off."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __enter__(self) -> OptimizerInBackward:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.remove()


def optimizer_in_backward(optimizer: torch.optim.Optimizer) -> OptimizerInBackward:
    """Run ``optimizer``'s update for each parameter inside the backward pass (module docstring's rules); returns
    the handle whose ``remove()`` undoes it.

    Example:
        >>> layer = torch.nn.Linear(3, 1)
        >>> optimizer = torch.optim.AdamW(layer.parameters())
        >>> with optimizer_in_backward(optimizer):
        ...     layer(torch.ones(2, 3)).sum().backward()
        ...     optimizer.step()  # finds no gradients: the update already ran
        >>> len(optimizer.state)
        2
    """
    refuse_unsplittable(optimizer, "optimizer_in_backward")
    if any(h.optimizer is optimizer for h in _ACTIVE):
        raise ValueError("optimizer_in_backward: this optimizer already runs in the backward pass; remove the "
                         "earlier handle first")
    _install_refusals()
    return OptimizerInBackward(optimizer)


def _guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def guard(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE:
            raise RuntimeError(f"torchckpt: {name} {_REFUSED.get(name, '')} but the optimizer runs inside the "
                               "backward pass (optimizer_in_backward), one parameter at a time, and has already "
                               "used and dropped each gradient; plan without optimizer_in_backward to clip or scale "
                               "gradients")
        return original(*args, **kwargs)
    guard._torchckpt_guard = True  # type: ignore[attr-defined]
    return guard


@functools.cache
def _install_refusals() -> None:
    """[what needs every gradient is refused]: guard the clipping functions and GradScaler.scale (once per
    process; the guards pass through whenever no optimizer runs in backward)."""
    utils = torch.nn.utils
    for name in _REFUSED:
        for owner in (utils, utils.clip_grad):
            original = getattr(owner, name, None)
            if original is not None and not getattr(original, "_torchckpt_guard", False):
                setattr(owner, name, _guarded(name, original))
    _REFUSED["GradScaler.scale"] = "scales the loss for an update that unscales every gradient together"
    scaler = torch.amp.GradScaler
    if not getattr(scaler.scale, "_torchckpt_guard", False):
        scaler.scale = _guarded("GradScaler.scale", scaler.scale)  # type: ignore[method-assign]

