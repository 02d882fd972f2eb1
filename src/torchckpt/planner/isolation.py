"""Plan a model for training without changing it: parameters, buffers, train/eval mode and RNG come back.

``torchckpt.plan(..., optimizer=...)`` takes real training steps (so that optimizer state exists while
it measures). ``plan_without_side_effects`` runs those steps with a throwaway AdamW over the trainable
parameters; afterwards every parameter and buffer is copied back from a host snapshot and the torch
RNG streams are restored. The snapshot is NumPy memory, not tensors, so it does not count in the
measured peaks (``MemoryMeter`` counts tensors).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchckpt._host import preserved_state
from torchckpt.planner.make_plan import plan
from torchckpt.planner.plan import Plan

__all__ = ["plan_without_side_effects", "preserved_state"]


def plan_without_side_effects(model: nn.Module, example_inputs: tuple | dict, budget: int | str, *,
                              optimizer: str | None = "adamw",
                              loss_fn: Callable[[Any], torch.Tensor] | None = None, offload: bool = False,
                              optimizer_offload: bool = False) -> Plan:
    """``torchckpt.plan`` in training mode, with AdamW state counted, leaving ``model`` and RNG as they were.

    ``optimizer="adamw"`` reserves what AdamW will hold (two moments per trainable parameter) by
    planning with a throwaway AdamW; ``None`` plans without optimizer state. Call it before building
    the real optimizer, or that optimizer's state is counted as well. ``offload`` and ``optimizer_offload`` are
    ``torchckpt.plan``'s (the second plans with the throwaway AdamW's state in host memory; apply the plan with the
    real AdamW, ``apply(model, plan, optimizer=...)``).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> plan = plan_without_side_effects(model, model.example_batch(batch_size=2, seq_len=16), "100%")
        >>> plan.predicted_extra_time_s
        0.0
    """
    if optimizer not in ("adamw", None):
        raise ValueError(f"optimizer={optimizer!r}: use 'adamw' (reserve AdamW's state) or None (no optimizer state)")
    if optimizer_offload and optimizer is None:
        raise ValueError("optimizer_offload=True keeps an optimizer's state in host memory: plan with "
                         "optimizer='adamw'")
    # Unreachable tensors in reference cycles (a model or trainer dropped earlier) are live storages until the
    # collector runs: left there, they would count as fixed bytes while profiling, or vanish in the middle of it.
    gc.collect()
    with preserved_state(model):
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: there is nothing to train or plan")
        throwaway = torch.optim.AdamW(trainable, lr=0.0) if optimizer == "adamw" else None
        try:
            return plan(model, example_inputs, budget, optimizer=throwaway, loss_fn=loss_fn, offload=offload,
                        optimizer_offload=optimizer_offload)
        finally:
            for param in model.parameters():
                param.grad = None
            del throwaway
