"""A fresh optimizer given state shaped like the saved one, so a restore has tensors to read into, without
running an optimizer step.

Rules kept here (named in ``docs/design.md``):

1. **[a fresh optimizer is shaped, not stepped]** To read a sharded optimizer's state, a restore needs live
   tensors of the saved shapes (and, under FSDP2, the same sharding). torch's ``get_optimizer_state_dict`` makes
   them on an optimizer with no state by running one step with zero gradients at learning rate 0: it allocates
   and zeroes every gradient and state tensor and runs the update's arithmetic, which took most of a restore's
   time (bench/sharded_io.py). When the live optimizer's parameter groups have the saved groups' hyperparameter
   names and as many parameters, and every saved state tensor is either shaped like its parameter or a scalar,
   each parameter instead gets the saved entries as uninitialised tensors (``empty_like`` of the parameter,
   which keeps a DTensor's sharding; a CPU scalar for a step count); torch then sees state and runs no step.
   The restore's checks of the parameter groups (restore.py) run on the state dict torch builds from it, and
   a restore that fails forgets it (items.py's ``forget_initialised_state``). Anything else is left to torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["shape_like_saved"]


def shape_like_saved(optimizer: torch.optim.Optimizer, saved_tree: Any, saved: Mapping[str, Any]) -> bool:
    """Give ``optimizer`` (with no state) uninitialised state shaped like the saved state ``saved_tree`` (the
    codec's tree: tensors as ``{"__torchckpt__": "tensor", "key": ...}``); ``saved`` maps each tensor key to its
    saved (size, dtype). Returns False, changing nothing, where that cannot be done safely
    ([a fresh optimizer is shaped, not stepped]).

    Example:
        >>> model = torch.nn.Linear(2, 2); adam = torch.optim.Adam(model.parameters())
        >>> ref = lambda key: {"__torchckpt__": "tensor", "key": key}
        >>> tree = {"state": {"weight": {"step": ref("s"), "exp_avg": ref("m")}},
        ...         "param_groups": [{**{k: 0 for k in adam.param_groups[0] if k != "params"},
        ...                           "params": ["weight", "bias"]}]}
        >>> shape_like_saved(adam, tree, {"s": ((), torch.float32), "m": ((2, 2), torch.float32)})
        True
        >>> {key: tuple(t.shape) for key, t in adam.state[model.weight].items()}
        {'step': (), 'exp_avg': (2, 2)}
        >>> shape_like_saved(torch.optim.SGD(model.parameters(), lr=0.1), tree, {})  # other hyperparameters
        False
    """
    if optimizer.state:
        return False
    try:
        groups, state = saved_tree["param_groups"], saved_tree["state"]
        if len(groups) != len(optimizer.param_groups) or not isinstance(state, dict):
            return False
        made: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for live, kept in zip(optimizer.param_groups, groups):
            if set(live) != set(kept) or len(live["params"]) != len(kept["params"]):
                return False
            for param, name in zip(live["params"], kept["params"]):
                if name not in state:
                    continue
                entries = {}
                for key, leaf in state[name].items():
                    if not (isinstance(leaf, dict) and leaf.get("__torchckpt__") == "tensor"):
                        return False
                    size, dtype = saved[leaf["key"]]
                    if tuple(size) == tuple(param.shape):
                        entries[key] = torch.empty_like(param, dtype=dtype, memory_format=torch.contiguous_format)
                    elif len(size) == 0:
                        entries[key] = torch.zeros((), dtype=dtype)
                    else:
                        return False
                made[param] = entries
    except (KeyError, TypeError, AttributeError, ValueError):
        return False
    optimizer.state.update(made)
    return bool(made)
