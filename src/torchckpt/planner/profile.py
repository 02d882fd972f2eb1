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
"""

from __future__ import annotations

import functools
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchckpt.executor import CheckpointHandle, checkpoint_modules
from torchckpt.executor.checkpoint import can_keep
from torchckpt.executor.policies import TAG_STATE, op_name
from torchckpt.memory import MemoryMeter
from torchckpt.planner import solve as solver
from torchckpt.planner.apply import wrap_region
from torchckpt.planner.blocks import resolve_blocks, structure_key
from torchckpt.planner.costs import BlockCosts, ChainCosts, OpCosts
from torchckpt.planner.plan import PlannedBlock, PlannedRegion
from torchckpt.planner.runner import StepRunner

__all__ = ["profile", "HEADROOM_BYTES", "HEADROOM_FRACTION"]

HEADROOM_BYTES = 64 * 1024
HEADROOM_FRACTION = 0.005
"""Added to ``fixed_bytes``: 64 KiB plus 0.5% of the no-checkpointing step's activation bytes. Small
tensors that live in one step and not another move a measured peak by a few hundred bytes, and some
selective plans on HF Llama measured up to 64 KiB above their prediction (2 hidden states of that
test model); plans keep this room so that a plan at its budget still measures within it."""

_DETACH = torch.ops.aten.detach.default
_TAG = torch.ops.aten.alias.default  # what ``tag`` dispatches (policies.py)


def _first_tensor(value: Any) -> torch.Tensor | None:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    return None


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


def _side_inputs(inputs: Any, first: torch.Tensor | None) -> list[tuple[weakref.ref, int]]:
    """Weak references to the storages of a block's tensor inputs other than ``first``'s, each once: what
    a checkpoint of the block keeps alive besides its first input."""
    # The list holds every storage object while ids are compared, so no id can be reused meanwhile.
    storages = [leaf.untyped_storage() for leaf in tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor)]
    seen = set() if first is None else {id(first.untyped_storage())}
    found = []
    for storage in storages:
        if id(storage) not in seen:
            seen.add(id(storage))
            found.append((weakref.ref(storage), storage.nbytes()))
    return found


@dataclass
class _BlockTrace:
    input_bytes: int = 0
    output_bytes: int = 0
    before_forward: int = 0
    after_forward: int = 0
    forward_peak: int = 0
    forward_s: float = 0.0
    backward_peak: int | None = None
    calls: int = 0
    input_id: int = 0
    input_shape: tuple = ()
    order: int = -1
    output_id: int = 0
    ops: list[dict] = field(default_factory=list)
    input_storage: weakref.ref | None = None  # weak: the probe must not keep the input alive itself
    input_alive_at_backward: bool = True
    side_inputs: list[tuple[weakref.ref, int]] = field(default_factory=list)  # (storage, bytes), weak as above
    freed_side_input_bytes: int = 0


class _Recorder(TorchDispatchMode):
    """Records the ops of the block currently running forward, numbered as the executor numbers them.

    Storages are identified by their Python object (alive as long as the storage), never by address:
    the allocator reuses the address of a freed storage at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.block: _BlockTrace | None = None
        self._created: dict[int, tuple[_BlockTrace, int]] = {}  # id(storage) -> (block, op index)
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        block = self.block
        if block is None or func is _DETACH:
            return func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        tag_name = TAG_STATE.pending_name if func is _TAG else None
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        index = len(block.ops)
        # A value written in place is never served from a cache (Note: [a value written in place is recomputed]).
        if func._schema.is_mutable:
            for arg in tree_flatten((args, kwargs))[0]:
                owner = self._created.get(id(arg.untyped_storage())) if isinstance(arg, torch.Tensor) else None
                if owner is not None and owner[0] is block:
                    block.ops[owner[1]]["mutated"] = True
        new_bytes = 0
        flat_out = tree_flatten(out)[0]
        for leaf in flat_out:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                key = id(storage)
                if key not in inputs and key not in self._created:
                    self._created[key] = (block, index)
                    self._refs[key] = weakref.ref(storage, functools.partial(self._forget, key))
                    new_bytes += storage.nbytes()
        block.ops.append({"index": index, "name": op_name(func), "output_bytes": new_bytes, "saved": False,
                          "keepable": can_keep(func, flat_out, tag_name), "time_s": elapsed})
        return out

    def _forget(self, key: int, _ref: weakref.ref | None = None) -> None:  # also a weakref callback
        self._created.pop(key, None)
        self._refs.pop(key, None)

    def mark_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saved ``tensor``: mark the op that created its storage as saved."""
        owner = self._created.get(id(tensor.untyped_storage()))
        if owner is not None and owner[0] is self.block:  # a block's output saved by the next is not its own
            owner[0].ops[owner[1]]["saved"] = True


class _Probe:
    """Hooks on the blocks that read the meter at each block's forward and backward boundaries."""

    def __init__(self, blocks: Sequence[nn.Module], meter: MemoryMeter, recorder: _Recorder | None) -> None:
        self.blocks, self.meter, self.recorder = list(blocks), meter, recorder
        self.traces = [_BlockTrace() for _ in self.blocks]
        self.head_peak = 0
        self._handles: list[Any] = []
        self._backward_open: int | None = None
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i), with_kwargs=True))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            trace = self.traces[i]
            trace.calls += 1
            trace.order = sum(t.calls for t in self.traces)
            x = _first_tensor((args, kwargs))
            trace.input_bytes = _nbytes(x)
            trace.input_id = id(x)
            trace.input_shape = tuple(x.shape) if x is not None else ()
            trace.input_storage = weakref.ref(x.untyped_storage()) if x is not None else None
            trace.side_inputs = _side_inputs((args, kwargs), x)
            trace.before_forward = self.meter.current_bytes
            self.meter.reset_peak()
            trace.forward_s = time.perf_counter()
            if x is not None and x.requires_grad:
                self._handles.append(x.register_hook(self._backward_end(i)))
            if self.recorder is not None:
                self.recorder.block = trace
                TAG_STATE.active_regions += 1  # tags act as inside a checkpointed region (same op numbering)
        return hook

    def _post(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            trace = self.traces[i]
            trace.forward_s = time.perf_counter() - trace.forward_s
            if self.recorder is not None:
                self.recorder.block = None
                TAG_STATE.active_regions -= 1
            y = _first_tensor(output)
            trace.output_bytes = _nbytes(y)
            trace.output_id = id(y)
            trace.forward_peak = self.meter.peak_bytes
            trace.after_forward = self.meter.current_bytes
            if y is not None and y.requires_grad:
                self._handles.append(y.register_hook(self._backward_start(i)))
            if i == len(self.blocks) - 1:
                self.meter.reset_peak()
        return hook

    def _backward_start(self, i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if i == len(self.blocks) - 1:
                self.head_peak = self.meter.peak_bytes
            trace = self.traces[i]
            trace.input_alive_at_backward = trace.input_storage is None or trace.input_storage() is not None
            trace.freed_side_input_bytes = sum(nbytes for ref, nbytes in trace.side_inputs if ref() is None)
            self._close_backward()
            self._backward_open = i
            self.meter.reset_peak()
        return hook

    def _backward_end(self, i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self._backward_open == i:
                self._close_backward()
        return hook

    def _close_backward(self) -> None:
        if self._backward_open is not None:
            self.traces[self._backward_open].backward_peak = self.meter.peak_bytes
            self._backward_open = None

    def finish(self) -> None:
        self._close_backward()


def _measure_step(runner: StepRunner, blocks: Sequence[nn.Module], record_ops: bool) -> _Probe:
    recorder = _Recorder() if record_ops else None

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if recorder is not None and recorder.block is not None:
            recorder.mark_saved(tensor)
        return tensor

    with MemoryMeter() as meter:
        probe = _Probe(blocks, meter, recorder)
        try:
            if recorder is not None:
                with recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    runner.forward_backward()
            else:
                runner.forward_backward()
        finally:
            probe.close()
            if recorder is not None and recorder.block is not None:  # a block raised mid-forward
                TAG_STATE.active_regions -= 1
        probe.finish()
    for i, trace in enumerate(probe.traces):
        if trace.calls != 1:
            raise ValueError(f"block {i} ({type(blocks[i]).__name__}) ran {trace.calls} times in one training step; "
                             "torchckpt plans blocks that run exactly once per step (pass blocks=[...] to choose)")
    orders = [trace.order for trace in probe.traces]
    if orders != sorted(orders):
        ran = sorted(range(len(orders)), key=orders.__getitem__)
        raise ValueError(f"the blocks ran in the order {ran}, not in the order given; torchckpt needs the blocks in "
                         "forward order (blocks='auto' may have joined two unrelated lists: pass blocks=[...])")
    return probe


def _block_times(blocks: Sequence[nn.Module], *probes: _Probe) -> list[float]:
    """Forward time of each block: per block the least over the measured steps, then the median over
    structurally equal blocks with equal input shapes (one figure per kind of block, robust to noise)."""
    shapes = [tuple(trace.input_shape) for trace in probes[0].traces]
    keys = [(structure_key(block), shape) for block, shape in zip(blocks, shapes)]
    least = [min(probe.traces[i].forward_s for probe in probes) for i in range(len(blocks))]
    by_key: dict[tuple, list[float]] = {}
    for key, seconds in zip(keys, least):
        by_key.setdefault(key, []).append(seconds)
    return [statistics.median(by_key[key]) for key in keys]


def profile(
    model: nn.Module,
    example_inputs: tuple | dict,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: str | Sequence[nn.Module] = "auto",
    progress: Callable[[str], None] | None = None,
) -> ChainCosts:
    """Measure ``model`` on ``example_inputs`` and return its cost model.

    Runs three training steps, all under the meter: every block checkpointed (keep nothing), which also
    warms up (with ``optimizer`` it is followed by a real optimizer step, so its state exists as it will
    in training); a plain step with the op recorder; and, when the blocks form a chain, one with a
    region of blocks to calibrate ``region_recompute_bytes``. Block forward times come from the hooks of
    the first two. Gradients are cleared afterwards; parameters change only through the optimizer step.
    ``progress``, if given, is called with a short description before each step (for a display).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=16))
        >>> len(costs.blocks), costs.blocks[0].input_bytes
        (2, 8192)
    """
    block_list = resolve_blocks(model, blocks)
    runner = StepRunner(model, example_inputs, loss_fn, optimizer)
    say = progress or (lambda message: None)
    say(f"profiling step 1: {len(block_list)} blocks, every block recomputed")
    start = time.perf_counter()
    with checkpoint_modules(block_list, policy="nothing_saveable"):
        recomputed = _measure_step(runner, block_list, record_ops=False)
    recomputed_step_s = time.perf_counter() - start
    runner.optimizer_step()
    say("profiling step 2: no checkpointing, recording every op")
    plain = _measure_step(runner, block_list, record_ops=True)
    runner.clear_grads()
    times = _block_times(block_list, recomputed, plain)
    # The checkpointed step ran every block's forward twice; without the recomputation it is a plain step.
    step_time_s = max(recomputed_step_s - sum(times), sum(times))
    costs = _assemble(plain, recomputed, times, step_time_s, [type(b).__name__ for b in block_list])
    if costs.chain and len(block_list) > 1:
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


def _assemble(plain: _Probe, recomputed: _Probe, times: list[float], step_time_s: float,
              names: list[str]) -> ChainCosts:
    traces, n = plain.traces, len(plain.traces)
    fixed = traces[0].before_forward - traces[0].input_bytes
    ckpt_fixed = recomputed.traces[0].before_forward - traces[0].input_bytes
    plain_peak = max([plain.head_peak] + [t.forward_peak for t in traces] + [t.backward_peak or 0 for t in traces])
    headroom = HEADROOM_BYTES + int(HEADROOM_FRACTION * max(0, plain_peak - fixed))
    # Regions need the blocks to be called as a chain: each block's first input is the previous output.
    chain = all(traces[k + 1].input_id == traces[k].output_id for k in range(n - 1))
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
                      chain=chain, notes={"headroom_bytes": str(headroom)})


def _held_between_blocks(plain: _Probe, recomputed: _Probe, fixed: int,
                         ckpt_fixed: int) -> tuple[list[int], list[int]]:
    """Per block, the bytes held through the backward pass when checkpointed and the extra when plain.

    For blocks that are not called as a chain (U-Net skips, an encoder's output read by every decoder
    block) the code between blocks keeps tensors too: a pooled skip's input, a concatenation, the encoder
    output. ``H_i``, what is held before block ``i`` starts beyond ``fixed`` and its input, is read at each
    block boundary of both measured steps; block ``i`` is charged ``H_{i+1} - H_i`` (with ``H_n`` read
    after the last block, less its output), so the all-plain and all-checkpointed plans telescope to the
    measured figures exactly whatever the code between blocks keeps.
    """
    def held(probe: _Probe, fixed: int) -> list[int]:
        traces = probe.traces
        before = [t.before_forward - fixed - t.input_bytes for t in traces]
        return before + [traces[-1].after_forward - fixed - traces[-1].output_bytes]

    plain_held, ckpt_held = held(plain, fixed), held(recomputed, ckpt_fixed)
    n = len(plain.traces)
    inputs = [max(0, ckpt_held[i + 1] - ckpt_held[i]) for i in range(n)]
    saved = [max(0, plain_held[i + 1] - plain_held[i] - inputs[i]) for i in range(n)]
    return inputs, saved
