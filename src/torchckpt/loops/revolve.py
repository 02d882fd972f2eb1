"""Binomial checkpointing schedules for reversing a loop of steps (Revolve). Pure Python, no torch.

The problem: a loop computes states x_0 -> x_1 -> ... -> x_l, step i maps x_{i-1} to x_i. Reverse mode
needs the steps back to front, each one re-evaluated with its graph recorded ("taped") from x_{i-1}.
Only ``checkpoints`` states may be held at once. Which states to keep, and which steps to recompute,
so that the total number of step evaluations is least?

Griewank (1992) and Griewank & Walther, "Algorithm 799: Revolve", ACM TOMS 26(1), 2000, answer it:
with ``s`` checkpoints and each step advanced (evaluated without a graph) at most ``t`` times, at most
``beta(s, t) = binom(s + t, s)`` steps can be reversed, and the least number of *advances* (untaped
evaluations, the first forward sweep included) to reverse ``l`` steps is

    p(l, s) = t * l - binom(s + t, t - 1)    where t is the least integer with beta(s, t) >= l.

Every step is also taped once, so the least number of step evaluations is ``l + p(l, s)``.

Rules this module keeps (our executor, ``torchckpt.loops.runner``, relies on each; named in ``docs/design.md``):

1. **[x_0 takes a slot]** ``checkpoints`` counts every state held, the initial state x_0 included
   (Griewank's ``s``).
2. **[the scheduler only returns actions]** The planner decides, the executor applies:
   ``RevolveScheduler`` only returns ``Action`` values; ``revolve_schedule`` is the planner driven by
   the canonical request order l, l-1, ..., 1, so the schedule it returns is exactly what the executor
   performs for one backward pass.
3. **[free, restore, split binomially]** A backward request for step j first frees every state at or
   after x_j (no step <= j needs it), then restores the latest state before j and splits the gap
   binomially (``optimal_first_advance``).
4. **[out-of-order requests stay correct]** Requests out of order (a second backward pass with
   ``retain_graph=True``) stay correct: they restart from the latest state still held, at the price of
   extra advances.

5. **[states are offered one step late]** The online variant (length unknown while running forward,
   ``checkpointed_while``) offers each state x_c once the loop is known to run at least c + 2 steps
   (``offer``); ``OnlinePlacement`` (``torchckpt.loops.online``: Stumm & Walther 2010, Algorithm 1,
   then Wang, Moin & Iaccarino 2009) decides what to keep. The offered state is the one *before* the
   live carry, so its ``store`` action comes after the advance past it; the executor holds that carry
   until the decision. Once the length is known the reversal is the offline binomial one from the
   states held.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Literal

from torchckpt._units import check_positive_int
from torchckpt.loops.online import OnlinePlacement

ActionKind = Literal["store", "restore", "free", "advance", "tape"]

__all__ = [
    "Action",
    "RevolveScheduler",
    "RevolveSchedule",
    "binomial_max_steps",
    "online_schedule",
    "optimal_advances",
    "optimal_first_advance",
    "optimal_step_evaluations",
    "repetition_number",
    "revolve_schedule",
]


def binomial_max_steps(checkpoints: int, repetitions: int) -> int:
    """Most steps reversible with ``checkpoints`` states held and each step advanced <= ``repetitions`` times.

    This is Griewank's ``beta(s, t) = binom(s + t, s)``.

    Example:
        >>> binomial_max_steps(3, 2)
        10
    """
    check_positive_int("checkpoints", checkpoints)
    if repetitions < 0:
        raise ValueError(f"repetitions must be >= 0; got repetitions={repetitions}.")
    beta = 1
    for t in range(1, repetitions + 1):
        beta = beta * (checkpoints + t) // t
    return beta


def repetition_number(steps: int, checkpoints: int) -> int:
    """Least ``t`` with ``binomial_max_steps(checkpoints, t) >= steps``.

    Example:
        >>> repetition_number(10, 3), repetition_number(11, 3)
        (2, 3)
    """
    check_positive_int("steps", steps)
    check_positive_int("checkpoints", checkpoints)
    t, beta = 0, 1
    while beta < steps:
        t += 1
        beta = beta * (checkpoints + t) // t
    return t


def optimal_advances(steps: int, checkpoints: int) -> int:
    """Least number of untaped step evaluations (the first forward sweep included) to reverse ``steps``.

    Closed form of Griewank & Walther (2000): ``t * l - binom(s + t, t - 1)``.

    Example:
        >>> optimal_advances(10, 1)  # one checkpoint: restart from x_0 for every step
        45
    """
    t = repetition_number(steps, checkpoints)
    if t == 0:
        return 0
    return t * steps - math.comb(checkpoints + t, t - 1)


def optimal_step_evaluations(steps: int, checkpoints: int) -> int:
    """Least total number of ``step_fn`` calls for one forward and one backward pass: advances + tapes.

    Example:
        >>> optimal_step_evaluations(10, 1), optimal_step_evaluations(10, 10)
        (55, 19)
    """
    return steps + optimal_advances(steps, checkpoints)


def optimal_first_advance(steps: int, checkpoints: int) -> int:
    """How far to advance from the held start state before storing the next one (Revolve's split).

    Minimises ``d + p(steps - d, checkpoints - 1) + p(d, checkpoints)``. That sum is convex in ``d``
    (each ``p(., s)`` is piecewise linear with slopes ``t`` that grow), so a binary search on its
    difference finds the least minimiser.

    Example:
        >>> optimal_first_advance(10, 3)
        4
    """
    check_positive_int("steps", steps)
    check_positive_int("checkpoints", checkpoints)
    if steps == 1:
        return 0
    if checkpoints == 1:
        return steps - 1

    def cost(d: int) -> int:
        return d + optimal_advances(steps - d, checkpoints - 1) + optimal_advances(d, checkpoints)

    lo, hi = 1, steps - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cost(mid + 1) - cost(mid) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclasses.dataclass(frozen=True)
class Action:
    """One instruction of a schedule.

    ``store i`` / ``restore i`` / ``free i``: keep, reload or drop state x_i (``start == stop == i``).
    ``advance a->b``: evaluate steps a+1..b without recording a graph (b - a evaluations).
    ``tape j``: evaluate step j from x_{j-1} recording its graph, then reverse it (one evaluation);
    here ``start = j - 1`` and ``stop = j``.

    Example:
        >>> str(Action("advance", 0, 4)), str(Action("tape", 6, 7))
        ('advance 0->4', 'tape 7')
    """

    kind: ActionKind
    start: int
    stop: int

    @property
    def evaluations(self) -> int:
        """Number of ``step_fn`` calls this action makes."""
        if self.kind == "advance":
            return self.stop - self.start
        return 1 if self.kind == "tape" else 0

    def __str__(self) -> str:
        if self.kind == "advance":
            return f"advance {self.start}->{self.stop}"
        return f"{self.kind} {self.stop}"


@dataclasses.dataclass(frozen=True)
class RevolveSchedule:
    """A full schedule: the forward sweep, then one backward pass, as data.

    ``forward_actions`` is the prefix run during the forward pass (ending with ``tape steps``);
    the rest are run during backward.

    Example:
        >>> s = revolve_schedule(4, 2)
        >>> [str(a) for a in s.actions][:4], s.step_evaluations
        (['store 0', 'advance 0->1', 'store 1', 'advance 1->3'], 8)
    """

    steps: int
    checkpoints: int
    actions: tuple[Action, ...]
    forward_actions: int

    @property
    def step_evaluations(self) -> int:
        """Total ``step_fn`` calls, forward and backward."""
        return sum(a.evaluations for a in self.actions)

    @property
    def recomputed_evaluations(self) -> int:
        """``step_fn`` calls beyond the ``steps`` of a plain forward pass."""
        return self.step_evaluations - self.steps

    @property
    def stored_in_forward(self) -> tuple[int, ...]:
        """States kept during the forward sweep, in order."""
        return tuple(a.stop for a in self.actions[: self.forward_actions] if a.kind == "store")

    @property
    def max_held(self) -> int:
        """Most states held at once: never more than ``checkpoints``."""
        return _max_held(self.actions)

    def lines(self) -> list[str]:
        """The actions as short strings, e.g. ``['store 0', 'advance 0->3', ...]``."""
        return [str(a) for a in self.actions]

    def to_json(self) -> str:
        """JSON text: steps, checkpoints, evaluation count and the actions."""
        return json.dumps(
            {
                "steps": self.steps,
                "checkpoints": self.checkpoints,
                "step_evaluations": self.step_evaluations,
                "forward_actions": self.forward_actions,
                "actions": [[a.kind, a.start, a.stop] for a in self.actions],
            }
        )


def _max_held(actions: Iterable[Action]) -> int:
    held: set[int] = set()
    most = 0
    for action in actions:
        if action.kind == "store":
            held.add(action.stop)
        elif action.kind == "free":
            held.discard(action.stop)
        most = max(most, len(held))
    return most


class RevolveScheduler:
    """Decides which states to store, restore and free; holds positions only, never tensors.

    Use ``start()`` once, then either ``forward(steps)`` (length known: Revolve's first sweep) or
    ``offer(c)`` for c = 1, 2, ... and ``end_forward(steps)`` (length unknown: online,
    [states are offered one step late]), then
    ``request(j)`` for each step j whose graph the backward pass needs. Each call returns the actions
    to perform, in order.

    Example:
        >>> p = RevolveScheduler(2)
        >>> [str(a) for a in p.start() + p.forward(3)]
        ['store 0', 'advance 0->1', 'store 1', 'advance 1->2', 'tape 3']
        >>> [str(a) for a in p.request(2)]
        ['restore 1', 'tape 2']
    """

    def __init__(self, checkpoints: int) -> None:
        check_positive_int("checkpoints", checkpoints)
        self.checkpoints = checkpoints
        self._stored: list[int] = []  # sorted state indices
        self._online = OnlinePlacement(checkpoints)  # used by the online variant only
        self._position: int | None = None  # index of the state the executor holds live, if any

    @property
    def stored(self) -> tuple[int, ...]:
        """Indices of the states held now, ascending."""
        return tuple(self._stored)

    def start(self) -> list[Action]:
        """Store the initial state x_0 ([x_0 takes a slot])."""
        self._stored = [0]
        self._online = OnlinePlacement(self.checkpoints)
        self._position = 0
        return [Action("store", 0, 0)]

    def forward(self, steps: int) -> list[Action]:
        """The first sweep for a loop of known length: ends with ``tape steps``."""
        check_positive_int("steps", steps)
        return self._reach_and_tape(steps)

    def request(self, step: int) -> list[Action]:
        """Actions that leave step ``step`` taped, starting from whatever is held
        ([free, restore, split binomially])."""
        check_positive_int("step", step)
        actions = [Action("free", i, i) for i in self._stored if i >= step]
        self._stored = [i for i in self._stored if i < step]
        if not self._stored:
            raise RuntimeError(
                f"no stored state precedes step {step}: x_0 was freed. This is a bug in the planner."
            )
        latest = self._stored[-1]
        if self._position != latest:
            actions.append(Action("restore", latest, latest))
            self._position = latest
        return actions + self._reach_and_tape(step)

    def finish(self) -> list[Action]:
        """Free everything still held."""
        actions = [Action("free", i, i) for i in self._stored]
        self._stored, self._position = [], None
        return actions

    def _reach_and_tape(self, step: int) -> list[Action]:
        assert self._position is not None and self._position in self._stored
        actions: list[Action] = []
        while step - self._position > 1:
            slots = self.checkpoints - len(self._stored) + 1  # free slots + the one at the position
            advance = optimal_first_advance(step - self._position, slots)
            actions.append(Action("advance", self._position, self._position + advance))
            self._position += advance
            if step - self._position <= 1:  # x_{step-1} is only needed by the tape right now
                break
            actions.append(self._store(self._position))
        actions.append(Action("tape", step - 1, step))
        self._position = None
        return actions

    def _store(self, index: int) -> Action:
        self._stored.append(index)
        self._stored.sort()
        return Action("store", index, index)

    def offer(self, index: int) -> list[Action]:
        """Online variant: the loop runs at least ``index + 2`` steps; keep x_``index``
        ([states are offered one step late])?

        x_``index + 1`` is live; x_``index`` is the carry the executor still holds. Offer 1, 2, 3, ...
        in order. Returns a ``free`` of the evicted state and a ``store index``, either or both or none.
        """
        check_positive_int("index", index)
        decision = self._online.offer(index)
        actions: list[Action] = []
        if decision.evict is not None:
            self._stored.remove(decision.evict)
            actions.append(Action("free", decision.evict, decision.evict))
        if decision.keep:
            actions.append(self._store(index))
        self._position = index + 1
        return actions

    def end_forward(self, steps: int) -> list[Action]:
        """Online variant: the loop ended after ``steps`` steps; x_``steps`` is the output.

        The last step's graph was recorded during the forward pass, so it counts as ``tape steps``.
        Nothing needs freeing: only states up to x_``steps - 2`` were ever offered
        ([states are offered one step late]).
        """
        check_positive_int("steps", steps)
        assert all(i < steps - 1 for i in self._stored[1:]), "internal error: a state past x_{steps-2} is held"
        self._position = None
        return [Action("tape", steps - 1, steps)]


def revolve_schedule(steps: int, checkpoints: int) -> RevolveSchedule:
    """The binomial (Revolve) schedule for a loop of ``steps`` steps holding ``checkpoints`` states.

    ``checkpoints`` counts x_0 too ([x_0 takes a slot]). The forward sweep stores states and ends with
    ``tape steps``; the backward pass then requests steps ``steps - 1`` down to 1. The number of step
    evaluations equals ``optimal_step_evaluations(steps, checkpoints)``.

    Example:
        >>> s = revolve_schedule(3, 1)
        >>> s.lines()
        ['store 0', 'advance 0->2', 'tape 3', 'restore 0', 'advance 0->1', 'tape 2', 'restore 0', 'tape 1', 'free 0']
        >>> s.step_evaluations == optimal_step_evaluations(3, 1) == 6
        True
    """
    check_positive_int("steps", steps)
    check_positive_int("checkpoints", checkpoints)
    planner = RevolveScheduler(checkpoints)
    actions = planner.start() + planner.forward(steps)
    forward_actions = len(actions)
    for step in range(steps - 1, 0, -1):
        actions += planner.request(step)
    actions += planner.finish()
    return RevolveSchedule(steps, checkpoints, tuple(actions), forward_actions)


def online_schedule(steps: int, checkpoints: int) -> RevolveSchedule:
    """The schedule ``checkpointed_while`` performs when its loop stops after ``steps`` steps.

    The forward sweep offers each state once the loop is known to run two steps past it
    ([states are offered one step late]),
    not knowing ``steps``; the backward pass is the binomial one from the states left. For
    ``steps <= binom(checkpoints + 2, 2)`` the count equals ``optimal_step_evaluations``.

    Example:
        >>> online_schedule(4, 2).lines()[:6]
        ['store 0', 'advance 0->1', 'advance 1->2', 'store 1', 'advance 2->3', 'tape 4']
        >>> online_schedule(6, 2).step_evaluations == optimal_step_evaluations(6, 2) == 14
        True
    """
    check_positive_int("steps", steps)
    check_positive_int("checkpoints", checkpoints)
    planner = RevolveScheduler(checkpoints)
    actions = planner.start()
    for index in range(1, steps):  # the last step runs as the forward's tape, added by end_forward
        actions.append(Action("advance", index - 1, index))
        if index >= 2:
            actions += planner.offer(index - 1)
    actions += planner.end_forward(steps)
    forward_actions = len(actions)
    for step in range(steps - 1, 0, -1):
        actions += planner.request(step)
    actions += planner.finish()
    return RevolveSchedule(steps, checkpoints, tuple(actions), forward_actions)
