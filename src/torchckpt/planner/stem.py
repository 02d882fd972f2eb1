"""The stem: the work before the first block, taken as a block where that lowers every block's peak.

Rules:

1. **[the stem makes the first block's input]** The blocks ``"auto"`` finds are a model's repeated layers;
   what runs before the first of them (a CNN's stem of convolution, normalisation and pooling; a ViT's patch
   embedding) is outside every plan, and its saved activations count as fixed: on an HF ResNet at batch 32,
   86 MiB of a 151 MiB floor. The stem is the outermost module that returns the tensor the first block takes
   as its first input, found in one forward pass without gradients stopped at the first block, and that is
   neither a block, nor inside one, nor holds one (nor the model itself). Its output is the first block's
   input, so the blocks still form a chain with it in front.
2. **[a stem is taken only where it measures lower]** The search's forward pass runs with gradients under a
   meter that counts only what it makes, so it also measures what the work before the first block keeps alive
   for its backward pass beyond that block's input; where that is under ``LOOK_SHARE`` of the plain peak
   (decoders, whose embedding saves only token ids; tensors alive before the pass never count), the look ends
   there. Otherwise it measures two steps, every block checkpointed without and with the stem, and takes the stem only
   where the second measures at least ``TAKE_SHARE`` of the plain peak lower and the stem repeats (repeat.py's
   [a block is recomputed only if it repeats]). The blocks are then profiled again with the stem first, without
   regions (``STEM_REGIONS``: a region over the stem, whose input is the batch, measured up to 7% over its
   prediction on an HF MobileNetV2, where single blocks predict exactly), and the costs' notes say so
   (``notes["stem"]``), or why it was not taken. Only for ``blocks="auto"``: blocks
   given by hand are the user's whole choice.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._progress import phase
from torchckpt.executor.compiled import uncompiled
from torchckpt.memory import MemoryMeter
from torchckpt.planner import solve as solver
from torchckpt.planner.blocks import block_paths, positional_form
from torchckpt.planner.from_costs import ChainCosts, no_checkpointing_schedule
from torchckpt.planner.other_blocks import measure_every_block_peak
from torchckpt.planner.repeat import unrepeatable_blocks
from torchckpt.planner.runner import StepRunner, call_model

__all__ = ["LOOK_SHARE", "STEM_REGIONS", "TAKE_SHARE", "find_stem", "stem_choice"]

LOOK_SHARE = 0.05  # of the plain peak: what must live outside the blocks for a stem to be looked for
TAKE_SHARE = 0.02  # of the plain peak: how much lower every block's peak must measure with the stem to take it
# [a stem is taken only where it measures lower]: a region over the stem, whose input is the batch, measured up to
# 7% over its prediction (an HF MobileNetV2); single blocks over it predict exactly
STEM_REGIONS = "off: the stem before the first blocks is planned as a block, and regions over it are not modelled"


class _Reached(BaseException):
    """Raised by the first block's pre-hook: the forward pass has gone as far as the stem search needs (a
    BaseException, so that a loop's ``except Exception`` does not catch it)."""


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)), None)


def find_stem(runner: StepRunner, blocks: Sequence[nn.Module]) -> str | None:
    """The path of the stem ([the stem makes the first block's input]), or None when no module outside the
    blocks returns the first block's first input. Runs the model's forward pass up to the first block (the loop's
    own step when ``runner`` has a ``step_fn``); the caller restores the model's state and the RNG streams.

    Example:
        >>> stem = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> model = nn.Sequential(stem, nn.Linear(4, 4), nn.Linear(4, 4))
        >>> find_stem(StepRunner(model, (torch.ones(2, 4),)), [model[1], model[2]])
        '0'
    """
    return _search(runner, blocks)[0]


def _search(runner: StepRunner, blocks: Sequence[nn.Module]) -> tuple[str | None, int]:
    """``find_stem``'s path, and the bytes the forward pass made and keeps alive as the first block starts beyond
    that block's input (what the stem saves for its backward pass), measured with gradients on: tensors alive
    before the pass (the batch, parameters, another model's) are not counted."""
    if not blocks:
        raise ValueError("find_stem needs the blocks, in forward order; got none")
    model = runner.model
    inside = block_paths(model, blocks)

    def outside(path: str) -> bool:
        return bool(path) and not any(path == block or path.startswith(f"{block}.") or block.startswith(f"{path}.")
                                      for block in inside)

    # id of a module's output -> (the outermost module that returned it, the tensor, weakly: held strongly, the
    # outputs would count as kept; the weak reference tells a reused id from the same tensor)
    made: dict[int, tuple[str, weakref.ref]] = {}
    first: list[Any] = []  # the first block's input, and the bytes alive as it starts

    def after(path: str) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is None:
                return
            # an outer module's hook runs after its children's: the outermost wins, not a later sibling that
            # hands the same tensor on (an Identity, an in-place activation)
            known = made.get(id(tensor))
            if known is None or known[1]() is not tensor or known[0].startswith(f"{path}."):
                made[id(tensor)] = (path, weakref.ref(tensor))
        return hook

    def reached(module: nn.Module, args: tuple, kwargs: dict) -> None:
        args, kwargs = positional_form(module, args, kwargs)  # the block's input as the profiler reads it
        if args and isinstance(args[0], torch.Tensor):
            first.extend((args[0], meter.current_bytes))
        raise _Reached

    handles = [module.register_forward_hook(after(path)) for path, module in model.named_modules() if outside(path)]
    handles.append(blocks[0].register_forward_pre_hook(reached, with_kwargs=True))
    try:
        with torch.enable_grad(), MemoryMeter(runner.device, include_existing=False) as meter:
            try:
                if runner.step_fn is not None:
                    runner.step_fn(model, runner.example_inputs)
                else:
                    call_model(model, runner.example_inputs)
            except _Reached:
                pass
    finally:
        for handle in handles:
            handle.remove()
    if not first:
        return None, 0
    tensor, alive = first
    known = made.get(id(tensor))
    path = known[0] if known is not None and known[1]() is tensor else None
    return path, max(0, alive - tensor.untyped_storage().nbytes())


def stem_choice(runner: StepRunner, blocks: Sequence[nn.Module],
                costs: ChainCosts) -> tuple[nn.Module | None, str | None]:
    """``(stem, note)`` by [a stem is taken only where it measures lower]: the stem module to put before the
    blocks, or None; the note for the costs (``notes["stem"]``), None where no stem was looked for.
    ``costs`` are the blocks' own, measured (their plain peak). Runs the search's partial forward pass and, where
    the stem keeps enough, up to three more (two measured steps, the repeat check); the caller restores the
    model's state and the RNG streams (``preserved_state``).

    Example:
        >>> from torchckpt.planner.profile import profile
        >>> def block() -> nn.Module:
        ...     return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        >>> stem = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
        >>> model = nn.Sequential(stem, *[block() for _ in range(4)])
        >>> batch, loss_fn, blocks = (torch.ones(256, 64),), lambda output: output.sum(), list(model)[1:]
        >>> costs = profile(model, batch, blocks=blocks, loss_fn=loss_fn)
        >>> taken, note = stem_choice(StepRunner(model, batch, loss_fn=loss_fn), blocks, costs)
        >>> taken is stem
        True
        >>> for part in note.split(": "):
        ...     print(part)
        0 taken as the first block
        every block checkpointed measured 77% of the no-checkpointing peak with it, 83% without
    """
    plain_peak = int(solver.evaluate(costs, no_checkpointing_schedule(costs))[0])
    path, kept = _search(runner, blocks)
    runner.clear_grads()
    if path is None or plain_peak <= 0 or kept < LOOK_SHARE * plain_peak:
        return None, None
    phase("checking whether the work before the first block lowers the peak as a block")
    stem = uncompiled(runner.model.get_submodule(path))  # a stem compiled on its own is planned through its original
    path = path.replace("._orig_mod", "")
    without = measure_every_block_peak(runner, list(blocks))
    calls = [0]
    handle = stem.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        with_stem = measure_every_block_peak(runner, [stem, *blocks])
    finally:
        handle.remove()
    if calls[0] != 1:  # plans cover blocks that run once per step (T5's dropout runs before and after its blocks)
        return None, f"{path} (before the first block) not taken: it ran {calls[0]} times in one step"
    if with_stem == torch.iinfo(torch.int64).max:
        return None, f"{path} (before the first block) not taken: the model did not run with it checkpointed"
    measured = (f"every block checkpointed measured {with_stem / plain_peak:.0%} of the no-checkpointing peak with "
                f"it, {without / plain_peak:.0%} without")
    if with_stem > without - TAKE_SHARE * plain_peak:
        return None, f"{path} (before the first block) not taken: {measured}"
    why = unrepeatable_blocks(runner, [stem]).get(0)
    runner.clear_grads()
    if why is not None:
        return None, f"{path} (before the first block) not taken: recomputing it would differ ({why})"
    return stem, f"{path} taken as the first block: {measured}"
