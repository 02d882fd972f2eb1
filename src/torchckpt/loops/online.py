"""Online checkpoint placement: which states to hold when the loop's length is found only by running it.

A ``checkpointed_while`` loop x_0 -> x_1 -> ... -> x_l learns l only when ``cond_fn`` says stop. It
holds at most ``checkpoints`` states (x_0 included, Griewank's ``s``) and must decide about each state
before l is known. After the loop the reversal is the offline binomial one from the states held
(``revolve.RevolveScheduler.request``), so what matters is where the held states lie at the end.

The rule, after Stumm & Walther, "New algorithms for optimal online checkpointing", SIAM J. Sci.
Comput. 32(2), 836-854, 2010 (their Algorithm 1), then Wang, Moin & Iaccarino, "Minimal repetition
dynamic checkpointing algorithm for unsteady adjoint calculation", SIAM J. Sci. Comput. 31(4), 2009:

1. **[deciding late loses nothing]** Timing, as in Revolve's online mode: the state x_c is *offered*
   once the loop is known to run at least c + 2 steps (``cond_fn`` accepted x_{c+1}). The input x_{l-1}
   of the last step is never needed, because the forward pass's own graph of step l serves its
   backward; so nothing is lost by deciding one step late, and the held states always lie before
   x_{l-1}.
2. **[phase one is Algorithm 1]** Phase one (Stumm & Walther's Algorithm 1, repetition number r <= 2),
   for x_1 .. x_{beta(s,2)-2}, runs in rounds k = 0, 1, ..., s - 1. Round k starts at state f_k
   (f_0 = 0, already held) and spans s - k + 1 states: f_k is kept for good, evicting the newest state kept by
   the previous round; the next s - k - 1 states are kept, each evicting the oldest state kept by the
   previous round (in round 0 the slots are still empty); the round's last state is not kept. So
   f_{k+1} = f_k + s - k + 1 and phase one ends with x_0, f_1, ..., f_{s-1} held, gaps
   s + 1, s, ..., 3: the offline binomial placement for beta(s, 2) steps.
3. **[phase one is optimal]** Guarantee of phase one: for every length l <= beta(s, 2) =
   binom(s + 2, 2) the reversal costs exactly the offline optimum ``revolve.optimal_step_evaluations(l, s)``
   (each segment between held states fits its repetition-number-1 bound: gap_j <= s - j + 1). Stumm & Walther
   prove this for their Algorithm 1; our tests check it for every l <= beta(s, 2), s <= 10.
4. **[phase two is the level rule]** Phase two (l > beta(s, 2)): the level rule of Wang, Moin &
   Iaccarino over W = held states plus the offered one. Phase one's held states enter with level 1 (x_0
   is never evicted). Admitting the next state evicts the latest *dispensable* member of W (one with a
   later member of higher level) and gives the newcomer level 0; with none dispensable, the newest
   member makes way and the newcomer takes its level + 1. The offered state is kept unless it is the
   one evicted. This keeps the least repetition number at every length (no step is evaluated more often
   than under the offline optimum), but the total count can exceed the offline optimum; Stumm &
   Walther's Algorithm 2, which targets beta(s, 2) < l <= beta(s, 3), is not implemented.
"""

from __future__ import annotations

import dataclasses

from torchckpt._units import check_positive_int

__all__ = ["OnlineDecision", "OnlinePlacement", "online_held_states"]

_NEVER_EVICTED = 1 << 62  # level of x_0 in phase two


@dataclasses.dataclass(frozen=True)
class OnlineDecision:
    """What to do with an offered state: keep it or not, and which held state to evict for it.

    Example:
        >>> OnlineDecision(keep=True, evict=3)
        OnlineDecision(keep=True, evict=3)
    """

    keep: bool
    evict: int | None


class OnlinePlacement:
    """Decides, state by state, which states of a loop of unknown length to hold (the rules above).

    ``checkpoints`` counts every state held, x_0 included; x_0 is held from the start. Call
    ``offer(c)`` for c = 1, 2, ... once the loop is known to run at least c + 2 steps.

    Example:
        >>> placement = OnlinePlacement(3)
        >>> [placement.offer(c) for c in (1, 2, 3, 4)][-1]  # round 1 keeps x_4, evicting x_2
        OnlineDecision(keep=True, evict=2)
        >>> placement.held, placement.phase_one_end  # Algorithm 1 decides x_1 .. x_8: l <= beta(3, 2) = 10
        ((0, 1, 4), 9)
    """

    def __init__(self, checkpoints: int) -> None:
        self.checkpoints = check_positive_int("checkpoints", checkpoints)
        self._held: list[int] = [0]  # ascending
        self._round = 0  # phase one: the current round k and its first state f_k
        self._round_first = 0
        self._previous_round: list[int] = []  # states kept (not for good) by round k - 1, ascending
        self._this_round: list[int] = []  # states kept (not for good) by round k so far
        self._levels: dict[int, int] | None = None  # phase two: W with levels
        self._offered = 0

    @property
    def held(self) -> tuple[int, ...]:
        """Indices of the states held now, ascending."""
        return tuple(self._held)

    @property
    def phase_one_end(self) -> int:
        """First state offered to phase two: beta(s, 2) - 1 (phase one covers l <= beta(s, 2))."""
        s = self.checkpoints
        return (s + 1) * (s + 2) // 2 - 1

    def offer(self, state: int) -> OnlineDecision:
        """The loop runs at least ``state + 2`` steps; keep x_``state``? Offer states 1, 2, 3, ... in order."""
        if state != self._offered + 1:
            raise ValueError(
                f"offer states in order 1, 2, 3, ...: expected state {self._offered + 1}, got {state}. "
                f"Offer x_c exactly once, when the loop is known to run at least c + 2 steps."
            )
        self._offered = state
        decision = self._phase_one(state) if state < self.phase_one_end else self._phase_two(state)
        if decision.evict is not None:
            self._held.remove(decision.evict)
        if decision.keep:
            self._held.append(state)
            self._held.sort()
        return decision

    def _phase_one(self, state: int) -> OnlineDecision:
        """Stumm & Walther's Algorithm 1 ([phase one is Algorithm 1])."""
        s, k = self.checkpoints, self._round
        if state == self._round_first + s - k:  # the round's last state is not kept; the next round follows
            self._round, self._round_first = k + 1, state + 1
            self._previous_round, self._this_round = self._this_round, []
            return OnlineDecision(keep=False, evict=None)
        if len(self._held) < s:  # round 0: free slots
            self._this_round.append(state)
            return OnlineDecision(keep=True, evict=None)
        if state == self._round_first:  # f_k, kept for good in place of the previous round's newest
            return OnlineDecision(keep=True, evict=self._previous_round.pop())
        self._this_round.append(state)
        return OnlineDecision(keep=True, evict=self._previous_round.pop(0))

    def _phase_two(self, state: int) -> OnlineDecision:
        """Wang, Moin & Iaccarino's levels over W = held + offered ([phase two is the level rule])."""
        if self._levels is None:
            self._levels = {i: (_NEVER_EVICTED if i == 0 else 1) for i in self._held}
            self._levels[state] = 1
        evicted = self._admit(state + 1)
        if evicted == state:
            return OnlineDecision(keep=False, evict=None)
        return OnlineDecision(keep=True, evict=evicted)

    def _admit(self, newcomer: int) -> int:
        """Add ``newcomer`` to the full W (``checkpoints + 1`` members); return the member evicted."""
        levels = self._levels
        assert levels is not None and len(levels) == self.checkpoints + 1
        victim, level = self._latest_dispensable(), 0
        if victim is None:
            victim = max(levels)
            level = levels[victim] + 1
        del levels[victim]
        levels[newcomer] = level
        return victim

    def _latest_dispensable(self) -> int | None:
        assert self._levels is not None
        highest_later = -1
        for index in sorted(self._levels, reverse=True)[:-1]:  # x_0 (last) is never evicted
            level = self._levels[index]
            if level < highest_later:
                return index
            highest_later = max(highest_later, level)
        return None


def online_held_states(steps: int, checkpoints: int) -> tuple[int, ...]:
    """States ``OnlinePlacement`` holds when a loop of ``steps`` steps ends (x_0 included), ascending.

    Example:
        >>> online_held_states(10, 3)  # beta(3, 2) = 10: the offline binomial placement, gaps 4, 3, 3
        (0, 4, 7)
    """
    check_positive_int("steps", steps)
    placement = OnlinePlacement(checkpoints)
    for state in range(1, steps - 1):
        placement.offer(state)
    return placement.held
