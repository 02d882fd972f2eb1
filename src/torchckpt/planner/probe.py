"""The profiler's instruments: hooks and an op recorder around one measured training step.

``measure_step`` runs one step of a ``StepRunner`` under a ``MemoryMeter`` with a ``Probe`` on the
blocks: per block the meter's readings at its forward and backward marks, its inputs and outputs, and
(with ``record_ops``) every op it runs, numbered as the executor numbers them, plus what the region
exactness check needs (which ops outside a block read its outputs). ``profile.py`` turns the readings
into a cost model; nothing here decides anything.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from torchckpt._host import host_rng_state, paused_gc, same_host_rng
from torchckpt.executor.policies import TAG_STATE
from torchckpt.memory import MemoryMeter, synchronize
from torchckpt.planner.blocks import block_paths, describe_paths, positional_form, structure_key
from torchckpt.planner.recorder import BlockTrace, Recorder
from torchckpt.planner.runner import StepRunner

__all__ = ["BlockOrderError", "Probe", "block_times", "measure_step", "time_scale", "timed_step"]


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


def _signature(value: Any) -> tuple[Any, list]:
    """The structure and leaves of ``value``; tensors held weakly (the probe must not keep them alive)."""
    leaves, spec = tree_flatten(value)
    return spec, [weakref.ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def _same_signature(a: tuple[Any, list], b: tuple[Any, list], *, tensors_by_identity: bool = False) -> bool:
    """Same structure, tensors at the same places (the same tensors with ``tensors_by_identity``), and
    equal other leaves."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1]):
        if isinstance(x, weakref.ref) or isinstance(y, weakref.ref):
            if not (isinstance(x, weakref.ref) and isinstance(y, weakref.ref)):
                return False
            if tensors_by_identity and (x() is None or x() is not y()):
                return False
        elif x is not y:
            try:
                if not bool(x == y):
                    return False
            except Exception:  # noqa: BLE001 - anything that cannot be compared counts as different
                return False
    return True


class Probe:
    """Hooks on the blocks that read the meter at each block's forward and backward boundaries."""

    def __init__(self, blocks: Sequence[nn.Module], meter: MemoryMeter, recorder: Recorder | None) -> None:
        self.blocks, self.meter, self.recorder = list(blocks), meter, recorder
        self.traces = [BlockTrace() for _ in self.blocks]
        self.head_peak = 0
        self.tail_peak = 0  # after block 0's backward pass ends (costs.py's [backward-end peak])
        self._tail_open = False
        self._handles: list[Any] = []
        self._backward_open: int | None = None
        # [a region must be exact]: the previous block's hidden state (weak), arguments besides it, and
        # outputs besides it, to compare the next block's with (only in the step with the recorder).
        self._hidden: weakref.ref | None = None
        self._side: tuple | None = None
        self._rest: tuple | None = None
        self._host_rng: tuple | None = None  # NumPy's and Python's global streams after the last block ran
        self._modes: tuple[bool, bool] | None = None  # grad mode and autocast of the last block's call
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i), with_kwargs=True))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            args, kwargs = positional_form(module, args, kwargs)  # the input is the first positional argument
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
            synchronize(self.meter.device)
            trace.forward_s = time.perf_counter()
            if x is not None and x.requires_grad:
                self._handles.append(x.register_hook(self._backward_end(i)))
            if self.recorder is not None:
                self._check_call(i, args, kwargs)
                self.recorder.block, self.recorder.block_index, self.recorder.between = trace, i, None
                TAG_STATE.active_regions += 1  # tags act as inside a checkpointed region (same op numbering)
        return hook

    def _post(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            trace = self.traces[i]
            synchronize(self.meter.device)
            trace.forward_s = time.perf_counter() - trace.forward_s
            if self.recorder is not None:
                self.recorder.block, self.recorder.block_index = None, None
                self.recorder.between = i if i < len(self.blocks) - 1 else None
                self._host_rng = host_rng_state()
                TAG_STATE.active_regions -= 1
                self._check_output(i, output)
            y = _first_tensor(output)
            trace.output_bytes = _nbytes(y)
            trace.outputs_bytes = _new_bytes(output, (args, kwargs))
            trace.output_id = id(y)
            trace.forward_peak = self.meter.peak_bytes
            trace.after_forward = self.meter.current_bytes
            trace.has_backward = y is not None and y.requires_grad
            if y is not None and trace.has_backward:
                self._handles.append(y.register_hook(self._backward_start(i)))
            if i == len(self.blocks) - 1:
                self.meter.reset_peak()
        return hook

    def _check_call(self, i: int, args: tuple, kwargs: dict) -> None:
        """[a region must be exact]: a region passes each block the previous block's hidden state as its
        first positional argument and the region's first block's other arguments."""
        assert self.recorder is not None
        problems = self.recorder.chain_problems
        side = _signature((args[1:], kwargs))
        modes = _grad_modes()
        if i > 0 and not problems and self._modes is not None and modes != self._modes:
            now, then = (", ".join(f"{what} {'on' if on else 'off'}" for what, on in zip(("gradients", "autocast"), m))
                         for m in (modes, self._modes))
            problems.append(f"block {i} runs with {now}, block {i - 1} with {then} (a no_grad section?): a region "
                            "runs its blocks alike")
        self._modes = modes
        moved = self._host_rng is not None and not same_host_rng(self._host_rng, host_rng_state())
        if i > 0 and not problems and moved:
            problems.append(f"the model draws from NumPy's or Python's random generator between blocks {i - 1} and "
                            f"{i}, which a region would draw after its blocks' own")
        if i > 0 and not problems:
            previous = self._hidden() if self._hidden is not None else None
            if previous is None or not args or args[0] is not previous:
                problems.append(f"block {i}'s first positional argument is not block {i - 1}'s output "
                                "(its first item when a tuple)")
            elif self._side is None or not _same_signature(side, self._side, tensors_by_identity=True):
                problems.append(f"block {i} gets other arguments than block {i - 1} besides the hidden state")
        self._side = side if i < len(self.blocks) - 1 else None

    def _check_output(self, i: int, output: Any) -> None:
        """[a region must be exact]: a region's blocks after its first return its hidden state with the region
        output's other items, so those must be alike from block to block and never read (``_check_reads``)."""
        assert self.recorder is not None
        problems = self.recorder.chain_problems
        hidden = output[0] if isinstance(output, tuple) and output else output
        if not isinstance(hidden, torch.Tensor):
            if not problems:
                problems.append(f"block {i} returns neither a tensor nor a tuple that starts with one")
            self._hidden = None
            return
        self._hidden = weakref.ref(hidden)
        rest = _signature(output[1:] if isinstance(output, tuple) else ())
        if i > 0 and not problems and (self._rest is None or not _same_signature(rest, self._rest)):
            problems.append(f"block {i} returns other items besides its hidden state than block {i - 1}")
        last = i == len(self.blocks) - 1
        self._rest = None if last else rest
        if not last and not problems:
            self.recorder.watch(output, hidden, i)

    def _settle_blocks_without_backward(self) -> None:
        """A block whose output needs no gradient has no backward pass, so its own hook never reads whether
        its input is alive: read it when the backward pass begins."""
        for trace in self.traces:
            if not trace.has_backward and not trace.settled:
                trace.input_alive_at_backward = trace.input_storage is None or trace.input_storage() is not None
                trace.settled = True

    def _backward_start(self, i: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            self._settle_blocks_without_backward()
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
            # Block i's window stays open until the next block's backward pass starts, so that what runs between
            # them (a tied embedding's gradient added up in T5's decoder, measured at 4% of its step) counts in
            # block i's backward peak rather than nowhere; after block 0 the tail begins ([backward-end peak]).
            if self._backward_open == i and i == 0:
                self._close_backward()
                self.meter.reset_peak()
                self._tail_open = True
        return hook

    def _close_backward(self) -> None:
        if self._backward_open is not None:
            self.traces[self._backward_open].backward_peak = self.meter.peak_bytes
            self._backward_open = None

    def finish(self) -> None:
        self._settle_blocks_without_backward()
        self._close_backward()
        if self._tail_open:
            self.tail_peak = self.meter.peak_bytes
            self._tail_open = False


class BlockOrderError(ValueError):
    """The blocks did not run in the order given; ``ran`` lists their positions in the order they ran.
    ``profile(blocks="auto")`` uses it to take the found blocks in forward order.

    Example:
        >>> BlockOrderError([1, 0], "ran in the order [1, 0]").ran
        [1, 0]
    """

    def __init__(self, ran: list[int], message: str) -> None:
        super().__init__(message)
        self.ran = list(ran)


def measure_step(runner: StepRunner, blocks: Sequence[nn.Module], record_ops: bool) -> Probe:
    """Run one training step under a ``MemoryMeter`` with a :class:`Probe` on ``blocks`` (and, with
    ``record_ops``, the op recorder); refuse blocks that do not run exactly once each, in order.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> runner = StepRunner(model, model.example_batch(batch_size=2, seq_len=16))
        >>> probe = measure_step(runner, list(model.blocks), record_ops=False)
        >>> [trace.calls for trace in probe.traces]
        [1, 1]
        >>> runner.clear_grads()
    """
    device = runner.device
    recorder = Recorder(device) if record_ops else None

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if recorder is not None and recorder.block is not None:
            recorder.mark_saved(tensor)
        # A detached alias (same storage, no grad_fn), not the tensor itself: an op that saves its own
        # output (exp, tanh, sigmoid) would otherwise hold that output, which holds the op's node, in a
        # reference cycle that Python's collector cannot see; an output that never reaches the loss (an
        # auxiliary output) then outlived the step, once per profile, and counted in every later peak.
        return tensor.detach()

    with MemoryMeter(device) as meter:
        probe = Probe(blocks, meter, recorder)
        if recorder is not None:
            recorder.meter = meter
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
    paths = _paths_or_names(runner.model, blocks)
    calls = {trace.calls for trace in probe.traces}
    if runner.step_fn is not None and len(calls) == 1 and min(calls) > 1:
        times = min(calls)
        raise ValueError(f"step_fn ran every block {times} times in one step ({describe_paths(paths)}); if it runs "
                         f"{times} micro-batches (gradient accumulation), make step_fn run one micro-batch and pass "
                         f"micro_batches={times}: the plan then holds its budget on every micro-batch. If it calls "
                         f"these blocks {times} times on other data (a discriminator on real and generated samples), "
                         "plan blocks that run once per step (blocks=[...]), or call them once on the concatenated "
                         "batch")
    skipped = [i for i, trace in enumerate(probe.traces) if trace.calls == 0]
    if skipped and all(trace.calls <= 1 for trace in probe.traces):
        i = skipped[0]
        raise ValueError(f"block {i} ({paths[i]}, {type(blocks[i]).__name__}) did not run in the measured training "
                         f"step: the model skipped it (at random, or on a condition of its own). torchckpt measures "
                         f"a step in which every block runs, so that its plan holds whichever blocks a step skips: "
                         f"set the skipping probability to 0 while planning (attributes named 'layerdrop' are "
                         f"turned off for you: layerdrop.py's [every block runs while measuring]) and plan with "
                         f"regions=False; or pass blocks=[...] without block {i}")
    once = [paths[k] for k, trace in enumerate(probe.traces) if trace.calls == 1]
    for i, trace in enumerate(probe.traces):
        if trace.calls != 1:
            fix = (f"plan the blocks that ran once, blocks=[model.get_submodule(p) for p in {once!r}], or call "
                   f"{paths[i]} once per step (on the concatenated batch, for a module applied to several)" if once
                   else "pass blocks=[...] that each run once per step")
            raise ValueError(f"block {i} ({paths[i]}, {type(blocks[i]).__name__}) ran {trace.calls} times in one "
                             f"training step; torchckpt plans blocks that run exactly once per step, and the blocks "
                             f"were {describe_paths(paths)}: {fix}")
    orders = [trace.order for trace in probe.traces]
    if orders != sorted(orders):
        ran = sorted(range(len(orders)), key=orders.__getitem__)
        order = ", ".join(paths[k] for k in ran)
        raise BlockOrderError(ran, f"the blocks {describe_paths(paths)} ran in the order {ran} ({order}), not in "
                              "the order given; torchckpt needs the blocks in forward order: pass them in the order "
                              "they run, blocks=[...]")
    return probe


def _new_bytes(output: Any, inputs: Any) -> int:
    """Bytes of the tensors in ``output`` (each storage once) that are not storages of ``inputs``."""
    def storages(value: Any) -> dict[int, Any]:
        return {id(s): s for s in (leaf.untyped_storage() for leaf in tree_flatten(value)[0]
                                   if isinstance(leaf, torch.Tensor))}
    given = storages(inputs)
    return sum(storage.nbytes() for key, storage in storages(output).items() if key not in given)


def _grad_modes() -> tuple[bool, bool]:
    """Whether gradients are recorded and autocast is on (any device) where a block is called."""
    autocast = torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu")
    return torch.is_grad_enabled(), bool(autocast)


def _paths_or_names(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    try:
        return block_paths(model, blocks)
    except ValueError:  # not submodules of the model run (measure_step called by hand): their classes
        return [type(block).__name__ for block in blocks]


def block_times(blocks: Sequence[nn.Module], *probes: Probe) -> list[float]:
    """Forward time of each block: per block the least over the measured steps, then the median over
    structurally equal blocks with equal input shapes (one figure per kind of block, robust to noise).

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> runner = StepRunner(model, model.example_batch(batch_size=2, seq_len=16))
        >>> probe = measure_step(runner, list(model.blocks), record_ops=False)
        >>> first, second = block_times(list(model.blocks), probe)
        >>> first == second > 0  # equal blocks on equal inputs share one median
        True
        >>> runner.clear_grads()
    """
    shapes = [tuple(trace.input_shape) for trace in probes[0].traces]
    keys = [(structure_key(block), shape) for block, shape in zip(blocks, shapes)]
    least = [min(probe.traces[i].forward_s for probe in probes) for i in range(len(blocks))]
    by_key: dict[tuple, list[float]] = {}
    for key, seconds in zip(keys, least):
        by_key.setdefault(key, []).append(seconds)
    return [statistics.median(by_key[key]) for key in keys]


def time_scale(times: list[float], plain_step_s: float, every_block_step_s: float) -> tuple[float, str]:
    """costs.py's [measured schedules are predicted as measured]: the factor on the hook-timed forward times that makes
    the every-block schedule's predicted extra time (the sum of the forwards) equal the measured one.

    Example:
        >>> round(time_scale([0.1, 0.1], plain_step_s=1.0, every_block_step_s=1.1)[0], 6)
        0.5
    """
    measured = every_block_step_s - plain_step_s
    total = 0.0
    for t in reversed(times):  # the evaluator's order, so the calibrated sum matches to the last bit or two
        total = t + total
    if measured <= 0 or total <= 0:
        return 1.0, (f"1 (not calibrated: the step with every block recomputed, {every_block_step_s * 1e3:.1f} ms, "
                     f"was not slower than the plain step, {plain_step_s * 1e3:.1f} ms: timing noise)")
    scale = measured / total
    return scale, (f"{scale:.4g} (hook-timed forwards {total * 1e3:.1f} ms; every block recomputed measured "
                   f"{measured * 1e3:.1f} ms over a {plain_step_s * 1e3:.1f} ms plain step)")


def timed_step(runner: StepRunner) -> float:
    """Seconds of one bare training step (forward and backward, no meter and no probe), gradients dropped;
    the garbage collector runs before it and not during it (as ``timeit`` does).

    Example:
        >>> from torchckpt.models import mlp
        >>> model = mlp(width=8, depth=2)
        >>> runner = StepRunner(model, model.example_batch(batch_size=2))
        >>> timed_step(runner) > 0
        True
    """
    runner.clear_grads()
    device = runner.device
    with paused_gc():
        synchronize(device)
        start = time.perf_counter()
        runner.forward_backward()
        synchronize(device)  # on CUDA the step has only been queued when forward_backward returns
        elapsed = time.perf_counter() - start
    runner.clear_grads()
    return elapsed
