"""One parameter's update by the optimizer's own code: what the optimizer in the backward pass and the optimizer's
state in host memory both run (executor/optimizer_in_backward.py, executor/optimizer_offload.py).

Each is a one-parameter optimizer of the same class and hyperparameters, sharing the optimizer's ``state``
(optimizer_in_backward.py's [the update is the optimizer's own]).
"""

from __future__ import annotations

import torch

__all__ = ["hyperparameters", "one_parameter_optimizer", "refuse_unsplittable"]


def hyperparameters(group: dict) -> dict:
    """A param group's hyperparameters: everything but ``params``.

    Example:
        >>> hyperparameters({"params": [], "lr": 0.1})
        {'lr': 0.1}
    """
    return {key: value for key, value in group.items() if key != "params"}


def one_parameter_optimizer(optimizer: torch.optim.Optimizer, group: dict,
                            param: torch.Tensor) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and ``group``'s hyperparameters over ``param`` alone, sharing
    ``optimizer.state`` ([the update is the optimizer's own]); refresh its hyperparameters from ``group`` before
    each ``step()`` (``single.param_groups[0].update(...)``), as LR schedules change them.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
        >>> single = one_parameter_optimizer(optimizer, optimizer.param_groups[0], layer.bias)
        >>> single.state is optimizer.state, single.param_groups[0]["momentum"]
        (True, 0.9)
    """
    single = type(optimizer)([{**hyperparameters(group), "params": [param]}])  # type: ignore[call-arg]
    single.state = optimizer.state
    return single


def refuse_unsplittable(optimizer: object, what: str) -> None:
    """Refuse, naming ``what`` needs the update one parameter at a time, an optimizer that cannot take it so: not a
    ``torch.optim.Optimizer``, LBFGS (a closure over the whole model), fused, or with sparse parameters.

    Example:
        >>> try:
        ...     refuse_unsplittable(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(1))]), "optimizer_offload")
        ... except ValueError as error:
        ...     print(str(error)[:60])
        optimizer_offload: LBFGS's step needs a closure that evaluat
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: expected a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"{what}: LBFGS's step needs a closure that evaluates the whole model; it cannot update one "
                         f"parameter at a time (plan without {what})")
    for group in optimizer.param_groups:
        if group.get("fused"):
            raise ValueError(f"{what}: a fused optimizer updates all its parameters in one kernel; make it with "
                             f"fused=False, or plan without {what}")
        if any(p.is_sparse for p in group["params"]):
            raise ValueError(f"{what}: sparse parameters are not supported")
