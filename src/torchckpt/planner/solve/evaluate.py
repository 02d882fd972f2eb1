"""The exact evaluator of costs.py's peak model: a schedule's predicted peak and extra time.

The rules it evaluates run from [what a piece holds] through [predicted peak is the maximum], and
[measured schedules are predicted as measured]: every block checkpointed keeping nothing is given
its measured peak (``CostModel.every_block_peak_bytes``) when the profiler recorded one.

Schedules are checked as they are walked; every error names the piece, what was expected and what was
found. Extra time is summed from the last piece back to the first (a piece's time plus the rest's),
which is the order the dynamic program adds in, so a solution's reported time is bit-for-bit the
solver's own figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchckpt.planner.costs import CostModel
from torchckpt.planner.solve._chain import Chain
from torchckpt.planner.solve._types import Piece, Region, Single

__all__ = ["evaluate", "evaluate_chain"]


@dataclass
class _Peak:
    """The running maximum of [predicted peak is the maximum] and the event that set it."""

    bytes: int = -1
    event: str = ""

    def see(self, value: int, event: str) -> None:
        if value > self.bytes:
            self.bytes, self.event = value, event


def _name(chain: Chain, block: int) -> str:
    return f"block {block} ({chain.costs.blocks[block].name!r})"


def _check_single(chain: Chain, piece: Single, inside: Region | None) -> None:
    menu = chain.menus[piece.block]
    if piece.option >= len(menu):
        raise ValueError(f"{piece}: {_name(chain, piece.block)} has {len(menu)} menu options "
                         f"(0..{len(menu) - 1}, see block_menu)")
    if inside is not None and piece.option not in (0, len(menu) - 1):
        raise ValueError(f"{piece} inside Region({inside.start}, {inside.stop}): inside a region a block is plain "
                         f"(option 0) or keeps nothing (option {len(menu) - 1}, the last); a checkpoint nested in a "
                         f"region keeps nothing (executor/checkpoint.py's [nested checkpoints keep nothing])")


def _walk(chain: Chain, pieces: Sequence[Piece], start: int, stop: int, context: int, gradient: int,
          inside: Region | None, peak: _Peak) -> tuple[float, int]:
    """[backward peak] and [forward peak] over one chain; returns (extra time, bytes held at its end)."""
    where = "the schedule" if inside is None else f"Region({inside.start}, {inside.stop}).inner"
    held, costs_s, nxt = 0, [], start
    for k, piece in enumerate(pieces):
        if not isinstance(piece, (Single, Region)):
            raise TypeError(f"{where}[{k}] must be a Single or a Region; got {piece!r}")
        first = piece.block if isinstance(piece, Single) else piece.start
        last = first if isinstance(piece, Single) else piece.stop - 1
        if first != nxt or last >= stop:
            raise ValueError(f"{where}[{k}] = {piece} covers blocks {first}..{last} but block {nxt} comes next and "
                             f"the chain ends at block {stop - 1}: pieces must cover blocks {start}..{stop - 1} in "
                             f"order, without gaps or overlaps")
        if isinstance(piece, Single):
            _check_single(chain, piece, inside)
            option = chain.menus[piece.block][piece.option]
            peak.see(context + held + chain.single_need_bytes(piece.block, option, gradient),
                     f"the forward or backward pass of {_name(chain, piece.block)}")
            held += chain.held_bytes(piece.block, option)
            costs_s.append(option.recompute_s)
        else:
            if not chain.costs.chain:
                raise ValueError(f"{where}[{k}] is Region({piece.start}, {piece.stop}) but the cost model has "
                                 f"chain=False (the model's code between blocks is not a plain chain), so only "
                                 f"single blocks can be planned")
            if inside is not None and (piece.start, piece.stop) == (inside.start, inside.stop):
                raise ValueError(f"{where}[{k}] is Region({piece.start}, {piece.stop}) inside itself: wrapping a "
                                 f"region in itself only adds recompute time; put its inner pieces directly")
            peak.see(context + held + gradient + chain.region_forward_bytes(piece.start, piece.stop),
                     f"the forward pass of the region of blocks {piece.start}..{piece.stop - 1}")
            inner_s, _ = _walk(chain, piece.inner, piece.start, piece.stop,
                               context + held + chain.region_context_bytes(piece.start),
                               chain.gradient_inside(piece.stop), piece, peak)
            held += chain.region_held_bytes(piece.start)
            costs_s.append(chain.region_time_s(piece.start, piece.stop) + inner_s)
        nxt = last + 1
    if nxt != stop:
        raise ValueError(f"{where} covers blocks {start}..{nxt - 1} but must reach block {stop - 1}: pieces must "
                         f"cover blocks {start}..{stop - 1} in order, without gaps or overlaps")
    total_s = 0.0
    for cost_s in reversed(costs_s):
        total_s = cost_s + total_s
    return total_s, held


def evaluate_chain(chain: Chain, schedule: Sequence[Piece]) -> tuple[int, float, str]:
    """Like ``evaluate`` on a prepared ``Chain``, plus the moment the peak is reached (for messages).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> chain = Chain.of(CostModel(fixed_bytes=100, head_bytes=10, blocks=(block, block)))
        >>> evaluate_chain(chain, (Single(0, 0), Single(1, 0)))
        (134, 0.0, 'the end of the forward pass (the head)')
    """
    if not isinstance(schedule, (tuple, list)):
        raise TypeError(f"schedule must be a tuple of Single/Region pieces; got {type(schedule).__name__}")
    peak = _Peak()
    extra_s, held = _walk(chain, schedule, 0, chain.n, chain.top_context_bytes, 0, None, peak)
    costs = chain.costs
    peak.see(costs.fixed_bytes + held + costs.head_bytes, "the end of the forward pass (the head)")
    peak.see(costs.fixed_bytes + costs.tail_bytes, "the end of the backward pass (after the first block)")
    if costs.every_block_peak_bytes and tuple(schedule) == chain.every_block_schedule():
        # costs.py's [measured schedules are predicted as measured]
        return costs.every_block_peak_bytes, extra_s, "every block checkpointed (its peak measured when profiling)"
    return peak.bytes, extra_s, peak.event


def evaluate(costs: CostModel, schedule: Sequence[Piece]) -> tuple[int, float]:
    """Predicted peak bytes and extra (recompute) seconds of ``schedule`` under costs.py's peak model.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> costs = CostModel(fixed_bytes=100, head_bytes=10, blocks=(block, block))
        >>> evaluate(costs, (Single(0, 0), Single(1, 0)))  # all plain
        (134, 0.0)
        >>> evaluate(costs, (Region(0, 2, inner=(Single(0, 0), Single(1, 0))),))
        (128, 2.0)
    """
    peak_bytes, extra_s, _ = evaluate_chain(Chain.of(costs), schedule)
    return peak_bytes, extra_s
