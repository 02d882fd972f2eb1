"""Hugging Face transformers: plan activation checkpointing for a model under a budget, in place, undoable.

    from torchckpt.integrations import hf
    hf.enable(model, budget="60%", example_inputs=batch)     # plan + apply; then train as usual (Trainer too)
    hf.disable(model)                                         # the model is exactly as before

Rules kept here (named in ``docs/design.md``):

1. **[enable changes only forwards and use_cache]** ``enable`` changes nothing but block forwards
   (instance attributes, Note: [applying a plan is undoable]) and, while enabled, ``use_cache`` of the
   model's config and of every submodule's own config (T5's decoder stack has a copy): False, as HF's
   own gradient checkpointing requires: a KV cache written in the forward pass makes recomputation
   differ. Parameters, buffers, train/eval mode and the torch RNG are as before the call (planning takes
   real steps; they are undone). ``save_pretrained`` writes the same tensors under the same names.
2. **[disable undoes exactly]** ``disable`` undoes exactly what ``enable`` did; a model is enabled at
   most once at a time. The enabled models are kept in one explicit registry (weak references, so a
   model is not kept alive).
3. **[HF checkpointing and plans do not stack]** HF's own gradient checkpointing and torchckpt's plan do
   not stack: ``enable`` refuses a model on which ``gradient_checkpointing_enable()`` was called.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchckpt.executor import CheckpointHandle
from torchckpt.executor.kv_cache import disable_kv_cache, restore_kv_cache
from torchckpt.planner import Plan, apply_plan, plan_without_side_effects

__all__ = ["HFHandle", "disable", "enable", "is_enabled"]

_ENABLED: weakref.WeakKeyDictionary[nn.Module, HFHandle] = weakref.WeakKeyDictionary()  # [disable undoes exactly]


@dataclass(kw_only=True)
class HFHandle:
    """What :func:`enable` did to a model: the plan, the wrapped blocks, and the ``use_cache`` it replaced."""

    plan: Plan
    checkpoints: CheckpointHandle
    caching_configs: list[Any]
    model_ref: weakref.ref

    def remove(self) -> None:
        """Same as ``disable(model)``."""
        model = self.model_ref()
        if model is not None:
            disable(model)


def is_enabled(model: nn.Module) -> bool:
    """True while ``model`` runs under a plan from :func:`enable`.

    Example:
        >>> is_enabled(nn.Linear(2, 2))
        False
    """
    return model in _ENABLED


def _hf_checkpointing_on(model: nn.Module) -> bool:
    # transformers >= 5.x renamed is_gradient_checkpointing (deprecated, warns) to is_activation_checkpointing
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def _inputs(example_inputs: Any) -> tuple | dict:
    if isinstance(example_inputs, Mapping):  # HF BatchEncoding and Trainer batches are Mappings, not dicts
        return dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    raise TypeError(f"example_inputs must be a dict of keyword arguments (an HF batch), a tuple of positional "
                    f"arguments or one tensor; got {type(example_inputs).__name__}")


def enable(model: nn.Module, *, budget: int | str, example_inputs: Any, optimizer: str | None = "adamw",
           loss_fn: Callable[[Any], torch.Tensor] | None = None) -> HFHandle:
    """Plan activation checkpointing for one training step of ``model`` within ``budget`` and apply it.

    Args:
        model: a transformers ``PreTrainedModel`` (or any module with repeated blocks).
        budget: the step's peak: bytes, ``"6GiB"``, or a percentage of the peak without checkpointing.
        example_inputs: one training batch (a dict such as a Trainer batch, with ``labels`` so that
            ``model(**batch).loss`` exists, or pass ``loss_fn``).
        optimizer: ``"adamw"`` counts AdamW's state (two moments per trainable parameter) in the budget;
            ``None`` leaves optimizer state out. Call ``enable`` before the optimizer exists (a Trainer
            builds it in ``train()``), or its state is counted twice.
        loss_fn: maps the model output to the scalar loss (default: ``output.loss``).

    Raises ``InfeasibleBudgetError`` naming the smallest feasible peak when the budget is too small.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.randint(0, 64, (2, 16))
        >>> handle = enable(model, budget="100%", example_inputs={"input_ids": ids, "labels": ids})
        >>> model.config.use_cache, is_enabled(model)
        (False, True)
        >>> disable(model); model.config.use_cache
        True
    """
    if is_enabled(model):
        raise ValueError(f"{type(model).__name__} already runs under torchckpt.integrations.hf.enable; call "
                         "hf.disable(model) first, then enable it again with the new budget")
    if _hf_checkpointing_on(model):  # [HF checkpointing and plans do not stack]
        raise ValueError(f"{type(model).__name__} has HF gradient checkpointing on; torchckpt's plan replaces it. "
                         "Fix: call model.gradient_checkpointing_disable() (activation_checkpointing_disable() in "
                         "newer transformers) and do not pass gradient_checkpointing=True to TrainingArguments")
    inputs = _inputs(example_inputs)
    caching = disable_kv_cache([model], while_="activation checkpointing is enabled", undo="hf.disable(model)")
    try:
        plan = plan_without_side_effects(model, inputs, budget, optimizer=optimizer, loss_fn=loss_fn)
        checkpoints = apply_plan(model, plan)
    except BaseException:
        restore_kv_cache(caching)
        raise
    handle = HFHandle(plan=plan, checkpoints=checkpoints,
                      caching_configs=caching, model_ref=weakref.ref(model))
    _ENABLED[model] = handle
    return handle


def disable(model: nn.Module) -> None:
    """Undo :func:`enable`: original block forwards and ``config.use_cache``; a no-op if not enabled.

    Example:
        >>> disable(nn.Linear(2, 2))
    """
    handle = _ENABLED.pop(model, None)
    if handle is None:
        return
    handle.checkpoints.remove()
    restore_kv_cache(handle.caching_configs)

