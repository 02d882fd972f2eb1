"""Per-block menus: the Pareto points (held bytes, recompute time) of selective checkpointing.

Checkpointing a block keeping the outputs of a subset ``K`` of the ops autograd saves (``saved=True``)
holds ``sum(output_bytes of K)`` after the forward pass (beyond the block's input, costs.py's
[what a piece holds]) and recomputes ``forward_time_s - sum(time_s of K)`` (clamped at 0) in the backward
pass. This 0/1 knapsack is solved exactly by merging Pareto lists op by op (ops of equal cost collapse into few
points, so real blocks stay small); a block whose exact frontier would exceed 4096 points has it
thinned evenly (dropping points is always safe: the menu is only poorer, never wrong).

Menu rules:

1. **[plain and keep-nothing are always on the menu]** Option 0 is plain (no checkpoint,
   ``held_bytes = saved_bytes``, no recompute); the last option keeps nothing (``kept_ops == ()``,
   recomputes the whole forward). Both are always present.
2. **[only undominated options]** In between (and, just before keep-nothing, keep-nothing with the block's
   pieces nested when it was measured to peak lower: costs.py's [pieces nested inside a block]): checkpoint
   options holding less than ``saved_bytes``
   (anything holding as much is dominated by plain), not dominated by another option, by held bytes
   descending.
3. **[at most 16 options]** At most ``MENU_MAX_OPTIONS`` (16) options: beyond that the in-between points
   are thinned to 14 spanning ``0..saved_bytes`` evenly (for each of 14 evenly spaced byte targets, the
   point nearest it).
4. **[kept outputs wait for their op]** A checkpoint option that keeps some outputs carries
   ``recompute_extra_bytes``: in the backward pass the block is recomputed from its input, op by op, and each
   kept output waits in the cache until the recompute reaches its op (checkpoint.py's [kept outputs are handed
   over once]). At op ``t`` the recompute has alive about what the plain forward had (``OpCosts.alive_bytes``)
   plus the kept outputs of the ops after ``t``; the option's extra is how far that peaks above the plain
   forward's own largest ``alive_bytes``, which the keep-nothing recompute already costs (0 when the ops' alive
   bytes were not measured).
5. **[offload beside recompute]** Where the block's offload was measured (``offload_held_bytes >= 0``: costs.py's
   [offloaded blocks]), an offload option comes just before the nested and keep-nothing options: run plainly
   (``plain=True``, ``offload=True``), holding ``offload_held_bytes`` on the device and ``offload_host_bytes`` on the
   host, for ``offload_time_s``. It is offered only where it holds less than plain.
"""

from __future__ import annotations

from dataclasses import replace

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.solve._types import MenuOption

__all__ = ["MENU_MAX_OPTIONS", "block_menu"]

MENU_MAX_OPTIONS = 16
_FRONTIER_LIMIT = 4096

_Point = tuple[int, float, tuple[int, ...]]  # held bytes, forward time saved, kept op indices


def _thin(points: list, keep: int) -> list:
    if len(points) <= keep:
        return points
    step = (len(points) - 1) / (keep - 1)
    return [points[round(k * step)] for k in range(keep)]


def _pareto_subsets(ops: list[OpCosts]) -> list[_Point]:
    """Pareto set of (held bytes low, saved time high) over subsets of ``ops``, by held ascending."""
    points: list[_Point] = [(0, 0.0, ())]
    for op in ops:
        grown = [(held + op.output_bytes, saved + op.time_s, kept + (op.index,)) for held, saved, kept in points]
        merged = sorted(points + grown, key=lambda p: (p[0], -p[1], p[2]))
        points = []
        for point in merged:
            if not points or point[1] > points[-1][1]:
                points.append(point)
        points = _thin(points, _FRONTIER_LIMIT)
    return points


def _checkpoint_options(block: BlockCosts, ops: list[OpCosts]) -> list[MenuOption]:
    """Non-dominated checkpoint options keeping something and holding less than plain, by held ascending."""
    forward = float(block.forward_time_s)
    options: list[MenuOption] = []
    best_time = forward  # keep-nothing's time: anything as slow and larger is dominated by it
    for held, saved, kept in _pareto_subsets(ops):
        time = max(0.0, forward - saved)
        if not kept or held >= block.saved_bytes or time >= best_time:
            continue
        options.append(MenuOption(kept_ops=tuple(sorted(kept)), held_bytes=held, recompute_s=time, plain=False))
        best_time = time
    return options


def _recompute_extra(ops: list[OpCosts], kept: tuple[int, ...]) -> int:
    """[kept outputs wait for their op]: ``ops`` are all of the block's ops, by index."""
    if not kept or any(op.alive_bytes < 0 for op in ops):
        return 0
    chosen = set(kept)
    waiting = sum(op.output_bytes for op in ops if op.index in chosen)
    most = alone = 0
    for op in ops:
        if op.index in chosen:
            waiting -= op.output_bytes  # handed over: from here on it is part of what the plain forward had
        most, alone = max(most, op.alive_bytes + waiting), max(alone, op.alive_bytes)
    return most - alone


def _span(options: list[MenuOption], saved_bytes: int, keep: int) -> list[MenuOption]:
    if len(options) <= keep:
        return options
    chosen: list[MenuOption] = []
    for k in range(1, keep + 1):
        target = saved_bytes * k / (keep + 1)
        nearest = min(options, key=lambda o: (abs(o.held_bytes - target), o.held_bytes))
        if nearest not in chosen:
            chosen.append(nearest)
    return sorted(chosen, key=lambda o: o.held_bytes)


def block_menu(block: BlockCosts) -> tuple[MenuOption, ...]:
    """The block's menu: plain first, then checkpoint options by held bytes descending, keep-nothing last.

    Example:
        >>> from torchckpt.planner.costs import OpCosts
        >>> ops = (OpCosts(index=0, name="mm", output_bytes=40, saved=True, time_s=3.0),
        ...        OpCosts(index=1, name="gelu", output_bytes=40, saved=True, time_s=1.0))
        >>> block = BlockCosts(name="b", input_bytes=8, output_bytes=8, saved_bytes=80, forward_time_s=4.0,
        ...                    ops=ops)
        >>> [(o.held_bytes, o.recompute_s, o.kept_ops) for o in block_menu(block)]
        [(80, 0.0, (0, 1)), (40, 1.0, (0,)), (0, 4.0, ())]
    """
    if not isinstance(block, BlockCosts):
        raise TypeError(f"block_menu(block): expected a BlockCosts; got {type(block).__name__}")
    ops = sorted((op for op in block.ops if op.saved), key=lambda op: op.index)
    plain = MenuOption(kept_ops=tuple(op.index for op in ops), held_bytes=block.saved_bytes, recompute_s=0.0,
                       plain=True)
    if block.plain_only:  # planner/repeat.py's [a block is recomputed only if it repeats]
        return (plain,)
    nothing = MenuOption(kept_ops=(), held_bytes=0, recompute_s=max(0.0, float(block.forward_time_s) - 0.0),
                         plain=False)
    middle = _span(_checkpoint_options(block, ops), block.saved_bytes, MENU_MAX_OPTIONS - 2)
    # costs.py's [pieces nested inside a block]: just before keep-nothing (which stays last), when it peaks lower
    whole = block.saved_bytes + block.backward_peak_bytes + block.recompute_peak_bytes
    nested = () if not 0 <= block.nested_recompute_peak_bytes + block.nested_held_bytes < whole else (
        MenuOption(kept_ops=(), held_bytes=block.nested_held_bytes,  # pieces run once more, slices do not
                   recompute_s=(2 if block.nested_pieces else 1) * nothing.recompute_s, plain=False,
                   nested=True, slices=block.nested_slices, pieces=block.nested_pieces,
                   sliced_pieces=block.nested_sliced_pieces, piece_slices=block.nested_piece_slices),)
    every_op = sorted(block.ops, key=lambda op: op.index)
    middle = [replace(o, recompute_extra_bytes=_recompute_extra(every_op, o.kept_ops)) for o in middle]
    offload = () if not 0 <= block.offload_held_bytes < block.saved_bytes else (  # rule 5
        MenuOption(kept_ops=(), held_bytes=block.offload_held_bytes, recompute_s=float(block.offload_time_s),
                   plain=True, offload=True, host_bytes=block.offload_host_bytes),)
    return (plain, *reversed(middle), *offload, *nested, nothing)
