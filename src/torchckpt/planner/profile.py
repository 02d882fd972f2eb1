"""Measure a model into a cost model (``costs.ChainCosts``). Measures only; decides nothing.

One file on purpose (~440 lines): the block hooks, the op recorder and the assembly of the costs all
read the marks of the same measured steps; split, each part would need the others' internals.

How each figure of ``costs.py`` is obtained (the names of that module's rules in brackets):

1. **[two measured steps]** Two real training steps run under a ``MemoryMeter``: one with every block
   checkpointed (keep nothing), which is also the warm-up (the optimizer's state is created after it, so
   its figures are taken relative to its own ``fixed``), then one plain. Hooks mark each block's forward
   (pre/post hooks) and backward (a gradient hook on the block's output marks its start, one on its input
   its end); the meter's peak is read between marks.
2. **[byte figures from block marks]** ``fixed_bytes`` is what is live when block 0 starts, minus block
   0's input, plus a headroom; ``saved_bytes`` is what a
   block's forward leaves behind minus its output [what a piece holds]; ``input_held_when_plain`` is
   whether the block's input storage (watched through a weak reference) is still alive when the block's
   backward pass begins in the plain step [what a piece holds]; ``freed_side_input_bytes`` is, of the
   block's other tensor inputs (positional and keyword, each storage once, the first input's storage
   excluded), the bytes of those whose storage is dead at that moment [what a piece holds]; ``head_bytes``
   is the peak between the last block's forward and the first block backward, above fixed and everything
   the blocks hold [forward-end peak].
3. **[the plain plan is predicted exactly]** ``backward_peak_bytes`` and ``forward_peak_bytes`` are the
   measured peaks minus what [backward peak] and [forward peak] already count, so the all-plain plan is
   predicted exactly; they absorb what the model does not name (parameter gradients created so far, the
   head's leftovers). ``recompute_peak_bytes`` is the same residue from the checkpointed step, above the
   plain one.
4. **[ops are numbered as the executor numbers them]** Ops are recorded inside each block's plain forward
   with the executor's own numbering (``aten.detach`` skipped, ``tag`` visible as in a checkpointed
   region), so ``save_ops`` indices in a plan refer to them. An op is ``saved`` when autograd saves a
   tensor whose storage the op created and the executor can keep its outputs (``checkpoint.can_keep``: not
   a view, not in-place, not random, and not written in place later). SDPA is tagged random by ATen (it
   takes ``dropout_p``), so it is recomputed under any policy; counting it as kept over-predicted
   selective plans by its output per block (2.16 MB per block on gpt("mini") at 16 x 256 tokens) and
   under-predicted their recompute time. Op times are measured with the recorder on and scaled so that
   they sum to the block's forward time: the lesser of its two hook-timed forwards, then the median over
   structurally equal blocks with equal input shapes. The step time is the checkpointed step's less its
   blocks' forwards (an estimate: no extra plain step runs, which keeps profiling within five training
   steps).
5. **[a region must be exact]** A region (``apply.wrap_region``) runs its blocks from its first block's
   arguments, passing each the previous one's hidden state (the output, or its first item when a tuple),
   and its other blocks return the region's output: its hidden state, and the other items of the last
   block's output. So ``chain`` (regions allowed) holds only if, in the plain step, every block but the
   first gets the previous block's hidden state as its first positional argument and the same other
   arguments (tensors the same objects, other values equal), every block returns a tensor or a tuple
   starting with one whose other items have the same structure as the previous block's, and no forward
   op (the recorder watches every op of the step) reads a block's output, except the last block's,
   anywhere but the next block: neither its hidden state elsewhere nor its other tensors anywhere. A
   U-Net encoder whose blocks return ``(h, skip)`` fails the last test. Otherwise ``chain`` is False:
   plans have single blocks only, ``notes["chain"]`` and the plan's ``notes["regions"]`` say why, and
   the reason is logged (``logging``, "torchckpt", INFO).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchckpt._host import preserved_state
from torchckpt.executor import CheckpointHandle, checkpoint_modules
from torchckpt.executor.kv_cache import kv_cache_off
from torchckpt.memory import MemoryMeter
from torchckpt.planner import solve as solver
from torchckpt.planner.apply import wrap_region
from torchckpt.planner.blocks import resolve_blocks
from torchckpt.planner.costs import BlockCosts, ChainCosts, OpCosts
from torchckpt.planner.plan import PlannedBlock, PlannedRegion
from torchckpt.planner.probe import Probe, block_times, measure_step
from torchckpt.planner.runner import StepRunner

__all__ = ["profile", "HEADROOM_BYTES", "HEADROOM_FRACTION"]

HEADROOM_BYTES = 64 * 1024
HEADROOM_FRACTION = 0.005
"""Added to ``fixed_bytes``: 64 KiB plus 0.5% of the no-checkpointing step's activation bytes. Small
tensors that live in one step and not another move a measured peak by a few hundred bytes, and some
selective plans on HF Llama measured up to 64 KiB above their prediction (2 hidden states of that
test model); plans keep this room so that a plan at its budget still measures within it."""

_log = logging.getLogger("torchckpt")
def profile(
    model: nn.Module,
    example_inputs: tuple | dict,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: str | Sequence[nn.Module] = "auto",
    progress: Callable[[str], None] | None = None,
    regions: bool = True,
) -> ChainCosts:
    """Measure ``model`` on ``example_inputs`` and return its cost model.

    Runs three training steps, all under the meter: every block checkpointed (keep nothing), which also
    warms up (with ``optimizer`` it is followed by a real optimizer step, so its state exists as it will
    in training); a plain step with the op recorder; and, when the blocks form a chain, one with a
    region of blocks to calibrate ``region_recompute_bytes``. Block forward times come from the hooks of
    the first two. Afterwards the model (parameters, buffers, gradients, modes), the optimizer's state and
    the RNG streams are exactly as they were (Note: [planning changes nothing]). ``progress``, if given,
    is called with a short description before each step (for a display). ``regions=False`` skips the
    third step and marks the costs (``notes["regions"]``) so that no plan made from them has regions;
    plans have none either when the profiler cannot prove a region exact (``notes["chain"]`` says why).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=16))
        >>> len(costs.blocks), costs.blocks[0].input_bytes
        (2, 8192)
    """
    block_list = resolve_blocks(model, blocks)
    runner = StepRunner(model, example_inputs, loss_fn, optimizer)
    with preserved_state(model, optimizer), kv_cache_off([model], while_="profiling"):
        runner.clear_grads()  # the user's gradients come back afterwards; they are not part of the step
        return _measure_costs(runner, block_list, progress, regions)


def _measure_costs(runner: StepRunner, block_list: list[nn.Module],
                   progress: Callable[[str], None] | None, regions: bool = True) -> ChainCosts:
    say = progress or (lambda message: None)
    say(f"profiling step 1: {len(block_list)} blocks, every block recomputed")
    start = time.perf_counter()
    with checkpoint_modules(block_list, policy="nothing_saveable"):
        recomputed = measure_step(runner, block_list, record_ops=False)
    recomputed_step_s = time.perf_counter() - start
    runner.optimizer_step()
    say("profiling step 2: no checkpointing, recording every op")
    plain = measure_step(runner, block_list, record_ops=True)
    runner.clear_grads()
    times = block_times(block_list, recomputed, plain)
    # The checkpointed step ran every block's forward twice; without the recomputation it is a plain step.
    step_time_s = max(recomputed_step_s - sum(times), sum(times))
    costs = _assemble(plain, recomputed, times, step_time_s, [type(b).__name__ for b in block_list])
    if not regions:
        costs = replace(costs, notes={**costs.notes, "regions": "off (profiled with regions=False)"})
    elif costs.chain and len(block_list) > 1:
        say("profiling step 3: a region of two blocks")
        costs = replace(costs, region_recompute_bytes=_region_residue(runner, block_list, costs))
    return costs


def _region_residue(runner: StepRunner, blocks: list[nn.Module], costs: ChainCosts) -> int:
    """Measure one step with blocks 0 and 1 as one region (plain inside) and the other blocks plain; return
    the measured peak above what the solver's evaluator predicts for that schedule without
    ``region_recompute_bytes``. A region that is not the last piece is the common case in plans, and its
    recomputation also keeps the gradient arriving at the region alive; the residue absorbs it. (Two
    blocks keep this step's recomputation short; with two blocks in all the region covers both.)"""
    n = len(blocks)
    stop = 2
    inner = tuple(PlannedBlock(block=i, plain=True) for i in range(stop))
    wrapped: list[nn.Module] = []
    wrap_region(PlannedRegion(start=0, stop=stop, inner=inner), blocks, wrapped)
    try:
        runner.clear_grads()
        with MemoryMeter() as meter:
            runner.forward_backward()
    finally:
        CheckpointHandle(wrapped).remove()
        runner.clear_grads()
    region = solver.Region(start=0, stop=stop, inner=tuple(solver.Single(block=i, option=0) for i in range(stop)))
    schedule: tuple[solver.Piece, ...] = (region, *(solver.Single(block=i, option=0) for i in range(stop, n)))
    measured_fixed = costs.fixed_bytes - int(costs.notes["headroom_bytes"])
    predicted, _ = solver.evaluate(replace(costs, fixed_bytes=measured_fixed, region_recompute_bytes=0), schedule)
    # Plus one block output: with checkpointed blocks nested inside a region that is followed by other
    # pieces, one more output-sized gradient is alive than this calibration region shows (measured on
    # gpt("small") at 16 x 384 tokens: 9.4 MB under-predicted without it). Conservative elsewhere.
    return max(0, meter.peak_bytes - int(predicted)) + max(block.output_bytes for block in costs.blocks)


def _assemble(plain: Probe, recomputed: Probe, times: list[float], step_time_s: float,
              names: list[str]) -> ChainCosts:
    traces, n = plain.traces, len(plain.traces)
    fixed = traces[0].before_forward - traces[0].input_bytes
    ckpt_fixed = recomputed.traces[0].before_forward - traces[0].input_bytes
    plain_peak = max([plain.head_peak] + [t.forward_peak for t in traces] + [t.backward_peak or 0 for t in traces])
    headroom = HEADROOM_BYTES + int(HEADROOM_FRACTION * max(0, plain_peak - fixed))
    # Regions need the blocks to be called as a chain: each block's first input is the previous output,
    # and a region must not change what the model computes ([a region must be exact]).
    chain = all(traces[k + 1].input_id == traces[k].output_id for k in range(n - 1))
    problems = plain.recorder.chain_problems if plain.recorder is not None else []
    if chain and problems:
        chain = False
        _log.info("torchckpt: plans for this model have no regions (blocks checkpointed together): %s", problems[0])
    reason = problems[0] if problems else "a block's first input is not the previous block's first output"
    chain_note = "yes: regions allowed" if chain else f"no: {reason}; plans checkpoint single blocks only"
    if chain:
        inputs = [t.input_bytes for t in traces]
        saved = [max(0, t.after_forward - t.before_forward - t.output_bytes) for t in traces]
        input_held = [t.input_alive_at_backward for t in traces]
    else:  # the boundary readings already telescope what a plain block holds, its input or not
        inputs, saved = _held_between_blocks(plain, recomputed, fixed, ckpt_fixed)
        input_held = [True] * n
    # costs.py's [what a piece holds]: what each block holds through the plain step's backward pass, and what a
    # checkpoint of it holds beyond its input (the step above ran every block so).
    freed = [t.freed_side_input_bytes for t in traces]
    plain_held = [(inputs[i] if input_held[i] else 0) + saved[i] for i in range(n)]
    last_output = traces[-1].output_bytes
    held_before = [sum(plain_held[:i]) for i in range(n)]
    head = max(0, plain.head_peak - fixed - held_before[-1] - plain_held[-1])
    blocks = []
    for i, trace in enumerate(traces):
        incoming = 0 if i == n - 1 else trace.output_bytes
        base = fixed + last_output + held_before[i] + plain_held[i] + incoming
        backward = max(0, (trace.backward_peak or 0) - base)
        # [forward peak] counts C, which holds the last block's output gradient; that is not alive in the forward pass.
        forward = max(0, trace.forward_peak - (fixed + last_output + held_before[i] + inputs[i]))
        ckpt_trace = recomputed.traces[i]
        ckpt_held = sum(inputs[:i]) + sum(freed[:i])
        ckpt_base = ckpt_fixed + last_output + ckpt_held + inputs[i] + freed[i] + saved[i] + incoming + backward
        recompute = max(0, (ckpt_trace.backward_peak or 0) - ckpt_base)
        op_time_total = sum(op["time_s"] for op in trace.ops) or 1.0
        ops = tuple(OpCosts(index=op["index"], name=op["name"], output_bytes=op["output_bytes"],
                            saved=op["saved"] and op["keepable"] and not op.get("mutated", False),
                            time_s=op["time_s"] * times[i] / op_time_total) for op in trace.ops)
        blocks.append(BlockCosts(name=f"{i}:{names[i]}", input_bytes=inputs[i],
                                 output_bytes=trace.output_bytes, saved_bytes=saved[i], forward_time_s=times[i],
                                 forward_peak_bytes=forward, backward_peak_bytes=backward,
                                 recompute_peak_bytes=recompute, ops=ops, input_held_when_plain=input_held[i],
                                 freed_side_input_bytes=freed[i]))
    return ChainCosts(fixed_bytes=fixed + headroom, head_bytes=head, blocks=tuple(blocks), step_time_s=step_time_s,
                      chain=chain, notes={"headroom_bytes": str(headroom), "chain": chain_note})


def _held_between_blocks(plain: Probe, recomputed: Probe, fixed: int,
                         ckpt_fixed: int) -> tuple[list[int], list[int]]:
    """Per block, the bytes held through the backward pass when checkpointed and the extra when plain.

    For blocks that are not called as a chain (U-Net skips, an encoder's output read by every decoder
    block) the code between blocks keeps tensors too: a pooled skip's input, a concatenation, the encoder
    output. ``H_i``, what is held before block ``i`` starts beyond ``fixed`` and its input, is read at each
    block boundary of both measured steps; block ``i`` is charged ``H_{i+1} - H_i`` (with ``H_n`` read
    after the last block, less its output), so the all-plain and all-checkpointed plans telescope to the
    measured figures exactly whatever the code between blocks keeps.
    """
    def held(probe: Probe, fixed: int) -> list[int]:
        traces = probe.traces
        before = [t.before_forward - fixed - t.input_bytes for t in traces]
        return before + [traces[-1].after_forward - fixed - traces[-1].output_bytes]

    plain_held, ckpt_held = held(plain, fixed), held(recomputed, ckpt_fixed)
    n = len(plain.traces)
    inputs = [max(0, ckpt_held[i + 1] - ckpt_held[i]) for i in range(n)]
    saved = [max(0, plain_held[i + 1] - plain_held[i] - inputs[i]) for i in range(n)]
    return inputs, saved
