"""The plan options below every block, measured in one profiling step (``profile`` calls ``measure_options``).

Two options of the plan space need a step with every block checkpointed (keeping nothing) to be measured:
every block's pieces nested inside it (costs.py's [pieces nested inside a block]) and the loss head in chunks
(planner/head.py). Each is measured where it applies, both in one step when both do: the pieces' extra held
bytes are counted as held at the head, and the chunked head leaves the blocks' backward passes as the plain
head does (the head weight's gradient is made in the head's backward pass either way).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from torchckpt._progress import block_ticks
from torchckpt._units import format_bytes
from torchckpt.executor import CheckpointHandle, checkpoint_modules, wrap_forward
from torchckpt.executor.batch_slices import sliced_checkpoint
from torchckpt.executor.compiled import EAGER_ONLY
from torchckpt.planner.batch_slices import sliceable_blocks
from torchckpt.planner.blocks import block_pieces
from torchckpt.planner.distributed import agree_flag
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.head import chunked_for_profiling, find_loss_head, loss_head_entry
from torchckpt.planner.probe import Probe, measure_step, timed_step
from torchckpt.planner.runner import StepRunner

__all__ = ["HEAD_WORTH_CHUNKING", "measure_options"]

_log = logging.getLogger("torchckpt")

HEAD_WORTH_CHUNKING = 0.1
"""``loss_head=True`` measures the head in chunks (one more profiling step) only where the plain head needs at
least this share of every block's measured peak at the end of the forward pass."""


def measure_options(runner: StepRunner, block_list: list[nn.Module], costs: ChainCosts, recomputed: Probe,
                    say: Callable[[str], None], group: Any, loss_head: bool | str, pieces: bool,
                    batch_slices: int = 1, compiled: bool = False) -> ChainCosts:
    """One measured step for the plan options below every block, each where it applies: every block checkpointed
    with its pieces nested (costs.py's [pieces nested inside a block]) and the loss head in chunks (planner/head.py);
    one step for both, as neither changes what the other measures beyond what is accounted (the pieces' extra
    held bytes count as held at the head). A step that fails with the pieces nested is run again without them.
    With ``batch_slices`` k > 1 (one process), the blocks measured exact in k slices of the batch
    (planner/batch_slices.py's [only blocks measured exact are sliced]) run so in that step, their pieces not
    nested, and their nested option is the sliced one (``BlockCosts.nested_slices``). For a ``compiled`` model
    neither pieces nor slices are measured (Note: [checkpoints nested or sliced are planned for eager runs]).

    Example (``profile`` runs it as its last step):
        >>> from torchckpt.models import gpt
        >>> from torchckpt.planner.profile import profile
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=64))
        >>> costs.blocks[0].nested_recompute_peak_bytes >= 0, sorted(costs.loss_head)
        (True, ['chunk_tokens', 'extra_time_s', 'head_bytes', 'path'])
    """
    children = [piece for block in block_list for piece in block_pieces(block)] \
        if pieces and group is None and not compiled else []
    notes = dict(costs.notes)
    if pieces and group is not None:
        notes["pieces"] = "no: not planned under DDP or FSDP2 yet"
    elif pieces and compiled:
        notes["pieces"] = f"no: the model is compiled, and a block's pieces nested {EAGER_ONLY}"
    sliced: list[int] = []
    # planner/batch_slices.py's [a refused block's pieces may run in slices]
    sliced_pieces: dict[int, tuple[int, ...]] = {}
    if batch_slices > 1 and group is not None:
        notes["batch slices"] = "no: not planned under DDP or FSDP2 yet"
    elif batch_slices > 1 and compiled:
        notes["batch slices"] = f"no: the model is compiled, and a block in slices of the batch {EAGER_ONLY}"
    elif batch_slices > 1:
        say(f"checking which blocks give the same outputs in {batch_slices} slices of the batch")
        per_block = [[p for p in block_pieces(block) if _worth_slicing(p)] if children else [] for block in block_list]
        reasons = sliceable_blocks(runner, block_list, batch_slices, per_block)
        piece_reasons, reasons = reasons[len(block_list):], reasons[:len(block_list)]
        sliced = [i for i, reason in enumerate(reasons) if not reason]
        for i, inside in enumerate(per_block):
            exact = tuple(block_pieces(block_list[i]).index(piece)
                          for piece, reason in zip(inside, piece_reasons[:len(inside)]) if not reason)
            piece_reasons = piece_reasons[len(inside):]
            if exact and i not in sliced:
                sliced_pieces[i] = exact
        # a sliced block nests no pieces: their checkpoints would hold more through the forward pass (measured on
        # an HF Llama at 8 x 256: its floor 0.72x every block's peak sliced, 0.91x sliced with pieces nested)
        children = [piece for i, block in enumerate(block_list) if i not in sliced for piece in block_pieces(block)
                    ] if children else []
        refused = [f"block {i}: {reason}" for i, reason in enumerate(reasons) if reason]
        notes["batch slices"] = (f"{len(sliced)} of {len(block_list)} blocks may run in {batch_slices} slices of the "
                                 "batch" + (f"; not {'; '.join(refused[:3])}" if refused else "")
                                 + (f" (and {len(refused) - 3} more)" if len(refused) > 3 else "")
                                 + (f"; {sum(map(len, sliced_pieces.values()))} pieces of {len(sliced_pieces)} of "
                                    "those may (their pieces nested)" if sliced_pieces else ""))
    path, head_note = _loss_head_path(runner, costs, group, loss_head)
    head = runner.model.get_submodule(path) if path is not None else None
    if head is not None and "forward" in vars(head):
        path, head, head_note = None, None, f"no: {path} already has an instance-level forward (wrapped by another)"
    if not children and not sliced and head is None:
        return replace(costs, notes=notes, loss_head={"note": head_note} if head_note else {})
    what = " and ".join(part for part, on in (("every block's pieces nested", children),
                                             (f"{len(sliced)} blocks in {batch_slices} slices of the batch", sliced),
                                             (f"the pieces of {len(sliced_pieces)} blocks exact in {batch_slices} "
                                              "slices of the batch so run", sliced_pieces),
                                             (f"the loss head ({path}) in chunks", head is not None)) if on)
    say(f"profiling step 6: every block recomputed, with {what}")
    base, rejected = costs, None
    # measured as apply_plan runs them: sliced only at the profiled batch (executor/batch_slices.py)
    batch = [trace.input_shape[0] if trace.input_shape else 0 for trace in recomputed.traces]
    while True:
        runner.clear_grads()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(checkpoint_modules([b for i, b in enumerate(block_list) if i not in sliced],
                                                       policy="nothing_saveable"))
                if sliced:
                    stack.enter_context(_in_slices([(block_list[i], batch[i]) for i in sliced], batch_slices))
                in_slices = [(block_pieces(block_list[i])[j], batch[i]) for i, exact in sliced_pieces.items()
                             for j in exact]
                if children:
                    stack.enter_context(checkpoint_modules(
                        [c for c in children if not any(c is p for p, _ in in_slices)], policy="nothing_saveable"))
                    stack.enter_context(_in_slices(in_slices, batch_slices))
                chunked = stack.enter_context(chunked_for_profiling(head)) if head is not None else None
                stack.enter_context(block_ticks(block_list))  # _progress.py's [reported per phase, never per op]
                probe = measure_step(runner, block_list, record_ops=False)
        except Exception as error:  # noqa: BLE001 - the optional pieces only lose their option
            runner.clear_grads()
            if sliced_pieces:  # the pieces in slices lose their option first; the pieces stay nested, whole
                notes["batch slices"] += (f"; the step with pieces in slices failed ({type(error).__name__}: "
                                          f"{str(error)[:200]}), so they run whole")
                sliced_pieces = {}
                continue
            if not children and not sliced:
                raise
            what_failed = "pieces" if children else "batch slices"
            notes[what_failed] = (f"no: the step with {'pieces nested' if children else 'blocks in slices'} failed "
                                  f"({type(error).__name__}: {str(error)[:200]})")
            _log.info("torchckpt: %s", notes[what_failed])
            children, sliced, sliced_pieces = [], [], {}
            if head is None:
                return replace(costs, notes=notes, loss_head=rejected or ({"note": head_note} if head_note else {}))
            continue
        runner.clear_grads()
        costs = _nested_pieces(block_list, base, recomputed, probe, sliced, batch_slices, bool(children),
                               sliced_pieces) if children or sliced else base
        entry: dict[str, Any] = rejected or ({"note": head_note} if head_note else {})
        if isinstance(head, nn.Linear) and chunked is not None and path is not None:
            held = sum(b.checkpoint_held_bytes + (b.nested_held_bytes if children or sliced else 0)
                       for b in costs.blocks)
            entry = loss_head_entry(path, head, *chunked, probe, held_checkpointed=held, plain_head=costs.head_bytes,
                                    every_block=recomputed)
        if head is not None and "chunk_tokens" not in entry and (children or sliced):
            # the head's measurement was refused, and the blocks' figures from its step may carry what it left
            # (deferred logits materialised inside a block): the blocks are measured again without it
            head, rejected = None, entry
            continue
        # every rank takes part in the vote (a rank that skipped it would leave the others waiting in it)
        if agree_flag("chunk_tokens" in entry and head is not None, group):
            assert head is not None
            entry["extra_time_s"] = _chunked_step_extra_s(runner, head, costs.step_time_s, entry["extra_time_s"])
        return replace(costs, notes=notes, loss_head=entry)


def _worth_slicing(piece: nn.Module) -> bool:
    """Whether a piece of a refused block is checked for slices (planner/batch_slices.py's
    [a refused block's pieces may run in slices]): one with a weight matrix (attention, an MLP, a convolution),
    not a norm. A norm's activations are the size of its input, so slices save little there, and its gradients
    are per-feature sums over every token, where a sum made slice by slice rounds most against the piece's own
    scale (measured on the project's GPT small at 8 x 512: LayerNorm biases 3.4e-6 relative, within 0.4e-6 of
    verify.ROUNDING_EPS_FACTOR's tolerance)."""
    return any(parameter.dim() >= 2 for parameter in piece.parameters())


def _chunked_step_extra_s(runner: StepRunner, head: nn.Module, plain_step_s: float, recompute_s: float) -> float:
    """head.py's [the chunked head is measured]: a bare step with the head in chunks and no block checkpointed,
    less the profile's bare plain step; never less than ``recompute_s``, the logits computed again."""
    with chunked_for_profiling(head):
        chunked_s = timed_step(runner)
    return max(recompute_s, chunked_s - plain_step_s)


@contextlib.contextmanager
def _in_slices(modules: list[tuple[nn.Module, int]], slices: int) -> Iterator[None]:
    """Each of ``modules`` (module, the batch it was checked at) checkpointed keeping nothing, in ``slices`` slices
    of that batch, until exit."""
    wrapped: list[nn.Module] = []
    for module, batch in modules:
        wrap_forward(module, functools.partial(sliced_checkpoint, module.forward, slices=slices, batch=batch,
                                               policy="nothing_saveable"), wrapped)
    try:
        yield
    finally:
        CheckpointHandle(wrapped).remove()


def _nested_pieces(block_list: list[nn.Module], costs: ChainCosts, recomputed: Probe, probe: Probe,
                   sliced: list[int], slices: int, pieces_nested: bool,
                   sliced_pieces: dict[int, tuple[int, ...]]) -> ChainCosts:
    """costs.py's [pieces nested inside a block] from ``probe``, a step with every block checkpointed keeping nothing
    and its pieces (``blocks.block_pieces``) checkpointed inside it: each block's backward peak there, less what
    [backward peak] counts besides the block's own activations and transients (``C + H``, what the checkpoint
    holds, the incoming gradient), is its ``nested_recompute_peak_bytes``; what a block's forward pass leaves behind
    beyond what it leaves with every block checkpointed plainly (``recomputed``, the profile's first step) is its
    ``nested_held_bytes``; a block in ``sliced`` was run in ``slices`` slices of the batch (``nested_slices``), its
    pieces nested inside it where ``pieces_nested`` (``nested_pieces``); another's pieces in ``sliced_pieces`` ran
    in ``slices`` slices each (``nested_sliced_pieces``)."""
    fixed = probe.traces[0].before_forward - probe.traces[0].input_bytes
    blocks, n = costs.blocks, len(costs.blocks)
    last_output = blocks[-1].output_bytes
    updated, held = [], 0
    for i, (block, trace, plain) in enumerate(zip(blocks, probe.traces, recomputed.traces)):
        if not block_pieces(block_list[i]) and i not in sliced:
            updated.append(block)
            held += block.checkpoint_held_bytes
            continue
        extra = max(0, (trace.after_forward - trace.before_forward) - (plain.after_forward - plain.before_forward))
        incoming = 0 if i == n - 1 else block.output_bytes
        base = fixed + last_output + held + block.checkpoint_held_bytes + extra + incoming
        nested = max(0, (trace.backward_peak or 0) - base)
        # [forward peak] as profile.py's _assemble reads it: above C (less the last output's gradient), what the
        # blocks before hold in this step, and the block's input; only a sliced forward differs from the plain one
        in_slices = i in sliced or i in sliced_pieces
        forward = max(0, trace.forward_peak - (fixed + last_output + held + block.input_bytes)) if in_slices else -1
        count = min(slices, trace.input_shape[0]) if in_slices else 1
        updated.append(replace(block, nested_recompute_peak_bytes=nested, nested_held_bytes=extra,
                               nested_slices=count if i in sliced else 1,
                               nested_slice_batch=trace.input_shape[0] if in_slices else 0,
                               nested_sliced_pieces=sliced_pieces.get(i, ()) if count > 1 else (),
                               nested_piece_slices=count if count > 1 and i in sliced_pieces else 1,
                               nested_pieces=bool(pieces_nested and i not in sliced and block_pieces(block_list[i])),
                               nested_forward_peak_bytes=forward))
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
