"""The plan options below every block, measured in one profiling step (``profile`` calls ``measure_options``).

Two options of the plan space need a step with every block checkpointed (keeping nothing) to be measured:
every block's pieces nested inside it (costs.py's [pieces nested inside a block]) and the loss head in chunks
(planner/head.py). Each is measured where it applies, both in one step when both do: the pieces' extra held
bytes are counted as held at the head, and the chunked head leaves the blocks' backward passes as the plain
head does (the head weight's gradient is made in the head's backward pass either way).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from torchckpt._units import format_bytes
from torchckpt.executor import checkpoint_modules
from torchckpt.planner.blocks import block_pieces
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.head import chunked_for_profiling, find_loss_head, loss_head_entry
from torchckpt.planner.probe import Probe, measure_step
from torchckpt.planner.runner import StepRunner

__all__ = ["HEAD_WORTH_CHUNKING", "measure_options"]

_log = logging.getLogger("torchckpt")

HEAD_WORTH_CHUNKING = 0.1
"""``loss_head=True`` measures the head in chunks (one more profiling step) only where the plain head needs at
least this share of every block's measured peak at the end of the forward pass."""


def measure_options(runner: StepRunner, block_list: list[nn.Module], costs: ChainCosts, recomputed: Probe,
                 say: Callable[[str], None], group: Any, loss_head: bool | str, pieces: bool) -> ChainCosts:
    """One measured step for the plan options below every block, each where it applies: every block checkpointed
    with its pieces nested (costs.py's [pieces nested inside a block]) and the loss head in chunks (planner/head.py);
    one step for both, as neither changes what the other measures beyond what is accounted (the pieces' extra
    held bytes count as held at the head). A step that fails with the pieces nested is run again without them.

    Example (``profile`` runs it as its last step):
        >>> from torchckpt.models import gpt
        >>> from torchckpt.planner.profile import profile
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=64))
        >>> costs.blocks[0].nested_recompute_peak_bytes >= 0, sorted(costs.loss_head)
        (True, ['chunk_tokens', 'extra_time_s', 'head_bytes', 'path'])
    """
    children = [piece for block in block_list for piece in block_pieces(block)] if pieces and group is None else []
    notes = dict(costs.notes)
    if pieces and group is not None:
        notes["pieces"] = "no: not planned under DDP or FSDP2 yet"
    path, head_note = _loss_head_path(runner, costs, group, loss_head)
    head = runner.model.get_submodule(path) if path is not None else None
    if head is not None and "forward" in vars(head):
        path, head, head_note = None, None, f"no: {path} already has an instance-level forward (wrapped by another)"
    if not children and head is None:
        return replace(costs, notes=notes, loss_head={"note": head_note} if head_note else {})
    what = " and ".join(part for part, on in (("every block's pieces nested", children),
                                             (f"the loss head ({path}) in chunks", head is not None)) if on)
    say(f"profiling step 6: every block recomputed, with {what}")
    while True:
        runner.clear_grads()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(checkpoint_modules(block_list, policy="nothing_saveable"))
                if children:
                    stack.enter_context(checkpoint_modules(children, policy="nothing_saveable"))
                chunked = stack.enter_context(chunked_for_profiling(head)) if head is not None else None
                probe = measure_step(runner, block_list, record_ops=False)
            break
        except Exception as error:  # noqa: BLE001 - the optional pieces only lose their option
            runner.clear_grads()
            if not children:
                raise
            notes["pieces"] = f"no: the step with pieces nested failed ({type(error).__name__}: {str(error)[:200]})"
            _log.info("torchckpt: %s", notes["pieces"])
            children = []
            if head is None:
                return replace(costs, notes=notes, loss_head={"note": head_note} if head_note else {})
    runner.clear_grads()
    if children:
        costs = _nested_pieces(block_list, costs, recomputed, probe)
    entry: dict[str, Any] = {"note": head_note} if head_note else {}
    if isinstance(head, nn.Linear) and chunked is not None and path is not None:
        held = sum(b.checkpoint_held_bytes + (b.nested_held_bytes if children else 0)
                   for b in costs.blocks)
        entry = loss_head_entry(path, head, *chunked, probe, held_checkpointed=held, plain_head=costs.head_bytes,
                                every_block=recomputed)
    return replace(costs, notes=notes, loss_head=entry)


def _nested_pieces(block_list: list[nn.Module], costs: ChainCosts, recomputed: Probe, probe: Probe) -> ChainCosts:
    """costs.py's [pieces nested inside a block] from ``probe``, a step with every block checkpointed keeping nothing
    and its pieces (``blocks.block_pieces``) checkpointed inside it: each block's backward peak there, less what
    [backward peak] counts besides the block's own activations and transients (``C + H``, what the checkpoint
    holds, the incoming gradient), is its ``nested_recompute_peak_bytes``; what a block's forward pass leaves behind
    beyond what it leaves with every block checkpointed plainly (``recomputed``, the profile's first step) is its
    ``nested_held_bytes``."""
    fixed = probe.traces[0].before_forward - probe.traces[0].input_bytes
    blocks, n = costs.blocks, len(costs.blocks)
    last_output = blocks[-1].output_bytes
    updated, held = [], 0
    for i, (block, trace, plain) in enumerate(zip(blocks, probe.traces, recomputed.traces)):
        if not block_pieces(block_list[i]):
            updated.append(block)
            held += block.checkpoint_held_bytes
            continue
        extra = max(0, (trace.after_forward - trace.before_forward) - (plain.after_forward - plain.before_forward))
        incoming = 0 if i == n - 1 else block.output_bytes
        base = fixed + last_output + held + block.checkpoint_held_bytes + extra + incoming
        nested = max(0, (trace.backward_peak or 0) - base)
        updated.append(replace(block, nested_recompute_peak_bytes=nested, nested_held_bytes=extra))
        held += block.checkpoint_held_bytes + extra
    return replace(costs, blocks=tuple(updated))


def _loss_head_path(runner: StepRunner, costs: ChainCosts, group: Any,
                    loss_head: bool | str) -> tuple[str | None, str]:
    """The LM head to measure in chunks (planner/head.py), or None and why not."""
    if loss_head is False:
        return None, "off (profiled with loss_head=False)"
    if group is not None:
        return None, "no: not planned under DDP or FSDP2 yet (the head's weight may be sharded)"
    if isinstance(loss_head, str):  # checked by check_loss_head_arg before profiling
        return loss_head, ""
    path, note = find_loss_head(runner.model, [runner.model.get_submodule(p) for p in costs.block_paths])
    if path is None:
        return None, note
    if costs.head_bytes < HEAD_WORTH_CHUNKING * costs.every_block_peak_bytes:
        return None, (f"no: the head ({path}) needs {format_bytes(costs.head_bytes)} at the end of the forward pass, "
                      f"under {HEAD_WORTH_CHUNKING:.0%} of every block's peak, so computing it in chunks would "
                      "hardly lower the floor (loss_head='<path>' measures it anyway)")
    return path, ""
