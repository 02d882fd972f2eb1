"""The cost model flattened for the solver: per-block byte terms of costs.py's
[what a piece holds], [backward peak] and [forward peak].

Every bound the evaluator checks and the dynamic programs discretise is built here, once, so the
three cannot disagree. Bytes are relative to the context ``C`` of the chain a piece sits in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._types import MenuOption, Single
from torchckpt.planner.solve.menu import block_menu


@dataclass(frozen=True)
class Chain:
    costs: CostModel
    menus: tuple[tuple[MenuOption, ...], ...]

    @classmethod
    def of(cls, costs: CostModel) -> Chain:
        if not isinstance(costs, CostModel):
            raise TypeError("costs must be a cost model (torchckpt.profile's ChainCosts, or a "
                            f"planner.costs.CostModel); got {type(costs).__name__}")
        cache: dict = {}
        menus = []
        for block in costs.blocks:
            if block not in cache:
                cache[block] = block_menu(block)
            menus.append(cache[block])
        return cls(costs=costs, menus=tuple(menus))

    @property
    def n(self) -> int:
        return len(self.costs.blocks)

    @property
    def top_context_bytes(self) -> int:
        """``C`` of the top-level chain ([backward peak]): fixed bytes and the gradient arriving from the head."""
        return self.costs.fixed_bytes + self.costs.blocks[-1].output_bytes

    def every_block_schedule(self) -> tuple[Single, ...]:
        """Every block checkpointed keeping nothing (its menu's last option): what the profiler measures in
        its first step (costs.py's [measured schedules are predicted as measured])."""
        return tuple(Single(block=i, option=len(menu) - 1) for i, menu in enumerate(self.menus))

    def plain_schedule(self) -> tuple[Single, ...]:
        """No block checkpointed (option 0 everywhere)."""
        return tuple(Single(block=i, option=0) for i in range(self.n))

    def margin_of(self, schedule: tuple, margin_bytes: int) -> int:
        """costs.py's [a margin only where a plan was not measured]: 0 for the all-plain schedule and, when
        its peak was measured, for every block checkpointed; ``margin_bytes`` for any other."""
        if not self.costs.measured:
            return margin_bytes
        if tuple(schedule) == self.plain_schedule():
            return 0
        if self.costs.every_block_peak_bytes and tuple(schedule) == self.every_block_schedule():
            return 0
        return margin_bytes

    def gradient_inside(self, stop: int) -> int:
        """``g`` of [forward peak] for pieces inside a region ending before ``stop``: its output's gradient."""
        return self.costs.blocks[stop - 1].output_bytes if stop < self.n else 0

    def _input_held_bytes(self, block: int, option: MenuOption) -> int:
        """[what a piece holds]: a checkpoint holds what ``region_held_bytes`` says; a plain block its input
        only if autograd kept it (measured)."""
        if not option.plain:
            return self.region_held_bytes(block)
        b = self.costs.blocks[block]
        if option.offload:  # costs.py's [offloaded blocks]: what it saves of its input moved too
            return b.input_bytes if b.offload_input_held else 0
        return b.input_bytes if b.input_held_when_plain else 0

    def region_held_bytes(self, start: int) -> int:
        """[what a piece holds]: a checkpoint (of one block, or a region starting there) holds the block's
        input and the side inputs the plain step frees."""
        return self.costs.blocks[start].checkpoint_held_bytes

    def held_bytes(self, block: int, option: MenuOption) -> int:
        """[what a piece holds]: a single block holds its input (see ``_input_held_bytes``) plus what its
        option keeps."""
        return self._input_held_bytes(block, option) + option.held_bytes

    def single_need_bytes(self, block: int, option: MenuOption, gradient: int) -> int:
        """[backward peak] and [forward peak] for one block above ``C + H``: the larger of its forward and
        backward peaks."""
        b = self.costs.blocks[block]
        forward_peak = b.nested_forward_peak_bytes if option.nested and b.nested_forward_peak_bytes >= 0 else (
            b.forward_peak_bytes)  # costs.py's [pieces nested inside a block]: a sliced forward, measured
        forward = b.input_bytes + forward_peak + gradient
        incoming = b.output_bytes if block != self.n - 1 else 0
        recompute = 0 if option.plain else b.recompute_peak_bytes + option.recompute_extra_bytes
        held_input = self._input_held_bytes(block, option)
        backward = held_input + b.saved_bytes + b.backward_peak_bytes + recompute + incoming
        if option.offload:  # costs.py's [offloaded blocks]: measured in place of the plain terms, where it was
            if b.offload_backward_peak_bytes >= 0:
                backward = held_input + option.held_bytes + b.offload_backward_peak_bytes + incoming
            backward += int(self.costs.offload.get("window_bytes", 0))
        if option.nested:  # costs.py's [pieces nested inside a block]: measured in place of the last three terms
            backward = held_input + option.held_bytes + b.nested_recompute_peak_bytes + incoming
        return max(forward, backward)

    def region_context_bytes(self, start: int) -> int:
        """[backward peak]: what a region starting at ``start`` adds to its inside's context: the recompute
        residue, its input when its first block, run plainly, would not count it, and that block's side
        inputs the plain step frees (the region holds both)."""
        b = self.costs.blocks[start]
        held_input = 0 if b.input_held_when_plain else b.input_bytes
        return self.costs.region_recompute_bytes + held_input + b.freed_side_input_bytes

    def region_forward_bytes(self, start: int, stop: int) -> int:
        """[forward peak] for a region above ``C + H + g``: its blocks run holding only the first input."""
        blocks = self.costs.blocks
        first = blocks[start].input_bytes + blocks[start].forward_peak_bytes
        rest = (blocks[start].input_bytes + blocks[j].input_bytes + blocks[j].forward_peak_bytes
                for j in range(start + 1, stop))
        return max(first, *rest) if stop - start > 1 else first

    def region_forward_table(self) -> np.ndarray:
        """``table[s, v] = region_forward_bytes(s, v)`` for ``v >= s + 2`` (else 0), built incrementally."""
        n, blocks = self.n, self.costs.blocks
        table = np.zeros((n + 1, n + 1), dtype=np.int64)
        for s in range(n):
            running = blocks[s].input_bytes + blocks[s].forward_peak_bytes
            for v in range(s + 2, n + 1):
                j = v - 1
                running = max(running, blocks[s].input_bytes + blocks[j].input_bytes + blocks[j].forward_peak_bytes)
                table[s, v] = running
        return table

    def region_time_s(self, start: int, stop: int) -> float:
        """The region's recomputed forward time (summed left to right, as the solver does)."""
        total = 0.0
        for j in range(start, stop):
            total = total + self.costs.blocks[j].forward_time_s
        return total
