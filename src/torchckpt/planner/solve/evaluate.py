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

__all__ = ["PeakParts", "evaluate", "evaluate_chain", "peak_parts"]


@dataclass(frozen=True)
class PeakParts:
    """What a schedule's predicted peak is made of at the moment it is reached (``peak_parts``); the parts sum
    to ``peak_bytes`` exactly.

    ``fixed_bytes`` (costs.py's [fixed bytes plus a chain]); ``checkpoints`` and ``checkpoint_bytes``: how many
    checkpoints (single blocks and regions) are holding their inputs then, at every level, and those bytes;
    ``other_held_bytes``: the rest held by the pieces around it (activations plain blocks keep, a region's
    recompute residue, the gradient arriving from the head); ``own_bytes``: what the piece running then needs
    itself (a block's recomputed activations and its backward pass, the gradients made by then included; or the
    head; or the end of the backward pass); ``event``: that moment, as ``evaluate_chain`` names it.
    """

    peak_bytes: int
    event: str
    fixed_bytes: int
    checkpoints: int
    checkpoint_bytes: int
    other_held_bytes: int
    own_bytes: int


@dataclass
class _Peak:
    """The running maximum of [predicted peak is the maximum], the event that set it, and its parts: the piece's
    own need and the checkpoints held around it (count, bytes)."""

    bytes: int = -1
    event: str = ""
    own: int = 0
    checkpoints: tuple[int, int] = (0, 0)

    def see(self, value: int, event: str, own: int, checkpoints: tuple[int, int]) -> None:
        if value > self.bytes:
            self.bytes, self.event, self.own, self.checkpoints = value, event, own, checkpoints


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
          inside: Region | None, peak: _Peak, around: tuple[int, int] = (0, 0)) -> tuple[float, int, tuple[int, int]]:
    """[backward peak] and [forward peak] over one chain; returns (extra time, bytes held at its end, the
    checkpoints among them: count, bytes). ``around``: the checkpoints the enclosing chains hold (count, bytes)."""
    where = "the schedule" if inside is None else f"Region({inside.start}, {inside.stop}).inner"
    held, costs_s, nxt = 0, [], start
    count, inputs = around
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
            need = chain.single_need_bytes(piece.block, option, gradient)
            peak.see(context + held + need, f"the forward or backward pass of {_name(chain, piece.block)}", need,
                     (count, inputs))
            held += chain.held_bytes(piece.block, option)
            if not option.plain:
                count, inputs = count + 1, inputs + chain.region_held_bytes(piece.block)
            costs_s.append(option.recompute_s)
        else:
            if not chain.costs.chain:
                raise ValueError(f"{where}[{k}] is Region({piece.start}, {piece.stop}) but the cost model has "
                                 f"chain=False (the model's code between blocks is not a plain chain), so only "
                                 f"single blocks can be planned")
            if inside is not None and (piece.start, piece.stop) == (inside.start, inside.stop):
                raise ValueError(f"{where}[{k}] is Region({piece.start}, {piece.stop}) inside itself: wrapping a "
                                 f"region in itself only adds recompute time; put its inner pieces directly")
            need = gradient + chain.region_forward_bytes(piece.start, piece.stop)
            peak.see(context + held + need, f"the forward pass of the region of blocks {piece.start}..{piece.stop - 1}",
                     need, (count, inputs))
            inner_s, _, _ = _walk(chain, piece.inner, piece.start, piece.stop,
                                  context + held + chain.region_context_bytes(piece.start),
                                  chain.gradient_inside(piece.stop), piece, peak, (count, inputs))
            held += chain.region_held_bytes(piece.start)
            count, inputs = count + 1, inputs + chain.region_held_bytes(piece.start)
            costs_s.append(chain.region_time_s(piece.start, piece.stop) + inner_s)
        nxt = last + 1
    if nxt != stop:
        raise ValueError(f"{where} covers blocks {start}..{nxt - 1} but must reach block {stop - 1}: pieces must "
                         f"cover blocks {start}..{stop - 1} in order, without gaps or overlaps")
    total_s = 0.0
    for cost_s in reversed(costs_s):
        total_s = cost_s + total_s
    return total_s, held, (count, inputs)


def evaluate_chain(chain: Chain, schedule: Sequence[Piece]) -> tuple[int, float, str]:
    """Like ``evaluate`` on a prepared ``Chain``, plus the moment the peak is reached (for messages).

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> chain = Chain.of(CostModel(fixed_bytes=100, head_bytes=10, blocks=(block, block)))
        >>> evaluate_chain(chain, (Single(0, 0), Single(1, 0)))
        (134, 0.0, 'the end of the forward pass (the head)')
    """
    peak, extra_s = _evaluated(chain, schedule)
    if chain.costs.every_block_peak_bytes and tuple(schedule) == chain.every_block_schedule():
        # costs.py's [measured schedules are predicted as measured]
        return (chain.costs.every_block_peak_bytes, extra_s,
                "every block checkpointed (its peak measured when profiling)")
    return peak.bytes, extra_s, peak.event


def _evaluated(chain: Chain, schedule: Sequence[Piece]) -> tuple[_Peak, float]:
    if not isinstance(schedule, (tuple, list)):
        raise TypeError(f"schedule must be a tuple of Single/Region pieces; got {type(schedule).__name__}")
    peak = _Peak()
    extra_s, held, checkpoints = _walk(chain, schedule, 0, chain.n, chain.top_context_bytes, 0, None, peak)
    costs = chain.costs
    peak.see(costs.fixed_bytes + held + costs.head_bytes, "the end of the forward pass (the head)",
             costs.head_bytes, checkpoints)
    peak.see(costs.fixed_bytes + costs.tail_bytes, "the end of the backward pass (after the first block)",
             costs.tail_bytes, (0, 0))
    return peak, extra_s


def peak_parts(chain: Chain, schedule: Sequence[Piece]) -> PeakParts:
    """What ``schedule``'s predicted peak (``evaluate_chain``'s) is made of when it is reached.

    For the measured every-block schedule the peak is the measured one and its moment is the one the rules
    predict; the difference between the two goes to ``own_bytes``.

    Example:
        >>> from torchckpt.planner.costs import BlockCosts
        >>> block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
        >>> chain = Chain.of(CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 3))
        >>> parts = peak_parts(chain, chain.every_block_schedule())
        >>> parts.peak_bytes, parts.checkpoints, parts.checkpoint_bytes, parts.own_bytes, parts.event
        (124, 1, 4, 16, "the forward or backward pass of block 1 ('b')")
    """
    peak, _ = _evaluated(chain, schedule)
    total, _, _ = evaluate_chain(chain, schedule)
    fixed = chain.costs.fixed_bytes
    count, inputs = peak.checkpoints
    other = peak.bytes - peak.own - fixed - inputs
    return PeakParts(peak_bytes=total, event=peak.event, fixed_bytes=fixed, checkpoints=count,
                     checkpoint_bytes=inputs, other_held_bytes=other, own_bytes=peak.own + total - peak.bytes)


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
