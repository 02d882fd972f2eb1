"""Offload measured: the host<->device bandwidths, and one step with every block offloaded (``profile(offload=True)``).

Rules (costs.py's [offloaded blocks] is the peak model these figures feed):

1. **[offload is measured, not assumed]** One step runs under the meter with every block's saved activations
   offloaded (``executor/offload.py``): what each block's forward pass leaves on the device beyond its output is
   its ``offload_held_bytes``, the bytes its offloader copied its ``offload_host_bytes``, and its backward pass's
   peak, less what the peak model counts besides it, its ``offload_backward_peak_bytes``. Then a bare step with
   every block offloaded is timed twice, interleaved with two bare plain steps; the least of each over the least
   of the plain ones (the profile's too) is the offload's measured extra time.
2. **[the copies' time from the bandwidths, scaled to the step]** The host<->device bandwidths are measured
   (a 32 MiB copy each way, the median of three). A block's modelled copy time is its host bytes over each
   bandwidth, less on CUDA what its own compute hides (the forward pass for the copy out, twice its forward
   time for the copy back; on the CPU nothing overlaps). The modelled times are scaled by one factor so that
   the every-block-offloaded step is predicted to cost what it measured (``offload["time_scale"]``; 1 when
   timing noise made it no slower, or no block's copy was modelled visible: then the measured extra is spread by
   host bytes).
3. **[offload where it can run]** Offload is not planned for a model run under ``torch.compile`` (its
   saved-tensor hooks would run where the compiled graphs do not call them); ``notes["offload"]`` says why, and
   the plan has no offload option. Under DDP or FSDP2 every rank measures its own step, the steps are collectives
   run by all ranks alike, and the ranks agree on the figures as on the others (planner/distributed.py's [ranks
   agree on the costs]: the largest of each, the least bandwidth and host budget), so every rank plans the same
   offloaded blocks. The executor leaves FSDP2's all-gathered parameters on the device as it leaves any
   parameter (executor/offload.py's [what is offloaded]): they are the module's parameters while it runs.
4. **[inputs move only along a chain]** Along a chain (``costs.chain``) what a block saves of its input is
   offloaded too (``Offloader(offload_inputs=True)``), and its input counts as held (``offload_input_held``) when
   the measured step finds it alive when the block's backward pass begins or when the last block's forward pass
   ends (HF keeps the embeddings' output in a local variable through the whole forward pass, so a later block's
   forward peak sees it though no backward pass does), or when the block before it saves its own output (a final
   ReLU), which stays on the device wherever a plan runs that block plainly. The backward residue is read against
   what the measured step had alive, side inputs it had freed (a rotary table once no block keeps a view of it)
   counted as alive, as they are wherever a plan runs some block plainly. Where the code between blocks keeps
   tensors (a U-Net's skips, ``chain=False``), a block's ``x_i`` also counts what that code keeps, which offloading
   the input cannot free: the inputs stay on the device there and ``offload_input_held`` is the plain step's
   ``input_held_when_plain``.
5. **[a default host budget]** ``host_budget=None`` takes half the host memory available when profiling
   (``MemAvailable``; 4 GiB where it cannot be read), shared by the ranks of the process group on the same host:
   what plans may keep in host buffers at once, per process. On the CPU
   the window of copies brought back ahead is 0 (a copy back cannot overlap compute there); on CUDA it is a
   quarter of the largest block's host bytes, at most 256 MiB.
"""

from __future__ import annotations

import functools
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torchckpt._progress import block_ticks
from torchckpt._units import format_bytes, parse_bytes
from torchckpt.executor import CheckpointHandle, wrap_forward
from torchckpt.executor.offload import Offloader
from torchckpt.memory.host_pool import host_buffer
from torchckpt.memory.meter import synchronize
from torchckpt.planner.distributed import agree_flag, ranks_on_this_host, same_outcome
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.probe import Probe, measure_step, timed_step
from torchckpt.planner.runner import StepRunner

__all__ = ["check_offload_args", "measure_offload", "measure_bandwidth", "offloaded_blocks"]

_CALIBRATION_BYTES = 32 << 20
_DEFAULT_HOST_BYTES = 4 << 30
_MAX_WINDOW = 256 << 20


def check_offload_args(offload: object, host_budget: object) -> int | None:
    """The host budget in bytes (None: the default, [a default host budget]); raises for a bad ``offload`` or
    ``host_budget``.

    Example:
        >>> check_offload_args(True, "2GiB")
        2147483648
    """
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be True or False; got {offload!r}")
    if host_budget is None:
        return None
    if not offload:
        raise ValueError("host_budget is the host memory offloaded activations may take; it needs offload=True")
    return parse_bytes(host_budget, option="host_budget")  # type: ignore[arg-type]


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 * _DEFAULT_HOST_BYTES


def measure_bandwidth(device: torch.device) -> tuple[float, float]:
    """Bytes per second of a copy device -> host and host -> device (pinned host memory on CUDA; on the CPU a copy
    into and out of a second pool), the median of three 32 MiB copies each ([the copies' time ...]).

    Example:
        >>> out, back = measure_bandwidth(torch.device("cpu"))
        >>> out > 0 and back > 0
        True
    """
    host = host_buffer(_CALIBRATION_BYTES, pin=device.type == "cuda")
    assert host is not None
    source = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, device=device)
    source.fill_(1)
    rates: dict[str, list[float]] = {"out": [], "back": []}
    for _ in range(3):
        for way, (into, what) in (("out", (host, source)), ("back", (source, host))):
            synchronize(device)
            start = time.perf_counter()
            into.copy_(what, non_blocking=device.type == "cuda")
            synchronize(device)
            rates[way].append(_CALIBRATION_BYTES / max(time.perf_counter() - start, 1e-9))
    return statistics.median(rates["out"]), statistics.median(rates["back"])


class offloaded_blocks:  # noqa: N801 - used as a context manager, like a function
    """Every block in ``blocks`` runs with its saved activations offloaded (one ``Offloader``) until exit;
    ``host_bytes[i]`` is what block ``i``'s calls copied out.

    Example:
        >>> from torchckpt.models import gpt
        >>> model = gpt("tiny", dropout=0.0)
        >>> with offloaded_blocks(model, list(model.blocks)) as blocks:
        ...     model(*model.example_batch(batch_size=2, seq_len=16)).backward()
        >>> all(n > 0 for n in blocks.host_bytes)
        True
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], window_bytes: int = 0,
                 host_limit_bytes: int | None = None, offload_inputs: bool = True) -> None:
        device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        self.offloader = Offloader(device, model, window_bytes=window_bytes, host_limit_bytes=host_limit_bytes,
                                   offload_inputs=offload_inputs)
        self.blocks = blocks
        self.host_bytes = [0] * len(blocks)
        self.inputs_alive_at_forward_end = [False] * len(blocks)  # [inputs move only along a chain]
        self.saves_own_output = [False] * len(blocks)  # ... the block saves its output (a final ReLU does)
        self._inputs: list[weakref.ref | None] = [None] * len(blocks)
        self._wrapped: list[nn.Module] = []

    def _call(self, index: int, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before = self.offloader.offloaded_bytes
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        self._inputs[index] = weakref.ref(first.untyped_storage()) if first is not None else None
        try:
            output = self.offloader.run(forward, *args, **kwargs)
            hidden = output[0] if isinstance(output, tuple) and output else output
            self.saves_own_output[index] = isinstance(hidden, torch.Tensor) and \
                hidden.untyped_storage().data_ptr() in self.offloader.last_copied
            return output
        finally:
            self.host_bytes[index] += self.offloader.offloaded_bytes - before
            if index == len(self.blocks) - 1:  # the blocks' forward passes are over: what is still alive?
                self.inputs_alive_at_forward_end = [ref is not None and ref() is not None for ref in self._inputs]

    def __enter__(self) -> offloaded_blocks:
        for i, block in enumerate(self.blocks):
            wrap_forward(block, functools.partial(self._call, i, block.forward), self._wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        CheckpointHandle(self._wrapped).remove()


def _modelled_s(costs: ChainCosts, host: list[int], out_rate: float, back_rate: float, cuda: bool) -> list[float]:
    modelled = []
    for block, nbytes in zip(costs.blocks, host):
        out, back = nbytes / out_rate, nbytes / back_rate
        hidden_out, hidden_back = (block.forward_time_s, 2 * block.forward_time_s) if cuda else (0.0, 0.0)
        modelled.append(max(0.0, out - hidden_out) + max(0.0, back - hidden_back))
    return modelled


def _held_and_backward(costs: ChainCosts, probe: Probe, alive_at_end: list[bool],
                       saves_output: list[bool]) -> list[tuple[int, int, bool]]:
    """Per block, from the step with every block offloaded: what its forward pass leaves on the device beyond its
    output, and its backward pass's peak less what costs.py's [offloaded blocks] counts besides it (``C + H``, its
    input when held, what it left, the incoming gradient), as profile.py's other residues are read."""
    fixed = probe.traces[0].before_forward - probe.traces[0].input_bytes
    blocks, n = costs.blocks, len(costs.blocks)
    last_output, held, out = blocks[-1].output_bytes, 0, []
    for i, (block, trace) in enumerate(zip(blocks, probe.traces)):
        left = max(0, trace.after_forward - trace.before_forward - trace.output_bytes)
        alive = trace.input_alive_at_backward if costs.chain else block.input_held_when_plain
        # what the model counts: alive in the measured step, alive when the forward pass ends, or the previous block
        # saves its own output, which stays on the device wherever a plan runs that block plainly
        counted = (alive or alive_at_end[i] or (i > 0 and saves_output[i - 1])) if costs.chain else alive
        own = (block.input_bytes if alive else 0) + left  # the residue is read against what the step had alive
        incoming = 0 if i == n - 1 else block.output_bytes
        # side inputs this step had freed by the block's backward pass (a rotary table no block kept) count as alive:
        # in a plan where a plain block keeps them they are, and C counts them from the start
        residue = (trace.backward_peak or 0) - (fixed + last_output + held + own + incoming) + \
            trace.freed_side_input_bytes
        out.append((left, max(0, residue), counted))
        held += own
    return out


def measure_offload(runner: StepRunner, block_list: list[nn.Module], costs: ChainCosts,
                    say: Callable[[str], None], group: Any, *, offload: bool, host_budget: int | None,
                    compiled: bool = False) -> ChainCosts:
    """costs.py's [offloaded blocks] measured (this module's rules), or ``notes["offload"]`` saying why not.

    Example:
        >>> from torchckpt.models import gpt
        >>> from torchckpt.planner.profile import profile
        >>> model = gpt("tiny", dropout=0.0)
        >>> costs = profile(model, model.example_batch(batch_size=2, seq_len=64), offload=True)
        >>> costs.blocks[0].offload_held_bytes < costs.blocks[0].saved_bytes <= costs.blocks[0].offload_host_bytes
        True
    """
    if not offload:
        return costs
    if not agree_flag(not compiled, group):  # every rank alike, or the eager ones would wait in the step below
        why = "no: not planned for a compiled model (saved-tensor hooks do not run inside compiled graphs)"
        return replace(costs, notes={**costs.notes, "offload": why}, offload={"note": why})
    device = runner.device
    say("profiling the offload: host<->device bandwidth, then a step with every block offloaded")
    out_rate, back_rate = measure_bandwidth(device)
    sharing = ranks_on_this_host(group)  # a collective on every rank, whatever host_budget each was given
    limit = host_budget if host_budget is not None else _available_host_bytes() // 2 // sharing
    runner.clear_grads()
    inputs = costs.chain  # [inputs move only along a chain]

    def step() -> tuple[offloaded_blocks, Probe]:
        with offloaded_blocks(runner.model, block_list, host_limit_bytes=limit, offload_inputs=inputs) as blocks, \
                block_ticks(block_list):  # _progress.py's [reported per phase, never per op]
            return blocks, measure_step(runner, block_list, record_ops=False)
    measured, probe = same_outcome(step, group)  # step() alone without a group
    runner.clear_grads()
    if not agree_flag(measured.offloader.refused_bytes == 0, group):
        over = f" ({format_bytes(measured.offloader.refused_bytes)} more)" if measured.offloader.refused_bytes else \
            " on another rank"
        why = (f"no: offloading every block needs over the host budget of {format_bytes(limit)}{over}; "
               "raise host_budget")
        return replace(costs, notes={**costs.notes, "offload": why}, offload={"note": why})
    plain_s, offloaded_s = costs.step_time_s, float("inf")
    for _ in range(2):  # interleaved, the least of each: one noisy step would set the scale for every block
        with offloaded_blocks(runner.model, block_list, offload_inputs=inputs):
            offloaded_s = min(offloaded_s, timed_step(runner))
        plain_s = min(plain_s, timed_step(runner))
    host = measured.host_bytes
    cuda = device.type == "cuda"
    modelled = _modelled_s(costs, host, out_rate, back_rate, cuda)
    extra = offloaded_s - plain_s
    scale = extra / sum(modelled) if extra > 0 and sum(modelled) > 0 else 1.0
    if extra > 0 and sum(modelled) == 0:
        modelled = [extra * n / max(1, sum(host)) for n in host]
    blocks = tuple(replace(block, offload_held_bytes=held, offload_backward_peak_bytes=backward,
                           offload_input_held=input_held, offload_host_bytes=nbytes, offload_time_s=seconds * scale)
                   for block, (held, backward, input_held), nbytes, seconds in zip(
                       costs.blocks, _held_and_backward(costs, probe, measured.inputs_alive_at_forward_end,
                                                        measured.saves_own_output), host, modelled))
    window = min(_MAX_WINDOW, max(host) // 4) if cuda else 0
    note = (f"every block offloaded measured {format_bytes(sum(host))} on the host, {extra:+.3f} s a step; copies at "
            f"{format_bytes(out_rate)}/s out, {format_bytes(back_rate)}/s back")
    entry: dict[str, Any] = {"window_bytes": int(window), "host_budget_bytes": int(limit),
                             "d2h_bytes_per_s": float(out_rate), "h2d_bytes_per_s": float(back_rate),
                             "time_scale": float(scale), "device": device.type, "note": note}
    return replace(costs, blocks=blocks, offload=entry, notes={**costs.notes, "offload": note})
