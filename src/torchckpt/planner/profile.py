"""Measure a model into a cost model (``from_costs.ChainCosts``). Measures only; decides nothing.

The block hooks (``probe.py``), the op recorder (``recorder.py``) and the assembly of the costs here all read
the marks of the same measured steps.

How each figure of ``costs.py`` is obtained (the names of that module's rules in brackets):

1. **[two measured steps]** Two real training steps run under a ``MemoryMeter``: one with every block
   checkpointed (keep nothing), which is also the warm-up (the optimizer's state is created after it, so
   its figures are taken relative to its own ``fixed``), then one plain. Hooks mark each block's forward
   (pre/post hooks) and backward (a gradient hook on the block's output marks its start, and its window stays
   open until the next block's starts, so what runs between two blocks' backward passes counts in the first;
   block 0's ends at its input's gradient, where [backward-end peak] begins); the meter's peak is read between
   marks. The first step's peak at the marks, on the plain
   step's ``fixed``, is ``every_block_peak_bytes`` (costs.py's [measured schedules are predicted as
   measured]). Then two bare steps (no meter, no hooks, no recorder) are timed: a plain one
   (``step_time_s``) and one with every block checkpointed (``every_block_step_time_s``).
2. **[byte figures from block marks]** ``fixed_bytes`` is what is live when block 0 starts, minus block
   0's input, as measured (no headroom: the margin of plans not measured is ``margin_bytes``, see
   ``HEADROOM_*``); ``saved_bytes`` is what a block's forward leaves behind minus its output [what a
   piece holds]; ``input_held_when_plain`` is whether the block's input storage (watched through a weak
   reference) is still alive when the block's backward pass begins in the plain step [what a piece
   holds]; ``freed_side_input_bytes`` is, of the block's other tensor inputs (positional and keyword,
   each storage once, the first input's storage excluded), the bytes of those whose storage is dead at
   that moment [what a piece holds]; ``head_bytes`` is the peak between the last block's forward and the
   first block backward, above fixed and everything the blocks hold [forward-end peak]; ``tail_bytes`` is the
   peak after block 0's backward pass, above fixed, the larger of the two steps' [backward-end peak].
3. **[the plain plan is predicted exactly]** ``backward_peak_bytes`` and ``forward_peak_bytes`` are the
   measured peaks minus what [backward peak] and [forward peak] already count, so the all-plain plan is
   predicted exactly; they absorb what the model does not name (parameter gradients created so far, the
   head's leftovers). ``recompute_peak_bytes`` is the same residue from the checkpointed step, above the
   plain one.
4. **[ops are numbered as the executor numbers them]** Ops are recorded inside each block's plain forward
   with the executor's own numbering (``aten.detach`` skipped, ``tag`` visible as in a checkpointed
   region), so ``save_ops`` indices in a plan refer to them. An op is ``saved`` when autograd saves a
   tensor whose storage the op created and the executor can keep its outputs (``policies.can_keep``: not
   a view, not in-place, not random, and not written in place later). SDPA is tagged random by ATen (it
   takes ``dropout_p``), so it is recomputed under any policy; counting it as kept over-predicted
   selective plans by its output per block (2.16 MB per block on gpt("mini") at 16 x 256 tokens) and
   under-predicted their recompute time. Op times are measured with the recorder on and scaled so that
   they sum to the block's forward time: the lesser of its two hook-timed forwards, then the median over
   structurally equal blocks with equal input shapes, then scaled by one factor for all blocks
   (``notes["recompute_time_scale"]``) so that the every-block schedule's predicted extra time, the sum
   of the forwards, equals the measured ``every_block_step_time_s - step_time_s`` (hooks, the meter and
   the recorder slow the marked steps down, and the first step also warms up). Profiling runs five
   training steps at most (the fifth, a region, measures ``region_recompute_bytes``), eight under DDP
   or FSDP2 (three warm-up steps first: [the distributed engine warms up unmeasured]), plus: one forward pass
   without gradients first (repeat.py's [a block is recomputed only if it repeats]), an unmeasured step with
   ``micro_batches`` > 1 or the optimizer in the backward pass, the options step (``options_step.py``; with
   ``batch_slices``, one forward pass without gradients before it: planner/batch_slices.py's [only blocks
   measured exact are sliced]), and up to three steps for other groupings (other_blocks.py's [a much lower
   floor elsewhere is named]).
5. **[a region must be exact]** A region (``apply.wrap_region``) runs its blocks from its first block's
   arguments, passing each the previous one's hidden state (the output, or its first item when a tuple),
   and its other blocks return the region's output: its hidden state, and the other items of the last
   block's output. So ``chain`` (regions allowed) holds only if, in the plain step, every block but the
   first gets the previous block's hidden state as its first positional argument and the same other
   arguments (tensors the same objects, other values equal), every block returns a tensor or a tuple
   starting with one whose other items have the same structure as the previous block's, and no forward
   op (the recorder watches every op of the step) reads a block's output, except the last block's,
   anywhere but the next block: neither its hidden state elsewhere nor its other tensors anywhere. A
   U-Net encoder whose blocks return ``(h, skip)`` fails the last test. Nor may random numbers be drawn between
   two blocks (torch's, NumPy's or ``random``'s: a region would draw them after its blocks' own), nor blocks be
   called under different grad or autocast modes. Otherwise ``chain`` is False:
   plans have single blocks only, ``notes["chain"]`` and the plan's ``notes["regions"]`` say why, and
   the reason is logged (``logging``, "torchckpt", INFO).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchckpt._host import paused_gc, preserved_state
from torchckpt._progress import block_ticks, phase, phases_to
from torchckpt.executor import CheckpointHandle, checkpoint_modules
from torchckpt.executor.compiled import any_compiled, eager_measurement, uncompiled
from torchckpt.executor.kv_cache import kv_cache_off
from torchckpt.memory import MemoryMeter
from torchckpt.planner import solve as solver
from torchckpt.planner.apply import wrap_region
from torchckpt.planner.batch_slices import check_batch_slices
from torchckpt.planner.blocks import block_paths, resolve_blocks
from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.distributed import (
    agree_costs,
    agree_flag,
    engine_of,
    process_group_of,
    same_outcome,
    sharded_blocks_note,
)
from torchckpt.planner.from_costs import ChainCosts, no_checkpointing_schedule
from torchckpt.planner.head import check_loss_head_arg
from torchckpt.planner.layerdrop import layerdrop_off
from torchckpt.planner.offload_step import check_offload_args, measure_offload
from torchckpt.planner.optimizer_options import check_optimizer_options, optimizer_options, optimizer_step_peak
from torchckpt.planner.options_step import measure_options
from torchckpt.planner.other_blocks import other_blocks_note
from torchckpt.planner.plan import PlannedBlock, PlannedRegion, fingerprint
from torchckpt.planner.probe import BlockOrderError, Probe, block_times, measure_step, time_scale, timed_step
from torchckpt.planner.repeat import plain_only, unrepeatable_blocks
from torchckpt.planner.runner import StepFn, StepRunner
from torchckpt.planner.stem import STEM_REGIONS, stem_choice

__all__ = ["profile", "HEADROOM_BYTES", "HEADROOM_FRACTION"]

HEADROOM_BYTES = 64 * 1024
HEADROOM_FRACTION = 0.005
"""``ChainCosts.margin_bytes`` (what ``margin="auto"`` keeps): 64 KiB plus 0.5% of the no-checkpointing
step's activation bytes, kept below the budget by every plan the profiler did not measure. Small
tensors that live in one step and not another move a measured peak by a few hundred bytes, and some
selective plans on HF Llama measured up to 64 KiB above their prediction (2 hidden states of that
test model). The two measured schedules (no checkpointing, every block checkpointed) keep none:
``fixed_bytes`` is the measured figure, without headroom."""

DISTRIBUTED_WARM_UP_STEPS = 2
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
    step_fn: StepFn | None = None,
    loss_head: bool | str = True,
    pieces: bool = True,
    optimizer_in_backward: bool = False,
    optimizer_offload: bool = False,
    micro_batches: int = 1,
    batch_slices: int = 1,
    offload: bool = False,
    host_budget: int | str | None = None,
) -> ChainCosts:
    """Measure ``model`` on ``example_inputs`` and return its cost model.

    Runs at most six training steps (eight under DDP or FSDP2, three of them a warm-up; seven with
    ``optimizer_in_backward``): under the meter,
    every block checkpointed (keep nothing), which also warms up (with ``optimizer`` it is followed by a real
    optimizer step, so its state exists as it will in training), and a plain step with the op recorder; then,
    bare (no meter, no hooks), a plain step and one with every block checkpointed, timed (``step_time_s``,
    ``every_block_step_time_s``); and, when the blocks form a chain, one with a region of blocks under the
    meter to calibrate ``region_recompute_bytes``. Block forward times come from the hooks of the first two,
    scaled so that checkpointing every block is predicted to cost what it measured (costs.py's [measured
    schedules are predicted as measured]). The costs record the block paths and the model's fingerprint, so
    ``costs.plan(budget)`` plans any number of budgets from this one measurement. Afterwards the model
    (parameters, buffers, gradients, modes), the optimizer's state and the RNG streams are exactly as they
    were (Note: [planning changes nothing]). ``progress``, if given, is called with a short description before
    each step (for a display). ``regions=False`` skips the region step and marks the costs
    (``notes["regions"]``) so that no plan made from them has regions; plans have none either when the
    profiler cannot prove a region exact (``notes["chain"]`` says why). ``step_fn(model, example_inputs)``,
    instead of ``loss_fn``, runs the user's own forward and backward (``runner.StepRunner``), so the steps
    measure what that loop holds (the logits, say). A model under ``DistributedDataParallel`` or FSDP2 is
    profiled by every rank of its group at once (a collective), each measuring its own step; the costs
    returned on every rank are the largest any rank measured (``planner.distributed``), so every rank makes
    the same plan for a per-rank budget. ``loss_head`` (True: found; a module path; False: off) adds one measured
    step with the LM head computed in chunks of tokens, a plan option (``costs.loss_head``, planner/head.py).
    ``pieces`` (default True) adds one measured step with every block checkpointed and its pieces nested inside
    it (costs.py's [pieces nested inside a block]), a menu option of each block that has pieces.
    ``optimizer_in_backward=True`` (needs ``optimizer``) measures every step with the optimizer's update run per
    parameter inside the backward pass (``executor/optimizer_in_backward.py``), so gradients do not all live at
    once; plans from these costs say so and ``apply`` installs it. ``optimizer_offload=True`` (needs ``optimizer``)
    keeps its state in host memory between steps (executor/optimizer_offload.py) while measuring, and so do plans
    from these costs when applied; the optimizer step's own peak is measured. ``micro_batches`` > 1 (gradient
    accumulation: that many backward passes per optimizer step) measures every step as the second micro-batch runs
    it, the first's gradients alive from its start (Note: [a later micro-batch peaks highest]). ``batch_slices`` k > 1
    (opt-in): see ``torchckpt.plan`` and costs.py's [pieces nested inside a block]. ``offload=True`` (opt-in)
    adds five steps and a bandwidth calibration (planner/offload_step.py) for costs.py's [offloaded blocks].

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=16))
        >>> len(costs.blocks), costs.blocks[0].input_bytes
        (2, 8192)
    """
    compiled = any_compiled(model)  # before the original is taken below
    offload_options = dict(offload=offload, compiled=compiled, host_budget=check_offload_args(offload, host_budget))
    model = uncompiled(model)  # Note: [a compiled model is planned through its original]
    check_loss_head_arg(model, loss_head)
    options = {"loss_head": loss_head, "pieces": pieces, "batch_slices": check_batch_slices(batch_slices),
               "compiled": compiled}
    check_optimizer_options(optimizer, optimizer_in_backward=optimizer_in_backward,
                            optimizer_offload=optimizer_offload, micro_batches=micro_batches, batch_slices=batch_slices)
    group = process_group_of(model)  # planner/distributed.py's [a distributed model is planned by all its ranks]
    if optimizer_offload and group is not None:  # the same on every rank: all refuse
        raise ValueError("optimizer_offload=True is not planned under DDP or FSDP2 yet (FSDP2 has its own "
                         "offload_policy=CPUOffloadPolicy()); plan without it")
    block_list = resolve_blocks(model, blocks)
    regions_off = sharded_blocks_note(block_list) if regions else "off (profiled with regions=False)"
    runner = StepRunner(model, example_inputs, loss_fn, optimizer, step_fn=step_fn, micro_batches=micro_batches)
    in_backward = optimizer_options(optimizer, in_backward=optimizer_in_backward, offload=optimizer_offload)
    with preserved_state(model, optimizer), kv_cache_off([model], while_="profiling"), paused_gc(), \
            eager_measurement(), in_backward, layerdrop_off(model) as skipping:
        runner.clear_grads()  # the user's gradients come back afterwards; they are not part of the step
        if optimizer_in_backward or micro_batches > 1:  # the optimizer's state is made in a backward pass, and the
            runner.forward_backward()  # gradients a later micro-batch finds are learned in one: not a measured one
            runner.clear_grads()
        if group is not None:
            phase(f"warming up {engine_of(model)} ({DISTRIBUTED_WARM_UP_STEPS + 1} steps, not measured)")
            _engine_warm_up(runner, block_list)
        phase("checking which blocks can be recomputed (a forward pass without gradients)")
        # repeat.py's [a block is recomputed only if it repeats]; by module, as "auto" may reorder the blocks below
        unrepeatable = {} if engine_of(model) == "FSDP2" else {  # FSDP2 reshards a block's parameters after its forward
            id(block_list[i]): why for i, why in unrepeatable_blocks(runner, block_list).items()}
        try:
            costs = _measure_costs(runner, block_list, progress, regions_off, group, options)
        except BlockOrderError as error:  # on every rank alike (planner.distributed.same_outcome)
            if not (isinstance(blocks, str) and blocks == "auto"):
                raise
            # "auto" lists the blocks in named_modules order; a model may run them in another (diffusers' AutoencoderKL
            # registers its decoder's up blocks before the mid block it runs first): profile again in their order.
            block_list = [block_list[k] for k in error.ran]
            runner.clear_grads()
            phase("profiling again, with the blocks in the order they ran")
            costs = _measure_costs(runner, block_list, progress, regions_off, group, options)
        if isinstance(blocks, str) and group is None:  # stem.py's [a stem is taken only where it measures lower]
            stem, stem_note = stem_choice(runner, block_list, costs)
            if stem is not None:
                block_list, regions_off = [stem, *block_list], regions_off or STEM_REGIONS
                phase("profiling again, with the stem as the first block")
                costs = _measure_costs(runner, block_list, progress, regions_off, group, options)
            if stem_note is not None:
                costs = replace(costs, notes={**costs.notes, "stem": stem_note})
        costs = measure_offload(runner, block_list, costs, phases_to(progress), group, **offload_options)  # type: ignore[arg-type]
        if isinstance(blocks, str) and group is None:  # other_blocks.py's [a much lower floor elsewhere is named]
            plain, _ = solver.evaluate(costs, no_checkpointing_schedule(costs))
            peak = costs.every_block_peak_bytes
            phase("checking whether another grouping of blocks has a much lower floor")
            found = costs.block_paths[1:] if stem is not None else costs.block_paths  # the groupings beside these
            other = other_blocks_note(runner, found, peak, int(plain), costs.fixed_bytes)
            if other is not None:
                costs = replace(costs, notes={**costs.notes, "other blocks": other})
        costs = replace(costs, state_bytes=runner.state_bytes())  # the optimizer's state exists by now
    if skipping is not None and costs.notes.get("regions") in (None, STEM_REGIONS):  # layerdrop.py's rule, named
        costs = replace(costs, notes={**costs.notes, "regions": skipping})
    costs = plain_only(costs, {i: unrepeatable[id(block)] for i, block in enumerate(block_list)
                               if id(block) in unrepeatable})
    costs = replace(costs, optimizer_in_backward=optimizer_in_backward, optimizer_offload=optimizer_offload)
    if micro_batches > 1:
        costs = replace(costs, micro_batches=micro_batches)
    if group is None:
        return costs
    costs = replace(costs, notes={**costs.notes, "engine": str(engine_of(model))})
    return agree_costs(costs, group)  # planner/distributed.py's [ranks agree on the costs]


def _engine_warm_up(runner: StepRunner, block_list: list[nn.Module]) -> None:
    """Note: [the distributed engine warms up unmeasured]: DDP builds its gradient buckets in the first
    backward pass and rebuilds them, in the order gradients arrived, in the second, and keeps buffers
    the first step with checkpointed blocks allocates; FSDP2 initialises lazily in the first. Those
    one-time allocations must not count in a measured step, so a distributed model runs two plain
    forward and backward passes and one with every block checkpointed first, unmeasured (no optimizer
    step)."""
    for checkpointed in [False] * DISTRIBUTED_WARM_UP_STEPS + [True]:
        runner.clear_grads()
        with MemoryMeter(runner.device):  # the steps' first run under a dispatch mode happens here too
            if checkpointed:
                with checkpoint_modules(block_list, policy="nothing_saveable"):
                    runner.forward_backward()
            else:
                runner.forward_backward()
    runner.clear_grads()


def _measure_costs(runner: StepRunner, block_list: list[nn.Module], progress: Callable[[str], None] | None,
                   regions_off: str | None = None, group: Any = None, options: dict | None = None) -> ChainCosts:
    """The profile's steps; ``regions_off``, when given, says why plans from these costs have no regions;
    ``options``: ``measure_options``' keywords (``loss_head``, ``pieces``, ``batch_slices``).
    With a process ``group``, every decision that changes which steps run is taken by all ranks alike."""
    say = phases_to(progress)

    def step(record_ops: bool) -> Any:
        def measure() -> Any:
            with block_ticks(block_list):  # _progress.py's [reported per phase, never per op]
                return measure_step(runner, block_list, record_ops=record_ops)
        return measure() if group is None else same_outcome(measure, group)

    say(f"profiling step 1: {len(block_list)} blocks, every block recomputed")
    with checkpoint_modules(block_list, policy="nothing_saveable"):
        recomputed = step(record_ops=False)
    step_peak = optimizer_step_peak(runner)  # optimizer_options.py's rule
    say("profiling step 2: no checkpointing, recording every op")
    plain = step(record_ops=True)
    runner.clear_grads()
    say("profiling steps 3-4: timing a plain step and one with every block recomputed (no meter, no hooks)")
    plain_step_s = timed_step(runner)
    with checkpoint_modules(block_list, policy="nothing_saveable"):
        every_block_step_s = timed_step(runner)
    times = block_times(block_list, recomputed, plain)
    costs = _assemble(plain, recomputed, times, (plain_step_s, every_block_step_s),
                      [type(b).__name__ for b in block_list])
    paths = tuple(block_paths(runner.model, block_list))
    costs = replace(costs, block_paths=paths, fingerprint=fingerprint(runner.model, runner.example_inputs, list(paths)))
    if step_peak is not None:  # optimizer_options.py's [the optimizer step's peak is measured with its state offloaded]
        costs = replace(costs, tail_bytes=max(costs.tail_bytes, step_peak - costs.fixed_bytes),
                        every_block_peak_bytes=max(costs.every_block_peak_bytes, step_peak))
    if group is not None and not agree_flag(costs.chain, group) and costs.chain:  # the region step runs on all or none
        costs = replace(costs, chain=False, notes={**costs.notes, "chain": "no: another rank's profile found the "
                                                   "blocks are not a plain chain"})
    if regions_off is not None:
        costs = replace(costs, notes={**costs.notes, "regions": regions_off})
    elif costs.chain and len(block_list) > 1 and "regions" not in costs.notes:
        say("profiling step 5: a region of two blocks")
        costs = replace(costs, region_recompute_bytes=_region_residue(runner, block_list, costs))
    return measure_options(runner, block_list, costs, recomputed, say, group, **(options or {}))


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
        with MemoryMeter(runner.device) as meter:
            runner.forward_backward()
    finally:
        CheckpointHandle(wrapped).remove()
        runner.clear_grads()
    region = solver.Region(start=0, stop=stop, inner=tuple(solver.Single(block=i, option=0) for i in range(stop)))
    schedule: tuple[solver.Piece, ...] = (region, *(solver.Single(block=i, option=0) for i in range(stop, n)))
    predicted, _ = solver.evaluate(replace(costs, region_recompute_bytes=0), schedule)
    # Plus one block output: with checkpointed blocks nested inside a region that is followed by other
    # pieces, one more output-sized gradient is alive than this calibration region shows (measured on
    # gpt("small") at 16 x 384 tokens: 9.4 MB under-predicted without it). Conservative elsewhere.
    return max(0, meter.peak_bytes - int(predicted)) + max(block.output_bytes for block in costs.blocks)


def _assemble(plain: Probe, recomputed: Probe, times: list[float], step_times_s: tuple[float, float],
              names: list[str]) -> ChainCosts:
    traces, n = plain.traces, len(plain.traces)
    fixed = traces[0].before_forward - traces[0].input_bytes
    ckpt_fixed = recomputed.traces[0].before_forward - traces[0].input_bytes
    plain_peak = _peak_at_marks(plain)
    margin = HEADROOM_BYTES + int(HEADROOM_FRACTION * max(0, plain_peak - fixed))
    # [measured schedules are predicted as measured]: step 1 on the plain step's fixed bytes (the optimizer's
    # state, if any, was created after it).
    every_block_peak = _peak_at_marks(recomputed) - ckpt_fixed + fixed
    plain_step_s, every_block_step_s = step_times_s
    scale, time_note = time_scale(times, plain_step_s, every_block_step_s)
    times = [t * scale for t in times]
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
        ckpt_held = sum(_ckpt_held(traces[k], inputs[k], input_held[k]) for k in range(i))
        ckpt_base = (ckpt_fixed + last_output + ckpt_held + _ckpt_held(trace, inputs[i], input_held[i]) + saved[i]
                     + incoming + backward)
        recompute = max(0, (ckpt_trace.backward_peak or 0) - ckpt_base)
        op_time_total = sum(op["time_s"] for op in trace.ops) or 1.0
        ops = tuple(OpCosts(index=op["index"], name=op["name"], output_bytes=op["output_bytes"],
                            saved=op["saved"] and op["keepable"] and not op.get("mutated", False),
                            time_s=op["time_s"] * times[i] / op_time_total, alive_bytes=op.get("alive_bytes", -1))
                    for op in trace.ops)
        blocks.append(BlockCosts(name=f"{i}:{names[i]}", input_bytes=inputs[i],
                                 output_bytes=trace.output_bytes, saved_bytes=saved[i], forward_time_s=times[i],
                                 forward_peak_bytes=forward, backward_peak_bytes=backward,
                                 recompute_peak_bytes=recompute, ops=ops, input_held_when_plain=input_held[i],
                                 freed_side_input_bytes=freed[i], has_backward=trace.has_backward,
                                 checkpoint_residue_bytes=max(0, ckpt_trace.after_forward - ckpt_trace.before_forward
                                                              - ckpt_trace.outputs_bytes)))
    # costs.py's [backward-end peak]: the same in both steps but for noise; the larger
    tail = max(0, plain.tail_peak - fixed, recomputed.tail_peak - ckpt_fixed)
    costs = ChainCosts(fixed_bytes=fixed, head_bytes=head, blocks=tuple(blocks), step_time_s=plain_step_s,
                       tail_bytes=tail,
                       chain=chain, margin_bytes=margin, every_block_step_time_s=every_block_step_s,
                       notes={"chain": chain_note, "recompute_time_scale": time_note,
                              "headroom_bytes": "0"})  # fixed_bytes holds none now (margin_bytes); for old readers
    left = [i for i, b in enumerate(blocks) if b.checkpoint_residue_bytes > 0]
    if chain and left:  # costs.py's [what a piece holds]: a region would hold every inside block's residue
        costs = replace(costs, notes={**costs.notes, "regions": (
            f"off: checkpointed, block {left[0]} leaves {blocks[left[0]].checkpoint_residue_bytes} bytes alive after "
            "its forward pass besides its outputs (autocast's cached weight casts, say), which a region would hold "
            "for every block inside it")})
    every_block = tuple(solver.Single(block=i, option=len(solver.block_menu(b)) - 1) for i, b in enumerate(blocks))
    model_peak, _ = solver.evaluate(costs, every_block)
    # Step 1 is also the warm-up: first-call allocations (lazily built caches) can raise its peak above a
    # steady step's, which the peak model's rules then predict better; the lesser of the two is kept (each is
    # at or above the steady step's peak wherever measured).
    return replace(costs, every_block_peak_bytes=min(every_block_peak, int(model_peak)),
                   notes={**costs.notes, "every_block_peak": f"measured {every_block_peak} B; the peak model's rules "
                          f"give {model_peak} B ({model_peak - every_block_peak:+d} B)"})


def _ckpt_held(trace: Any, input_bytes: int, input_held: bool) -> int:
    if not trace.has_backward:
        return input_bytes if input_held else 0
    return input_bytes + trace.freed_side_input_bytes


def _peak_at_marks(probe: Probe) -> int:
    """The step's peak as the probe's marks read it: every block's forward and backward, and the head."""
    traces = probe.traces
    return max([probe.head_peak, probe.tail_peak] + [t.forward_peak for t in traces]
               + [t.backward_peak or 0 for t in traces])


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
