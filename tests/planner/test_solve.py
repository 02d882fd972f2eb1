"""The solver's values, menus and evaluator: golden numbers worked by hand, brute force, clear errors."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.from_costs import ChainCosts
from torchckpt.planner.solve import (
    MENU_MAX_OPTIONS,
    InfeasibleBudgetError,
    MenuOption,
    Region,
    Single,
    block_menu,
    evaluate,
    floor_bytes,
    solve,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def _three_blocks() -> ChainCosts:
    b0 = BlockCosts(name="b0", input_bytes=10, output_bytes=20, saved_bytes=30, forward_time_s=1.0,
                    forward_peak_bytes=3, backward_peak_bytes=4, recompute_peak_bytes=1)
    b1 = BlockCosts(name="b1", input_bytes=20, output_bytes=6, saved_bytes=12, forward_time_s=2.0,
                    forward_peak_bytes=2, backward_peak_bytes=1, recompute_peak_bytes=5)
    b2 = BlockCosts(name="b2", input_bytes=6, output_bytes=8, saved_bytes=9, forward_time_s=4.0,
                    forward_peak_bytes=1, backward_peak_bytes=2, recompute_peak_bytes=3)
    return ChainCosts(fixed_bytes=100, head_bytes=5, region_recompute_bytes=2, blocks=(b0, b1, b2))


# --------------------------------------------------------------------------- evaluate: worked by hand


def test_evaluate_all_plain_by_hand() -> None:
    # C = fixed + y_2 = 108. b0: 108 + x 10 + saved 30 + bwd 4 + y 20 = 172; holds 40.
    # b1: 108 + 40 + (20 + 12 + 1 + 6) = 187; holds 32 more. b2 (last, no y): 108 + 72 + (6 + 9 + 2) = 197.
    # Forward end: 100 + 87 + head 5 = 192. Peak 197.
    assert evaluate(_three_blocks(), (Single(0, 0), Single(1, 0), Single(2, 0))) == (197, 0.0)


def test_evaluate_region_by_hand() -> None:
    # Region [0, 2) forward: 108 + max(10 + 3, 10 + 20 + 2) = 140; it then holds x_0 = 10.
    # Inside: C' = 108 + 0 + region_recompute 2 = 110, g = y_1 = 6.
    #   b0 keeps nothing: forward 10 + 3 + 6 = 19, backward 10 + 30 + 4 + recompute 1 + 20 = 65 -> 175; holds 10.
    #   b1 plain: 110 + 10 + max(20 + 2 + 6, 20 + 12 + 1 + 6) = 159.
    # b2 plain: 108 + 10 + 17 = 135; forward end 100 + 25 + 5 = 130. Peak 175.
    # Time: the region's forward 1 + 2, plus b0 recomputed inside: 4.
    schedule = (Region(0, 2, (Single(0, 1), Single(1, 0))), Single(2, 0))
    assert evaluate(_three_blocks(), schedule) == (175, 4.0)


def test_evaluate_accepts_lists_and_is_pure() -> None:
    costs = _three_blocks()
    assert evaluate(costs, [Single(0, 0), Single(1, 0), Single(2, 0)]) == (197, 0.0)
    assert costs == _three_blocks()


@pytest.mark.parametrize("schedule, message", [
    ((Single(0, 0), Single(2, 0)), "block 1 comes next"),
    ((Single(0, 0), Single(1, 0)), "must reach block 2"),
    ((Single(0, 0), Single(0, 0), Single(1, 0), Single(2, 0)), "block 1 comes next"),
    ((Single(0, 0), Single(1, 0), Single(2, 0), Single(3, 0)), "chain ends at block 2"),
    ((Single(0, 5), Single(1, 0), Single(2, 0)), "has 2 menu options"),
    ((Region(0, 2, (Single(0, 0),)), Single(2, 0)), "must reach block 1"),
    ((Region(0, 2, (Region(0, 2, (Single(0, 0), Single(1, 0))),)), Single(2, 0)), "inside itself"),
    ((Region(0, 4, (Single(0, 0), Single(1, 0), Single(2, 0), Single(3, 0))),), "chain ends at block 2"),
])
def test_evaluate_rejects_malformed_schedules(schedule: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate(_three_blocks(), schedule)


def test_checkpoint_options_inside_a_region_are_refused() -> None:
    op = OpCosts(index=0, name="mm", output_bytes=5, saved=True, time_s=1.0)
    block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=10, forward_time_s=2.0, ops=(op,))
    costs = ChainCosts(fixed_bytes=0, head_bytes=0, blocks=(block, block))
    assert len(block_menu(block)) == 3
    evaluate(costs, (Single(0, 1), Single(1, 0)))  # allowed at the top level
    with pytest.raises(ValueError, match=r"checkpoint.py's \[nested checkpoints keep nothing\]"):
        evaluate(costs, (Region(0, 2, (Single(0, 1), Single(1, 0))),))


@pytest.mark.parametrize("make, error, message", [
    (lambda: Single(block=-1, option=0), ValueError, "Single.block must be an int >= 0"),
    (lambda: Single(block=0, option=True), TypeError, "Single.option"),
    (lambda: Region(2, 3, (Single(2, 0),)), ValueError, "at least 2 blocks"),
    (lambda: Region(0, 2, ()), TypeError, "non-empty tuple"),
    (lambda: Region(0, 2, ("plain", "plain")), TypeError, "non-empty tuple"),
])
def test_pieces_are_checked_when_built(make, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_bad_inputs_get_clear_errors() -> None:
    costs = _three_blocks()
    with pytest.raises(ValueError, match="budget_bytes must be >= 0; got -1"):
        solve(costs, -1)
    with pytest.raises(TypeError, match="parse_bytes"):
        solve(costs, "6GiB")
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        solve(costs, 200.0)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        solve(costs, True)
    with pytest.raises(TypeError, match="costs must be a cost model"):
        solve({"blocks": []}, 100)
    with pytest.raises(TypeError, match="costs must be a cost model"):
        evaluate(None, ())
    with pytest.raises(TypeError, match="schedule must be a tuple"):
        evaluate(costs, Single(0, 0))
    with pytest.raises(TypeError, match=r"schedule\[1\] must be a Single or a Region"):
        evaluate(costs, (Single(0, 0), 1, Single(2, 0)))
    with pytest.raises(ValueError, match="memory_slots"):
        solve(costs, 300, memory_slots=0)
    with pytest.raises(TypeError, match="expected a BlockCosts"):
        block_menu(costs)


def test_infeasible_error_names_the_floor_its_parts_and_what_to_try() -> None:
    costs = _three_blocks()
    floor = floor_bytes(costs)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(costs, floor - 1)
    error = caught.value
    assert isinstance(error, ValueError)
    assert (error.floor_bytes, error.budget_bytes) == (floor, floor - 1)
    assert error.breakdown["fixed_bytes"] == 100 and error.breakdown["activation_bytes"] == floor - 100
    text = str(error)
    for part in (f"{floor} bytes", "fixed", "smaller batch", "offload=True", "sharding", "block"):
        assert part in text
    assert solve(costs, floor).predicted_peak_bytes == floor


# --------------------------------------------------------------------------- menus


def _pareto_by_subsets(block: BlockCosts) -> list[tuple[int, float]]:
    """Exhaustive: (held, time) of every non-empty subset of saved ops that holds less than plain,
    not dominated by another subset nor by keep-nothing; by held descending."""
    ops = sorted((op for op in block.ops if op.saved), key=lambda op: op.index)
    points = set()
    for r in range(1, len(ops) + 1):
        for subset in itertools.combinations(ops, r):
            held, saved = 0, 0.0
            for op in subset:
                held, saved = held + op.output_bytes, saved + op.time_s
            if held < block.saved_bytes:
                points.add((held, max(0.0, block.forward_time_s - saved)))
    points.add((0, block.forward_time_s))
    front = [p for p in points if not any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in points)]
    return sorted(((h, t) for h, t in front if (h, t) != (0, block.forward_time_s)), reverse=True)


def _random_block(rng: np.random.Generator, n_ops: int) -> BlockCosts:
    ops = tuple(OpCosts(index=k, name=f"op{k}", output_bytes=int(rng.integers(1, 40)), saved=bool(rng.random() < 0.8),
                        time_s=float(rng.integers(0, 5))) for k in range(n_ops))
    saved = sum(op.output_bytes for op in ops if op.saved) + int(rng.integers(0, 10))
    return BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=saved,
                      forward_time_s=float(rng.integers(1, 12)), ops=ops)


@pytest.mark.parametrize("seed", range(30))
def test_menu_is_the_exact_pareto_front(seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = _random_block(rng, int(rng.integers(0, 8)))
    menu = block_menu(block)
    expected = _pareto_by_subsets(block)
    assert menu[0] == MenuOption(tuple(op.index for op in block.ops if op.saved), block.saved_bytes, 0.0, True)
    assert menu[-1] == MenuOption((), 0, block.forward_time_s, False)
    if len(expected) <= MENU_MAX_OPTIONS - 2:
        assert [(o.held_bytes, o.recompute_s) for o in menu[1:-1]] == expected
    for option in menu[1:-1]:
        kept = [op for op in block.ops if op.index in option.kept_ops]
        assert all(op.saved for op in kept) and option.held_bytes == sum(op.output_bytes for op in kept)
        assert not option.plain


def test_menu_cap_keeps_extremes_and_spans_bytes() -> None:
    ops = tuple(OpCosts(index=k, name=f"op{k}", output_bytes=2**k, saved=True, time_s=float(2**k)) for k in range(9))
    block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=2**9, forward_time_s=2.0**9, ops=ops)
    menu = block_menu(block)
    front = _pareto_by_subsets(block)
    assert len(front) == 2**9 - 1  # every non-empty subset is a distinct Pareto point
    assert len(menu) == MENU_MAX_OPTIONS
    assert menu[0].plain and menu[-1].kept_ops == ()
    middle = [(o.held_bytes, o.recompute_s) for o in menu[1:-1]]
    assert all(point in front for point in middle)
    held = [h for h, _ in middle]
    assert held == sorted(held, reverse=True) and len(set(held)) == len(held)
    gaps = np.diff(sorted([0, *held, 2**9]))
    assert gaps.max() <= 2 * gaps.min() + 1  # evenly spread over 0..saved_bytes


def test_menu_without_saved_ops_is_plain_and_keep_nothing() -> None:
    block = BlockCosts(name="b", input_bytes=1, output_bytes=1, saved_bytes=7, forward_time_s=3.0,
                       ops=(OpCosts(index=0, name="view", output_bytes=9, saved=False, time_s=1.0),))
    assert block_menu(block) == (MenuOption((), 7, 0.0, True), MenuOption((), 0, 3.0, False))


# --------------------------------------------------------------------------- never imports torch

_ISOLATED = r"""
import importlib.abc, sys, types

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("blocked import of " + name)

sys.meta_path.insert(0, NoTorch())
# bare packages: their __init__ (which imports torch) is skipped
for package in ("torchckpt", "torchckpt.planner", "torchckpt.executor"):
    module = types.ModuleType(package)
    module.__path__ = [sys.argv[1] + "/" + package.replace(".", "/")]
    sys.modules[package] = module
import importlib
target = sys.argv[2]
importlib.import_module(target)
if target == "torchckpt.planner.solve":
    from torchckpt.planner.costs import BlockCosts, CostModel
    from torchckpt.planner.solve import solve
    block = BlockCosts(name="b", input_bytes=4, output_bytes=4, saved_bytes=8, forward_time_s=1.0)
    print(solve(CostModel(fixed_bytes=100, head_bytes=10, blocks=(block,) * 4), 150).extra_time_s)
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""


def test_solve_never_imports_torch() -> None:
    run = subprocess.run([sys.executable, "-c", _ISOLATED, str(SRC), "torchckpt.planner.solve"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1.0"


def test_the_torch_blocker_does_block() -> None:  # the test above could not fail without this
    run = subprocess.run([sys.executable, "-c", _ISOLATED, str(SRC), "torchckpt.executor.policies"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "blocked import of torch" in run.stderr
