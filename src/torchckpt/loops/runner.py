"""Checkpointed loops: run ``carry = step_fn(carry)`` many times holding only a few carries for backward.

``checkpointed_loop`` (known length) follows the binomial schedule of Griewank & Walther, "Algorithm
799: Revolve" (2000); ``checkpointed_while`` (length unknown until ``cond_fn`` says stop) places states
online (Stumm & Walther 2010, see ``torchckpt.loops.online``) and reverses binomially once the length
is known (see ``torchckpt.loops.revolve``).

How it works (the rules the code keeps, by name):

1. **[one forward, full graph]** The forward pass runs every step once, with autograd recording as
   usual, so the graph reaches the carry *and* every tensor ``step_fn`` closes over (module parameters,
   tensors computed outside the loop). Gradients therefore work with ``.backward()`` and
   ``torch.autograd.grad`` alike and nothing has to be declared.
2. **[only the newest step is held]** Every tensor autograd saves inside step i goes through a
   saved-tensor hook. The hook keeps the real tensor only while step i is the newest step; when step
   i+1 starts it drops it, leaving a placeholder. So the forward pass holds the last step's
   activations, the current carry and the stored checkpoints, nothing more.
3. **[recompute on first need]** When backward first needs a saved tensor of step j, the executor asks
   the planner for step j (``RevolveScheduler.request``), replays the actions it returns (restore a
   checkpoint, advance without a graph, store new checkpoints, re-run step j recording what it saves)
   and hands back the recomputed tensors in the order they were saved.
4. **[checkpoints hold carry and RNG]** A checkpoint stores the carry (aliases, no copy) and the RNG
   state before the next step (CPU, plus every initialised CUDA device;
   ``torchckpt._host.RngSnapshot``), so recomputed dropout masks equal the forward's. The caller's RNG
   state is put back after each recomputation. Recomputation runs under the autocast settings that were
   active when the loop was called. ``checkpointed_while`` decides about x_c only once ``cond_fn`` has
   accepted x_{c+1}, so it holds back x_c's snapshot (taken before step c+1) until then: a ``store c``
   then takes the held-back snapshot, any other ``store`` the live carry. The carry's layout, snapshots
   and autocast state live in ``torchckpt.loops.carry``.
5. **[recomputed steps are checked]** Each recomputed step must save the same number of tensors with
   the same shapes as in the forward pass, and stored carries must not be modified in place; both are
   checked and raise otherwise.
   Recomputation runs under ``UndoOuterWrites``, so buffers the steps write in place (BatchNorm
   statistics of a module ``step_fn`` calls) end as after the forward pass, updated once per step
   (checkpoint.py's [recomputation leaves buffers alone], in ``executor/checkpoint.py``).
6. **[loop stats are passed in]** No global state: counts and the actions run are written to a
   ``LoopStats`` the caller passes in.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from torchckpt._host import RngSnapshot
from torchckpt._units import check_positive_int, parse_bytes
from torchckpt.executor.checkpoint import RecomputationMismatchError, RematError
from torchckpt.executor.outer_writes import UndoOuterWrites
from torchckpt.loops.carry import AutocastState, Carry, CarryLayout, CarrySnapshot
from torchckpt.loops.revolve import Action, RevolveScheduler

__all__ = ["LoopStats", "checkpointed_loop", "checkpointed_while"]


@dataclasses.dataclass(kw_only=True)
class LoopStats:
    """What a checkpointed loop did; pass one in as ``stats=`` and read it after backward.

    ``actions`` lists every store / restore / advance / tape run, forward and backward (one entry per
    action, about five per step); pass ``record_actions=False`` to keep only the counts.

    Example:
        >>> import torch
        >>> stats = LoopStats()
        >>> w = torch.ones(3, requires_grad=True)
        >>> out = checkpointed_loop(lambda h: torch.tanh(h * w), torch.ones(3), steps=5,
        ...                         checkpoints=2, stats=stats)
        >>> out.sum().backward()
        >>> stats.step_evaluations  # 5 forward + 6 recomputed = optimal_step_evaluations(5, 2)
        11
    """

    steps: int = 0
    checkpoints: int = 0
    carry_bytes: int = 0
    step_evaluations: int = 0
    record_actions: bool = True
    actions: list[Action] = dataclasses.field(default_factory=list)

    @property
    def recomputed_evaluations(self) -> int:
        """``step_fn`` calls beyond the forward pass."""
        return self.step_evaluations - self.steps

    def add(self, action: Action) -> None:
        """Count an action's evaluations; keep the action itself if ``record_actions``."""
        self.step_evaluations += action.evaluations
        if self.record_actions:
            self.actions.append(action)

    def lines(self) -> list[str]:
        """The actions run, as short strings (compare with ``RevolveSchedule.lines()``)."""
        return [str(a) for a in self.actions]


# --------------------------------------------------------------------------- checkpoint count


def _resolve_checkpoints(checkpoints: int | None, budget_bytes: int | str | None, carry_bytes: int) -> int:
    """The number of carries to store, from a count or from a byte budget (rule: exactly one given)."""
    if (checkpoints is None) == (budget_bytes is None):
        raise ValueError(
            f"pass exactly one of checkpoints= (a count of stored carries) and budget_bytes= (bytes for "
            f"stored carries plus the live one); got checkpoints={checkpoints!r}, budget_bytes={budget_bytes!r}."
        )
    if checkpoints is not None:
        check_positive_int("checkpoints", checkpoints)
        return checkpoints
    assert budget_bytes is not None
    budget = parse_bytes(budget_bytes, option="budget_bytes")
    if budget < 2 * carry_bytes:
        raise ValueError(
            f"budget_bytes={budget_bytes!r} is smaller than two carries (2 x {carry_bytes} bytes): the budget "
            f"must hold the live carry and at least one stored carry (x_0). Raise it to at least "
            f"{2 * carry_bytes}, or pass checkpoints=1."
        )
    return budget // carry_bytes - 1


class _SavedSlot:
    """What autograd holds for one tensor saved inside a step ([only the newest step is held])."""

    __slots__ = ("index", "shape", "step", "tensor")

    def __init__(self, step: int, index: int, tensor: torch.Tensor) -> None:
        self.step = step
        self.index = index
        self.shape = tensor.shape
        self.tensor: torch.Tensor | None = tensor


# --------------------------------------------------------------------------- executor


class _LoopRunner:
    """Applies a planner's actions to real carries; owns the checkpoints of one loop call."""

    def __init__(
        self,
        step_fn: Callable[[Carry], Carry],
        layout: CarryLayout,
        planner: RevolveScheduler,
        preserve_rng_state: bool,
        stats: LoopStats,
    ) -> None:
        self.step_fn = step_fn
        self.layout = layout
        self.planner = planner
        self.preserve_rng_state = preserve_rng_state
        self.stats = stats
        self.current: list[torch.Tensor] = []
        self.store: dict[int, CarrySnapshot] = {}
        self.requires_grad: list[tuple[bool, ...]] = []  # of x_{i}, as in the forward pass
        self.saved_counts: list[int] = []  # tensors saved by step i+1 in the forward pass
        self.newest_slots: list[_SavedSlot] = []
        # The carry before the live one ([checkpoints hold carry and RNG]).
        self.held_back: tuple[int, CarrySnapshot] | None = None
        self.recomputed: tuple[int, list[torch.Tensor | None]] | None = None
        self.autocast = AutocastState.capture()

    # ----------------------------------------------------------------- actions
    def execute(self, actions: list[Action], forward: bool) -> None:
        for action in actions:
            self.stats.add(action)
            if action.kind == "store":
                held_back = self.held_back
                if held_back is not None and held_back[0] == action.stop:
                    self.store[action.stop] = held_back[1]
                else:
                    self.store[action.stop] = self._snapshot()
            elif action.kind == "free":
                del self.store[action.stop]
            elif action.kind == "restore":
                self._restore(action.stop)
            elif action.kind == "advance":
                for step in range(action.start + 1, action.stop + 1):
                    self.current = self.forward_step(step) if forward else self._advance_step(step)
            elif forward:
                self.current = self.forward_step(action.stop)
            else:
                self._tape_step(action.stop)

    def _snapshot(self) -> CarrySnapshot:
        """The live carry, with the RNG state before the next step."""
        leaves = tuple(t.detach() for t in self.current)
        rng = RngSnapshot.capture() if self.preserve_rng_state else None
        return CarrySnapshot(leaves, tuple(t._version for t in leaves), rng)

    def _restore(self, index: int) -> None:
        snapshot = self.store[index]
        for path, leaf, version in zip(self.layout.paths, snapshot.leaves, snapshot.versions):
            if leaf._version != version:
                raise RematError(
                    f"{path} (the carry after step {index}) was modified in place after it was stored "
                    f"(version {version} -> {leaf._version}). step_fn must not modify its input carry in "
                    f"place: write h = h + x, not h += x."
                )
        self.current = list(snapshot.leaves)
        if snapshot.rng is not None:
            snapshot.rng.restore()

    # ------------------ forward pass ([one forward, full graph], [only the newest step is held])
    def forward_step(self, step: int) -> list[torch.Tensor]:
        """Run step ``step`` with autograd recording; its saved tensors stay real until the next step."""
        for slot in self.newest_slots:
            slot.tensor = None
        self.newest_slots = []
        flags = tuple(t.requires_grad for t in self.current)
        if self.requires_grad and self.requires_grad[-1] == flags:
            flags = self.requires_grad[-1]  # share the tuple: one pointer per step, not one tuple
        self.requires_grad.append(flags)

        def pack(tensor: torch.Tensor) -> _SavedSlot:
            slot = _SavedSlot(step, len(self.newest_slots), tensor)
            self.newest_slots.append(slot)
            return slot

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = self.step_fn(self.layout.build(self.current))
        self.saved_counts.append(len(self.newest_slots))
        return self.layout.leaves_of(out, step)

    # ------------------------------------------------- backward pass ([recompute on first need])
    def _unpack(self, slot: _SavedSlot) -> torch.Tensor:
        if slot.tensor is not None:
            return slot.tensor
        if torch.is_grad_enabled():  # autograd runs backward with grad mode on only for create_graph=True
            raise RematError(
                f"backward through step {slot.step} of a checkpointed loop was called with create_graph=True; "
                f"higher-order gradients are not supported, because recomputed tensors are detached from the "
                f"graph. Use a plain loop (or torch.utils.checkpoint) where you need double backward."
            )
        if self.recomputed is None or self.recomputed[0] != slot.step or self.recomputed[1][slot.index] is None:
            self._serve(slot.step)
        assert self.recomputed is not None
        tensor = self.recomputed[1][slot.index]
        self.recomputed[1][slot.index] = None  # autograd owns it now; a second unpack recomputes
        assert tensor is not None
        if tensor.shape != slot.shape:
            raise RecomputationMismatchError(
                f"recomputing step {slot.step} gave saved tensor #{slot.index} the shape {tuple(tensor.shape)}, "
                f"but the forward pass saved shape {tuple(slot.shape)}. step_fn must compute the same thing "
                f"from the same carry; does it depend on Python state that changes between calls?"
            )
        return tensor

    def _serve(self, step: int) -> None:
        self.recomputed = None
        caller_rng = RngSnapshot.capture() if self.preserve_rng_state else None
        try:
            with contextlib.ExitStack() as stack:
                self.autocast.enter(stack)
                stack.enter_context(UndoOuterWrites())  # [recomputation leaves buffers alone]
                self.execute(self.planner.request(step), forward=False)
        finally:
            if caller_rng is not None:
                caller_rng.restore()

    def _advance_step(self, step: int) -> list[torch.Tensor]:
        with torch.no_grad():
            return self.layout.leaves_of(self.step_fn(self.layout.build(self.current)), step)

    def _tape_step(self, step: int) -> None:
        recorded: list[torch.Tensor | None] = []

        def pack(tensor: torch.Tensor) -> int:
            recorded.append(tensor.detach())
            return len(recorded) - 1

        def unpack(index: int) -> torch.Tensor:
            raise RuntimeError("internal error: the graph of a recomputed step is never differentiated")

        flags = self.requires_grad[step - 1]
        inputs = [t.detach().requires_grad_(flag) for t, flag in zip(self.current, flags)]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            self.layout.leaves_of(self.step_fn(self.layout.build(inputs)), step)
        expected = self.saved_counts[step - 1]
        if len(recorded) != expected:
            raise RecomputationMismatchError(
                f"recomputing step {step} saved {len(recorded)} tensors for backward, but the forward pass "
                f"saved {expected}. step_fn must be deterministic given its carry and the RNG state; does it "
                f"branch on Python state that changes between calls (a counter, a global flag)?"
            )
        self.current = []
        self.recomputed = (step, recorded)


# --------------------------------------------------------------------------- public API


def _prepare(
    carry: Carry, checkpoints: int | None, budget_bytes: int | str | None, stats: LoopStats | None
) -> tuple[CarryLayout, list[torch.Tensor], int, LoopStats]:
    layout, leaves = CarryLayout.of(carry)
    count = _resolve_checkpoints(checkpoints, budget_bytes, layout.nbytes)
    stats = stats if stats is not None else LoopStats(record_actions=False)  # counts only: no O(steps) list
    stats.checkpoints, stats.carry_bytes, stats.step_evaluations, stats.actions[:] = count, layout.nbytes, 0, []
    return layout, leaves, count, stats


def checkpointed_loop(
    step_fn: Callable[[Carry], Carry],
    carry: Carry,
    *,
    steps: int,
    checkpoints: int | None = None,
    budget_bytes: int | str | None = None,
    preserve_rng_state: bool = True,
    stats: LoopStats | None = None,
) -> Carry:
    """``for _ in range(steps): carry = step_fn(carry)``, holding at most ``checkpoints`` carries for backward.

    The backward pass recomputes steps following the binomial (Revolve) schedule, which uses the
    least number of step evaluations possible: ``revolve.optimal_step_evaluations(steps, checkpoints)``
    (Griewank & Walther 2000). Gradients reach the carry and everything ``step_fn`` closes over, and
    equal the plain loop's bit for bit on CPU (dropout included, ``preserve_rng_state=True``).

    Args:
        step_fn: maps a carry to the next; must keep its structure, shapes, dtypes and devices, must not
            modify its input in place, and must be deterministic given the carry and the RNG state.
        carry: a tensor or nested tuples / lists / dicts / namedtuples of tensors.
        steps: number of steps (>= 1).
        checkpoints: carries stored at most, x_0 included (>= 1; 1 means recompute from x_0 each time).
        budget_bytes: instead of ``checkpoints``, bytes (an int, or a size such as ``"64MiB"``) for the
            stored carries plus the live one; the count is ``budget_bytes // carry_bytes - 1``, >= 1.
            Activations of the step being differentiated come on top.
        preserve_rng_state: store the RNG state with each checkpoint so recomputation is bit-identical.
        stats: a ``LoopStats`` to fill in (evaluation count and the actions run).

    Example:
        >>> import torch
        >>> rnn = torch.nn.Linear(8, 8)
        >>> h = checkpointed_loop(lambda h: torch.tanh(rnn(h)), torch.zeros(2, 8), steps=100, checkpoints=5)
        >>> h.sum().backward()
        >>> rnn.weight.grad.shape
        torch.Size([8, 8])
    """
    check_positive_int("steps", steps)
    layout, leaves, count, stats = _prepare(carry, checkpoints, budget_bytes, stats)
    stats.steps = steps
    if not torch.is_grad_enabled():
        return _plain_loop(step_fn, layout, leaves, steps, stats)
    planner = RevolveScheduler(count)
    runner = _LoopRunner(step_fn, layout, planner, preserve_rng_state, stats)
    runner.current = leaves
    runner.execute(planner.start() + planner.forward(steps), forward=True)
    return layout.build(runner.current)


def _plain_loop(
    step_fn: Callable[[Carry], Carry], layout: CarryLayout, leaves: list[torch.Tensor], steps: int, stats: LoopStats
) -> Carry:
    """Without grad there is nothing to store: run the steps (still checking the carry)."""
    for step in range(1, steps + 1):
        leaves = layout.leaves_of(step_fn(layout.build(leaves)), step)
    stats.add(Action("advance", 0, steps))
    return layout.build(leaves)


def checkpointed_while(
    cond_fn: Callable[[Carry], bool | torch.Tensor],
    step_fn: Callable[[Carry], Carry],
    carry: Carry,
    *,
    max_steps: int,
    checkpoints: int | None = None,
    budget_bytes: int | str | None = None,
    preserve_rng_state: bool = True,
    stats: LoopStats | None = None,
) -> Carry:
    """``while cond_fn(carry) and n < max_steps: carry = step_fn(carry)``, holding few carries for backward.

    The number of steps is found while running, so checkpoints are placed online, after Stumm &
    Walther, "New algorithms for optimal online checkpointing" (2010), then Wang, Moin & Iaccarino
    (2009) (see ``torchckpt.loops.online``). Backward is then the binomial reversal from the carries
    held. Up to ``binom(checkpoints + 2, 2)`` steps this uses exactly as many ``step_fn`` calls as
    ``checkpointed_loop`` would with the length known (the offline optimum); beyond, no step is
    evaluated more often than there, but the total can be higher. ``cond_fn`` runs without grad and
    is not re-run in backward. Arguments and gradient guarantees are those of ``checkpointed_loop``;
    ``stats.steps`` tells how many steps ran.

    Example:
        >>> import torch
        >>> w = torch.tensor(0.5, requires_grad=True)
        >>> stats = LoopStats()
        >>> x = checkpointed_while(lambda x: x.sum() > 1e-3, lambda x: x * w, torch.ones(3),
        ...                        max_steps=1000, checkpoints=4, stats=stats)
        >>> x.sum().backward()              # x = 3 * w**n, so dx/dw = 3 * n * w**(n-1)
        >>> stats.steps, float(w.grad) == 3 * 12 * 0.5**11
        (12, True)
    """
    check_positive_int("max_steps", max_steps)
    layout, leaves, count, stats = _prepare(carry, checkpoints, budget_bytes, stats)
    planner = RevolveScheduler(count)
    runner = _LoopRunner(step_fn, layout, planner, preserve_rng_state, stats)
    runner.current = leaves
    grad = torch.is_grad_enabled()
    step = 0
    while step < max_steps and _condition(cond_fn, layout.build(runner.current), step):
        if grad:
            runner.execute(_online_actions_before(planner, step), forward=True)
            runner.held_back = (step, runner._snapshot()) if step >= 1 else None
            runner.execute([Action("advance", step, step + 1)], forward=True)
        else:
            runner.current = _advance_plain(runner, step + 1)
        step += 1
    runner.held_back = None
    stats.steps = step
    if grad and step > 0:
        (tape,) = planner.end_forward(step)
        # The last step ran as an advance; it is the taped one ([only the newest step is held]).
        if stats.record_actions:
            stats.actions[-1] = tape
    return layout.build(runner.current)


def _online_actions_before(planner: RevolveScheduler, step: int) -> list[Action]:
    """Before step ``step + 1`` runs: store x_0 first; later, the loop is known to run at least
    ``step + 1`` steps, so x_{step-1}, the held-back carry, is offered
    ([checkpoints hold carry and RNG])."""
    if step == 0:
        return planner.start()
    return planner.offer(step - 1) if step >= 2 else []


def _advance_plain(runner: _LoopRunner, step: int) -> list[torch.Tensor]:
    runner.stats.add(Action("advance", step - 1, step))
    return runner.layout.leaves_of(runner.step_fn(runner.layout.build(runner.current)), step)


def _condition(cond_fn: Callable[[Carry], bool | torch.Tensor], carry: Carry, step: int) -> bool:
    with torch.no_grad():
        flag = cond_fn(carry)
    if isinstance(flag, torch.Tensor):
        if flag.numel() != 1:
            raise ValueError(
                f"cond_fn returned a tensor of shape {tuple(flag.shape)} after {step} steps; it must return a "
                f"bool or a one-element tensor. Reduce it, e.g. with .all() or .any()."
            )
        return bool(flag.item())
    return bool(flag)
