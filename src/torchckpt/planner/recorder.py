"""The profiler's op recorder: every op a block runs in its forward pass, numbered as the executor numbers them,
and what the region exactness check needs (which ops outside a block read its outputs, random numbers drawn
between blocks). ``probe.Probe`` opens and closes a block's recording at its hooks."""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchckpt.executor.policies import TAG_STATE, can_keep, op_name
from torchckpt.memory import synchronize

__all__ = ["BlockTrace", "Recorder"]

_DETACH = torch.ops.aten.detach.default
_TAG = torch.ops.aten.alias.default  # what ``tag`` dispatches (policies.py)


@dataclass
class BlockTrace:
    input_bytes: int = 0
    output_bytes: int = 0
    outputs_bytes: int = 0  # every tensor the block returns (each storage once, its inputs' excluded)
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
    has_backward: bool = True  # False: its output needs no gradient (frozen, no-grad input, no_grad section)
    settled: bool = False
    side_inputs: list[tuple[weakref.ref, int]] = field(default_factory=list)  # (storage, bytes), weak as above
    freed_side_input_bytes: int = 0


class Recorder(TorchDispatchMode):
    """Records the ops of the block currently running forward, numbered as the executor numbers them.

    Storages are identified by their Python object (alive as long as the storage), never by address:
    the allocator reuses the address of a freed storage at once.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device or torch.device("cpu")  # CUDA ops are timed to their end, not to their launch
        self.block: BlockTrace | None = None
        self.block_index: int | None = None  # the index of ``block``
        self._created: dict[int, tuple[BlockTrace, int]] = {}  # id(storage) -> (block, op index)
        self._refs: dict[int, weakref.ref] = {}
        # Block outputs whose reads are checked ([a region must be exact]): id(storage) -> (weak storage,
        # producing block, whether it is the hidden state the next block may read); and what was found.
        self.watched: dict[int, tuple[weakref.ref, int, bool]] = {}
        self.chain_problems: list[str] = []
        self.between: int | None = None  # outside the blocks: the index of the last block that ran, if not the last
        self.meter: Any = None  # the step's MemoryMeter (probe.measure_step), read after each op: ``alive_bytes``

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _DETACH:
            return func(*args, **kwargs)
        flat_args = tree_flatten((args, kwargs))[0]
        if self.watched and torch._C._current_graph_task_id() == -1:  # forward ops only, not the backward's
            self._check_reads(func, flat_args)
        block = self.block
        if (block is None and self.between is not None and not self.chain_problems
                and torch.Tag.nondeterministic_seeded in func.tags and torch._C._current_graph_task_id() == -1):
            self.chain_problems.append(f"the model draws random numbers between blocks {self.between} and "
                                       f"{self.between + 1} ({op_name(func)}; layerdrop, say), which a region would "
                                       "draw after its blocks' own")
        if block is None:
            return func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in flat_args if isinstance(t, torch.Tensor)}
        tag_name = TAG_STATE.pending_name if func is _TAG else None
        synchronize(self.device)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        synchronize(self.device)
        elapsed = time.perf_counter() - start
        index = len(block.ops)
        # A value written in place is never served from a cache (policies.py's [a value written in place is
        # recomputed]).
        if func._schema.is_mutable:
            for arg in flat_args:
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
        alive = -1 if self.meter is None else max(0, self.meter.current_bytes - block.before_forward)
        block.ops.append({"index": index, "name": op_name(func), "output_bytes": new_bytes, "saved": False,
                          "keepable": can_keep(func, flat_out, tag_name), "time_s": elapsed, "alive_bytes": alive})
        return out

    def _check_reads(self, func: Any, flat_args: list) -> None:
        """Note the first op that reads a watched block output where a region would hand it another value:
        anywhere but in the next block for a block's hidden state, anywhere at all for its other outputs."""
        for leaf in flat_args:
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = leaf.untyped_storage()
            entry = self.watched.get(id(storage))
            if entry is None or entry[0]() is not storage:
                continue
            _, producer, hidden = entry
            reader = self.block_index
            if hidden and reader == producer + 1:
                continue
            where = "code outside the blocks" if reader is None else f"block {reader}"
            what = "output" if hidden else "output other than its hidden state (its first)"
            self.chain_problems.append(f"block {producer}'s {what} is read by {where} ({op_name(func)})")
            self.watched.clear()  # one reason is enough
            return

    def watch(self, output: Any, hidden: Any, producer: int) -> None:
        """Check, from now on, the reads of the tensors ``output`` holds (``hidden`` among them)."""
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                known = self.watched.get(id(storage))
                shared = known is not None and known[1] == producer and not known[2]  # also another output
                self.watched[id(storage)] = (weakref.ref(storage), producer, leaf is hidden and not shared)

    def _forget(self, key: int, _ref: weakref.ref | None = None) -> None:  # also a weakref callback
        self._created.pop(key, None)
        self._refs.pop(key, None)

    def mark_saved(self, tensor: torch.Tensor) -> None:
        """Autograd saved ``tensor``: mark the op that created its storage as saved."""
        owner = self._created.get(id(tensor.untyped_storage()))
        if owner is not None and owner[0] is self.block:  # a block's output saved by the next is not its own
            owner[0].ops[owner[1]]["saved"] = True
