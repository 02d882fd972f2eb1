"""checkpointed_loop / checkpointed_while: bitwise gradients, optimal evaluation counts, memory, errors."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from torchckpt.executor.checkpoint import RecomputationMismatchError, RematError
from torchckpt.loops.online import online_held_states
from torchckpt.loops.revolve import (
    binomial_max_steps,
    online_schedule,
    optimal_step_evaluations,
    revolve_schedule,
)
from torchckpt.loops.runner import LoopStats, checkpointed_loop, checkpointed_while
from torchckpt.memory import MemoryMeter

WIDTH = 6


class Aux(NamedTuple):
    drive: torch.Tensor
    count: torch.Tensor  # int64: carried along, never differentiated


class Cell(nn.Module):
    """An RNN-style step with dropout, a parameter from outside the module and a nested carry."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)
        self.base = nn.Parameter(torch.full((WIDTH,), 0.7))

    def step_fn(self, scale: torch.Tensor, calls: list[int]) -> Callable[[Any], Any]:
        def step(carry: dict[str, Any]) -> dict[str, Any]:
            calls[0] += 1
            h, aux = carry["h"], carry["aux"]
            h = torch.tanh(self.lin(self.drop(h)) * scale + aux.drive)
            return {"h": h, "aux": Aux(drive=aux.drive * 0.9 + h.mean(0), count=aux.count + 1)}

        return step


def make_problem(seed: int = 0) -> tuple[Cell, dict[str, Any], list[torch.Tensor]]:
    torch.manual_seed(seed)
    cell = Cell()
    h0 = torch.randn(3, WIDTH, requires_grad=True)
    carry = {"h": h0, "aux": Aux(drive=torch.randn(WIDTH), count=torch.zeros((), dtype=torch.int64))}
    return cell, carry, [h0, cell.lin.weight, cell.lin.bias, cell.base]


def loss_of(carry: dict[str, Any]) -> torch.Tensor:
    return (carry["h"] ** 2).sum() + carry["aux"].drive.sum()


def plain_gradients(steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cell, carry, inputs = make_problem()
    scale = cell.base * 2  # a non-leaf tensor from outside the loop: its gradient must flow through
    step = cell.step_fn(scale, [0])
    torch.manual_seed(123)
    for _ in range(steps):
        carry = step(carry)
    loss = loss_of(carry)
    return loss.detach(), list(torch.autograd.grad(loss, inputs))


CASES = [(1, 1), (2, 1), (9, 1), (3, 10), (5, 5), (12, 3), (40, 4), (64, 6)]


@pytest.mark.parametrize("steps,checkpoints", CASES)
@pytest.mark.parametrize("mode", ["autograd.grad", "backward"])
def test_gradients_bitwise_equal_plain_loop(steps: int, checkpoints: int, mode: str) -> None:
    ref_loss, ref_grads = plain_gradients(steps)
    cell, carry, inputs = make_problem()
    scale = cell.base * 2
    calls = [0]
    stats = LoopStats()
    torch.manual_seed(123)
    out = checkpointed_loop(cell.step_fn(scale, calls), carry, steps=steps, checkpoints=checkpoints, stats=stats)
    loss = loss_of(out)
    assert torch.equal(loss, ref_loss)
    assert int(out["aux"].count) == steps
    if mode == "backward":
        loss.backward()
        grads = [t.grad for t in inputs]
    else:
        grads = list(torch.autograd.grad(loss, inputs))
    for name, got, want in zip(["h0", "lin.weight", "lin.bias", "base"], grads, ref_grads):
        assert got is not None and torch.equal(got, want), name
    # The count is the binomial optimum, and the actions are exactly revolve_schedule's (bar the final
    # "free 0": x_0 stays held for a possible second backward pass).
    assert calls[0] == stats.step_evaluations == optimal_step_evaluations(steps, checkpoints)
    assert stats.lines() == revolve_schedule(steps, checkpoints).lines()[:-1]


def test_large_run_uses_the_optimal_number_of_evaluations() -> None:
    calls = [0]
    w = torch.tensor(0.999, requires_grad=True)

    def step(h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return h * w

    out = checkpointed_loop(step, torch.ones(2), steps=2_000, checkpoints=7)
    (grad,) = torch.autograd.grad(out.sum(), [w])
    # t = 7 (binom(14, 7) >= 2000 > binom(13, 6)), so p = 7 * 2000 - binom(14, 6) = 14000 - 3003.
    assert calls[0] == optimal_step_evaluations(2_000, 7) == 2_000 + 7 * 2_000 - 3_003
    plain = torch.ones(2)
    for _ in range(2_000):
        plain = plain * w
    assert torch.equal(grad, torch.autograd.grad(plain.sum(), [w])[0])


def test_dropout_masks_and_caller_rng_match_plain_loop() -> None:
    _, ref_grads = plain_gradients(20)
    after_plain = torch.rand(4)  # RNG position right after a plain forward + backward
    cell, carry, inputs = make_problem()
    torch.manual_seed(123)
    out = checkpointed_loop(cell.step_fn(cell.base * 2, [0]), carry, steps=20, checkpoints=3)
    loss_of(out).backward()
    assert torch.equal(torch.rand(4), after_plain), "recomputation must not move the caller's RNG"
    assert torch.equal(inputs[1].grad, ref_grads[1])


def test_second_backward_with_retain_graph() -> None:
    _, ref_grads = plain_gradients(15)
    cell, carry, inputs = make_problem()
    torch.manual_seed(123)
    out = checkpointed_loop(cell.step_fn(cell.base * 2, [0]), carry, steps=15, checkpoints=3)
    loss = loss_of(out)
    first = torch.autograd.grad(loss, inputs, retain_graph=True)
    second = torch.autograd.grad(loss, inputs)
    for a, b, want in zip(first, second, ref_grads):
        assert torch.equal(a, want) and torch.equal(b, want)


def test_no_grad_runs_the_plain_loop() -> None:
    cell, carry, _ = make_problem()
    step = cell.step_fn(cell.base * 2, [0])
    cell.eval()
    with torch.no_grad():
        ref = carry
        for _ in range(7):
            ref = step(ref)
        out = checkpointed_loop(step, carry, steps=7, checkpoints=2)
    assert torch.equal(out["h"], ref["h"])


# --------------------------------------------------------------------------- while loop


def while_problem(stop_below: float) -> tuple[Callable[[Any], Any], Callable[[Any], Any], tuple, list]:
    torch.manual_seed(1)
    lin = nn.Linear(WIDTH, WIDTH)
    drop = nn.Dropout(0.2)
    h0 = torch.randn(2, WIDTH, requires_grad=True)

    def step(carry: tuple) -> tuple:
        h, gate = carry
        return torch.tanh(lin(drop(h))), gate * 0.8

    def cond(carry: tuple) -> torch.Tensor:
        return carry[1] > stop_below

    return cond, step, (h0, torch.tensor(1.0)), [h0, lin.weight, lin.bias]


@pytest.mark.parametrize("checkpoints", [1, 2, 5, 40])
def test_while_stopping_early_matches_plain_loop(checkpoints: int) -> None:
    cond, step, carry, inputs = while_problem(0.01)  # 0.8**n > 0.01 stops after 21 steps
    torch.manual_seed(5)
    ref, n = carry, 0
    while n < 1000 and cond(ref):
        ref, n = step(ref), n + 1
    ref_grads = torch.autograd.grad(ref[0].sum(), inputs)

    cond, step, carry, inputs = while_problem(0.01)
    stats = LoopStats()
    torch.manual_seed(5)
    out = checkpointed_while(cond, step, carry, max_steps=1000, checkpoints=checkpoints, stats=stats)
    grads = torch.autograd.grad(out[0].sum(), inputs)
    assert n == stats.steps == 21
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    assert stats.lines() == online_schedule(21, checkpoints).lines()[:-1]
    # 21 = beta(5, 2): with 5 or more checkpoints the online count is the offline optimum (Stumm &
    # Walther); with 1 there is nothing to place; with 2, 21 = beta(2, 5) happens to be optimal too.
    assert stats.step_evaluations == optimal_step_evaluations(21, checkpoints)


WHILE_CASES = [(1, 1), (2, 1), (9, 1), (3, 10), (4, 4), (5, 5), (6, 2), (10, 3), (12, 3), (40, 4), (64, 6)]


@pytest.mark.parametrize("steps,checkpoints", WHILE_CASES)
def test_while_gradients_bitwise_equal_plain_loop(steps: int, checkpoints: int) -> None:
    # The Cell problem (dropout, a nested carry with an int counter, a module, a non-leaf tensor from
    # outside the loop); cond_fn stops on the counter, so the length is found only while running.
    ref_loss, ref_grads = plain_gradients(steps)
    cell, carry, inputs = make_problem()
    calls = [0]
    stats = LoopStats()
    torch.manual_seed(123)
    out = checkpointed_while(lambda c: c["aux"].count < steps, cell.step_fn(cell.base * 2, calls), carry,
                             max_steps=1000, checkpoints=checkpoints, stats=stats)
    loss = loss_of(out)
    assert torch.equal(loss, ref_loss) and stats.steps == steps
    for name, got, want in zip(["h0", "lin.weight", "lin.bias", "base"], torch.autograd.grad(loss, inputs), ref_grads):
        assert torch.equal(got, want), name
    assert calls[0] == stats.step_evaluations == online_schedule(steps, checkpoints).step_evaluations
    assert stats.lines() == online_schedule(steps, checkpoints).lines()[:-1]
    if steps <= binomial_max_steps(checkpoints, 2):  # Stumm & Walther: optimal up to binom(s + 2, 2)
        assert calls[0] == optimal_step_evaluations(steps, checkpoints)
    # The carries held when the loop ends (forward stores minus forward frees) are the placement's.
    forward = stats.actions[: [a.kind for a in stats.actions].index("tape")]
    held = {a.stop for a in forward if a.kind == "store"} - {a.stop for a in forward if a.kind == "free"}
    assert tuple(sorted(held)) == online_held_states(steps, checkpoints)


def test_while_stops_at_max_steps_and_at_zero_steps() -> None:
    cond, step, carry, _ = while_problem(-1.0)  # never false
    stats = LoopStats()
    out = checkpointed_while(cond, step, carry, max_steps=9, checkpoints=3, stats=stats)
    out[0].sum().backward()
    assert stats.steps == 9 and stats.step_evaluations == online_schedule(9, 3).step_evaluations

    cond, step, carry, _ = while_problem(2.0)  # false at once
    out = checkpointed_while(cond, step, carry, max_steps=9, checkpoints=3, stats=stats)
    assert stats.steps == 0 and out[0] is carry[0]


# --------------------------------------------------------------------------- memory


def measure(steps: int, checkpoints: int | None, online: bool = False) -> tuple[int, int, int]:
    """(forward peak, forward + backward peak, carry bytes) above the entry baseline.

    ``online``: run ``checkpointed_while`` (its cond_fn never says stop, max_steps=steps).
    """
    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    h0 = torch.randn(32, 128)

    def step(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(h))

    gc.collect()  # garbage from earlier tests would otherwise be freed, and uncounted, mid-measurement
    with MemoryMeter() as meter:
        base = meter.current_bytes
        if checkpoints is None:
            out = h0
            for _ in range(steps):
                out = step(out)
        elif online:
            out = checkpointed_while(lambda h: True, step, h0, max_steps=steps, checkpoints=checkpoints)
        else:
            out = checkpointed_loop(step, h0, steps=steps, checkpoints=checkpoints)
        forward = meter.peak_bytes - base
        out.sum().backward()
        del out
        total = meter.peak_bytes - base
    return forward, total, h0.numel() * h0.element_size()


@pytest.mark.parametrize("online", [False, True], ids=["loop", "while"])
@pytest.mark.parametrize("checkpoints,steps", [(1, 24), (4, 24), pytest.param(4, 96, marks=pytest.mark.slow),
                                               pytest.param(9, 96, marks=pytest.mark.slow)])
def test_memory_is_checkpoints_plus_constant_carries(checkpoints: int, steps: int, online: bool) -> None:
    forward, total, carry = measure(steps, checkpoints, online)
    # Forward: the stored carries (x_0 is the caller's, already in the baseline) plus, at the newest
    # step, its input, its linear output and its tanh output: (checkpoints - 1) + 3 carries exactly.
    assert forward == (checkpoints + 2) * carry
    # Backward adds a constant: whatever a 2-step plain loop needs beyond its activations (gradients of
    # the weight, one step's transients). It does not grow with the number of steps.
    _, plain_two_step_total, _ = measure(2, None)
    assert total <= forward + plain_two_step_total
    assert (forward, total) == measure(3 * steps, checkpoints, online)[:2]


def test_memory_far_below_plain_loop() -> None:
    _, total, carry = measure(384, 6)
    plain_forward, plain_total, _ = measure(384, None)
    assert plain_forward == 385 * carry  # every step's output plus the linear outputs tanh does not keep
    assert total * 10 < plain_total  # measured: 19.8x less


# --------------------------------------------------------------------------- budget and bad input


def test_budget_bytes_sets_the_count() -> None:
    h0 = torch.zeros(4, 8)  # 128 bytes
    stats = LoopStats()
    out = checkpointed_loop(lambda h: h + 1, h0, steps=10, budget_bytes=5 * 128 + 100, stats=stats)
    assert stats.checkpoints == 4 and stats.carry_bytes == 128 and torch.equal(out, h0 + 10)
    checkpointed_loop(lambda h: h + 1, h0, steps=10, budget_bytes="2KiB", stats=stats)
    assert stats.checkpoints == 2048 // 128 - 1


def test_budget_smaller_than_two_carries_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"budget_bytes=255 is smaller than two carries \(2 x 128 bytes\)"):
        checkpointed_loop(lambda h: h + 1, torch.zeros(4, 8), steps=10, budget_bytes=255)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"steps": 0, "checkpoints": 3}, ValueError, r"steps must be >= 1; got steps=0"),
        ({"steps": 5, "checkpoints": 0}, ValueError, r"checkpoints must be >= 1; got checkpoints=0"),
        ({"steps": 5, "checkpoints": 2.5}, TypeError, r"checkpoints must be an int >= 1; got 2.5"),
        ({"steps": 5}, ValueError, r"pass exactly one of checkpoints= .* and budget_bytes="),
        ({"steps": 5, "checkpoints": 2, "budget_bytes": 1024}, ValueError, r"pass exactly one of"),
    ],
)
def test_bad_counts(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        checkpointed_loop(lambda h: h + 1, torch.zeros(3), **kwargs)


def test_while_bad_max_steps_and_condition() -> None:
    with pytest.raises(ValueError, match=r"max_steps must be >= 1; got max_steps=0"):
        checkpointed_while(lambda h: True, lambda h: h, torch.zeros(3), max_steps=0, checkpoints=2)
    with pytest.raises(ValueError, match=r"cond_fn returned a tensor of shape \(3,\) after 0 steps"):
        checkpointed_while(lambda h: h > 0, lambda h: h, torch.zeros(3), max_steps=5, checkpoints=2)


@pytest.mark.parametrize(
    "step_fn,message",
    [
        (lambda c: (c[0] + 1,), r"structure at step 1: it received leaves \['carry\[0\]', 'carry\[1\]'\]"),
        (lambda c: (c[0], torch.zeros(5)), r"changed carry\[1\] at step 1: shape \(3,\), dtype torch.float32"),
        (lambda c: (c[0], c[1].double()), r"dtype torch.float32, device cpu became shape \(3,\), dtype torch.float64"),
    ],
)
def test_step_fn_changing_the_carry_is_rejected(step_fn: Callable, message: str) -> None:
    carry = (torch.zeros(3, requires_grad=True), torch.zeros(3))
    with pytest.raises(ValueError, match=message):
        checkpointed_loop(step_fn, carry, steps=4, checkpoints=2)


def test_non_tensor_carry_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"carry\[1\] is a int; a carry may hold only tensors"):
        checkpointed_loop(lambda c: c, (torch.zeros(3), 3), steps=4, checkpoints=2)


def test_in_place_update_of_a_stored_carry_is_rejected() -> None:
    w = torch.tensor(0.5, requires_grad=True)

    def step(h: torch.Tensor) -> torch.Tensor:
        h.mul_(1.0)  # modifies its input; x_1 is stored, so step 2 corrupts it
        return h * w

    out = checkpointed_loop(step, torch.ones(3), steps=4, checkpoints=2)
    message = r"carry \(the carry after step 1\) was modified in place after it was stored \(version 0 -> 1\)"
    with pytest.raises(RematError, match=message):
        out.sum().backward()


def test_nondeterministic_step_fn_is_reported() -> None:
    w = torch.tensor(0.5, requires_grad=True)
    calls = [0]

    def step(h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.tanh(h * w) if calls[0] <= 6 else h * w  # different ops when recomputed

    out = checkpointed_loop(step, torch.ones(3), steps=6, checkpoints=2)
    with pytest.raises(RecomputationMismatchError, match=r"recomputing step \d+ saved \d+ tensors for backward"):
        out.sum().backward()


def test_autocast_is_reapplied_when_recomputing() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    h0 = torch.randn(4, 8)

    def step(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(h)).float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = h0
        for _ in range(10):
            plain = step(plain)
        want = torch.autograd.grad(plain.sum(), [lin.weight])[0]
        out = checkpointed_loop(step, h0, steps=10, checkpoints=2)
    got = torch.autograd.grad(out.sum(), [lin.weight])[0]  # backward outside autocast, as usual
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dropout_gradients_match_plain_loop() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).cuda()
    drop = nn.Dropout(0.3)
    h0 = torch.randn(4, 16, device="cuda", requires_grad=True)

    def step(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(drop(h)))

    torch.cuda.manual_seed(7)
    plain = h0
    for _ in range(30):
        plain = step(plain)
    want = torch.autograd.grad(plain.sum(), [h0, lin.weight])
    torch.cuda.manual_seed(7)
    out = checkpointed_loop(step, h0, steps=30, checkpoints=4)
    got = torch.autograd.grad(out.sum(), [h0, lin.weight])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_double_backward_is_rejected() -> None:
    w = torch.tensor(0.5, requires_grad=True)
    out = checkpointed_loop(lambda h: torch.tanh(h * w), torch.ones(3), steps=5, checkpoints=2)
    with pytest.raises(RematError, match=r"create_graph=True; higher-order gradients are not supported"):
        torch.autograd.grad(out.sum(), [w], create_graph=True)
