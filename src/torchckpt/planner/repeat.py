"""Which blocks compute the same output when run again as recomputation runs them (one unmeasured pass).

Rules:

1. **[a block is recomputed only if it repeats]** Recomputation runs a block's forward again in the backward
   pass with torch's RNG streams as they were at its forward (executor/checkpoint.py's [recomputation replays
   the RNG]) and everything else as the forward left it: what it wrote in place (a spectral norm's
   power-iteration vectors, a counter buffer), NumPy's and Python's global RNG streams. Before the measured steps
   the profiler runs one forward pass without gradients and watches each block's forward: one that writes its
   own parameters or buffers (their version counters move) or draws from NumPy or ``random`` runs again at once
   as recomputation would: torch's streams set back to where its forward began, what it wrote left written, and
   what the second run writes undone (executor/checkpoint.py's [recomputation leaves buffers alone]). If the two
   outputs are not bitwise equal the block is planned plain, never recomputed and never inside a region, and the
   plan's notes name it and why. A BatchNorm in training writes its running statistics but does not read them,
   and repeats; ``torch.nn.utils.spectral_norm`` reads the vectors it writes, and does not. Blocks that do
   neither are not run again (the pass costs one forward without gradients); state a block keeps outside
   tensors (a Python counter) is not seen, and ``verify_plan`` is what would catch it. Not under FSDP2 (it
   reshards a block's parameters as its forward ends, before a second run could use them): there every block is
   taken to repeat. With a ``step_fn`` the pass is the loop's whole step, and each second run is without
   gradients.
2. **[only the pass's own streams move]** The pass leaves the RNG streams, parameters and buffers to the
   profiler's ``preserved_state``; within it, each second run starts and ends with the streams where the
   first run left them, so later blocks draw what they would have drawn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._host import RngSnapshot, same_host_rng
from torchckpt.executor.outer_writes import UndoOuterWrites
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.runner import StepRunner, call_model

__all__ = ["plain_only", "unrepeatable_blocks"]


def unrepeatable_blocks(runner: StepRunner, blocks: Sequence[nn.Module]) -> dict[int, str]:
    """Block index -> why recomputing it would not give its forward's output ([a block is recomputed only if it
    repeats]); empty when every block repeats. Runs one forward pass (the whole step when ``runner`` has a
    ``step_fn``), unmeasured; the caller restores the model's state and the RNG streams (``preserved_state``).

    Example:
        >>> from torchckpt._host import preserved_state
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny")
        >>> runner = StepRunner(model, model.example_batch(batch_size=2, seq_len=16))
        >>> with preserved_state(model):
        ...     unrepeatable_blocks(runner, list(model.blocks))
        {}
    """
    found: dict[int, str] = {}
    checked: set[int] = set()
    handles: list[Any] = []  # the pre-hooks, and each block's one-call forward hook (removed here if it never ran)
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(_before(i, checked, found, handles), with_kwargs=True))
    try:
        if runner.step_fn is not None:  # the loop's own forward and backward: it calls backward itself
            runner.forward_backward()
            runner.clear_grads()
        else:
            with torch.no_grad():
                call_model(runner.model, runner.example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _before(i: int, checked: set[int], found: dict[int, str], handles: list[Any]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if i in checked:  # the first call of each block is checked
            return
        checked.add(i)
        start = RngSnapshot.capture(host=True)
        versions = _versions(module)
        handle: Any = None

        def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            handle.remove()
            end = RngSnapshot.capture(host=True)
            written = _versions(module)
            if _reason(start, end, versions, written) is None:  # nothing that recomputation would not replay
                return
            RngSnapshot(cpu=start.cpu, cuda=start.cuda).restore()  # torch's streams only, as recomputation does
            try:  # its writes undone, and their version counters with them: with a step_fn this pass is a training
                # step, and autograd checks the versions of what it saved (a BatchNorm's running statistics)
                with contextlib.ExitStack() as kept:
                    for tensor in [*module.parameters(), *module.buffers()]:
                        kept.enter_context(torch.autograd._unsafe_preserve_version_counter(tensor))
                    with UndoOuterWrites(), torch.no_grad():
                        again = module.forward(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - any failure to run again is a reason not to recompute
                found[i] = f"run again from the same inputs, its forward raised {type(error).__name__}: {error}"
                return
            finally:
                end.restore()
            if not _same(output, again):
                found[i] = _reason(start, end, versions, written) or "its forward gives another output run again"

        handle = module.register_forward_hook(after, with_kwargs=True)
        handles.append(handle)
    return hook


def _versions(module: nn.Module) -> dict[str, int]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor._version for name, tensor in named}


def _same(first: Any, second: Any) -> bool:
    """Bitwise equal tensors in the same structure (NaN equal to the same NaN); other leaves are not compared."""
    a, spec_a = tree_flatten(first)
    b, spec_b = tree_flatten(second)
    if spec_a != spec_b:
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not torch.equal(x.detach().contiguous().reshape(-1).view(torch.uint8),
                               y.detach().contiguous().reshape(-1).view(torch.uint8)):
                return False
    return True


def _reason(start: RngSnapshot, end: RngSnapshot, before: dict[str, int], after: dict[str, int]) -> str | None:
    written = [name for name, version in after.items() if before.get(name) != version]
    assert start.numpy is not None and end.numpy is not None and start.python is not None and end.python is not None
    host_drawn = not same_host_rng((start.numpy, start.python), (end.numpy, end.python))
    if host_drawn:
        return "its forward draws from NumPy's or Python's random generator, which recomputation would not replay"
    if written:
        shown = ", ".join(written[:3]) + (" ..." if len(written) > 3 else "")
        return (f"its forward writes {shown} in place and reads it (a power iteration, say), so recomputation "
                "would start from the written value")
    return None  # no cause found


def plain_only(costs: ChainCosts, reasons: dict[int, str]) -> ChainCosts:
    """``costs`` with the blocks in ``reasons`` (index -> why) planned plain only and no regions, the notes naming
    them (repeat.py's [a block is recomputed only if it repeats]).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=1, forward_time_s=0.1)
        >>> costs = plain_only(ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block, block)), {1: "why"})
        >>> costs.blocks[1].plain_only, costs.notes["not recomputed"]
        ('why', 'block 1 (b): why')
    """
    if not reasons:
        return costs
    blocks = tuple(replace(block, plain_only=reasons[i]) if i in reasons else block
                   for i, block in enumerate(costs.blocks))
    paths = costs.block_paths or tuple(block.name for block in costs.blocks)
    named = "; ".join(f"block {i} ({paths[i]}): {reason}" for i, reason in sorted(reasons.items()))
    notes = {**costs.notes, "not recomputed": named}
    if "regions" not in notes and len(blocks) > 1:
        notes["regions"] = f"off: {len(reasons)} block(s) may not be recomputed (see 'not recomputed')"
    # every block checkpointed is no longer a plan, so its measured peak must not stand for the schedule with the
    # same option indices (a plain-only block's last option is plain): every schedule is predicted by the rules
    return replace(costs, blocks=blocks, notes=notes, every_block_peak_bytes=0)
