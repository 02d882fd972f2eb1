"""Which items of a sharded checkpoint go through DCP (modules and optimizers), and their state dicts.

Keys are parameter names (``torch.distributed.checkpoint.state_dict``): the same under DDP, FSDP2 or none,
so a step saved by one wrapping restores into another. Every other item is rank-local (rank_local.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def is_sharded_item(obj: object) -> bool:
    """True for items saved through DCP: modules and optimizers.

    Example:
        >>> is_sharded_item(torch.nn.Linear(1, 1)), is_sharded_item({"epoch": 1})
        (True, False)
    """
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def is_data_position(obj: object) -> bool:
    """True for items that hold a position in the data (a data loader, a sampler): per rank, never resharded.

    Example:
        >>> is_data_position(torch.utils.data.SequentialSampler(range(3))), is_data_position({"epoch": 1})
        (True, False)
    """
    return isinstance(obj, (torch.utils.data.DataLoader, torch.utils.data.Sampler))


def pair_optimizers(items: Mapping[str, Any]) -> dict[str, str]:
    """Each optimizer item's model item: the module holding all its parameters.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> pair_optimizers({"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)})
        {'opt': 'model'}
    """
    pairs = {}
    modules = {name: obj for name, obj in items.items() if isinstance(obj, torch.nn.Module)}
    for name, obj in items.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        wanted = {id(p) for group in obj.param_groups for p in group["params"]}
        owners = [m for m, module in modules.items() if wanted <= {id(p) for p in module.parameters()}]
        if not owners:
            raise ValueError(
                f"item {name!r} is an optimizer but no module item passed with it holds all its parameters; a "
                "sharded checkpoint names optimizer state by parameter name. Fix: pass the model in the same "
                f"call (e.g. model=model, {name}={name}).")
        pairs[name] = owners[0]
    return pairs


def live_state(name: str, obj: Any, items: Mapping[str, Any], pairs: Mapping[str, str],
               keep_initialised: bool = False) -> Any:
    """The state dict DCP's ``state_dict`` API gives for item ``name``: keys are parameter names (no DDP
    ``module.`` prefix), FSDP2's tensors stay DTensors; an optimizer's state is keyed by its model's names.

    For an optimizer that has no state yet, DCP first takes an optimizer step with zero gradients and learning
    rate 0 to create it; that state is undone (training goes on as if nothing happened) and an empty state is
    returned, unless ``keep_initialised`` (a restore uses its tensors as the shapes to read into).

    Example:
        >>> sorted(live_state("model", torch.nn.Linear(1, 1), {}, {}))
        ['bias', 'weight']
        >>> model = torch.nn.Linear(1, 1); adam = torch.optim.Adam(model.parameters())
        >>> live_state("adam", adam, {"model": model}, {"adam": "model"})["state"], len(adam.state)
        ({}, 0)
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if not isinstance(obj, torch.optim.Optimizer):
        return get_model_state_dict(obj)
    fresh, count = not obj.state, getattr(obj, "_step_count", None)  # LR schedulers count optimizer steps
    state = get_optimizer_state_dict(items[pairs[name]], obj)
    if fresh and not keep_initialised:
        forget_initialised_state(obj, count)
        state["state"] = {}
    return state


def forget_initialised_state(optimizer: torch.optim.Optimizer, step_count: int | None) -> None:
    """Undo the state DCP created on an optimizer that had none (its zero-gradient, zero-learning-rate step).

    Example:
        >>> adam = torch.optim.Adam(torch.nn.Linear(1, 1).parameters()); adam.state[0] = {"step": 1}
        >>> forget_initialised_state(adam, None); len(adam.state)
        0
    """
    optimizer.state.clear()
    if step_count is not None:
        optimizer._step_count = step_count  # type: ignore[attr-defined]
