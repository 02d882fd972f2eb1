"""Pieces nested inside a block (costs.py's [pieces nested inside a block]): the menu offers it only where it
peaks lower, the evaluator charges what was measured, plans with it carry through JSON, apply and verify_plan,
within budget and bitwise, and the profiler measures it on a real model."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.planner import solve as solver
from torchckpt.planner.blocks import block_pieces
from torchckpt.planner.costs import BlockCosts, CostModel
from torchckpt.planner.plan import Plan, PlannedBlock


def _block(nested: int, held: int = 0) -> BlockCosts:
    return BlockCosts(name="b", input_bytes=10, output_bytes=10, saved_bytes=100, forward_time_s=1.0,
                      backward_peak_bytes=50, recompute_peak_bytes=5, nested_recompute_peak_bytes=nested,
                      nested_held_bytes=held)


def test_the_menu_offers_nesting_only_where_it_peaks_lower_and_keeps_keep_nothing_last():
    menu = solver.block_menu(_block(nested=60, held=4))
    assert [o.nested for o in menu] == [False, True, False] and menu[-1].kept_ops == () and not menu[-1].plain
    assert menu[1].held_bytes == 4 and menu[1].recompute_s == 2 * menu[-1].recompute_s
    assert not any(o.nested for o in solver.block_menu(_block(nested=155)))  # 100 + 50 + 5: not lower
    assert not any(o.nested for o in solver.block_menu(_block(nested=-1)))  # not measured
    with pytest.raises(ValueError, match="nested_recompute_peak_bytes must be an int >= 0, or -1"):
        _block(nested=-2)


def test_the_evaluator_charges_the_measured_nested_peak_and_the_solver_uses_it_below_keep_nothing():
    blocks = (_block(nested=60, held=4),) * 3
    costs = CostModel(fixed_bytes=1000, head_bytes=0, blocks=blocks)
    keep_nothing = tuple(solver.Single(block=i, option=2) for i in range(3))
    nested = tuple(solver.Single(block=i, option=1) for i in range(3))
    every_peak, every_time = solver.evaluate(costs, keep_nothing)
    nested_peak, nested_time = solver.evaluate(costs, nested)
    # the last block's backward: C (1000 + 10) + H (2 x (10 + 4)) + its input 10 + its extra 4 + nested 60 (its
    # incoming gradient is in C)
    assert nested_peak == 1010 + 28 + 10 + 4 + 60
    assert every_peak == 1010 + 20 + 10 + 100 + 50 + 5
    assert nested_time == 2 * every_time
    solution = solver.solve(costs, nested_peak, margin_bytes=0)
    assert solution.predicted_peak_bytes <= nested_peak and any(
        solver.block_menu(b)[p.option].nested for b, p in zip(blocks, solution.schedule))
    with pytest.raises(ValueError, match="inside a region a block is plain"):
        solver.evaluate(costs, (solver.Region(0, 2, inner=(solver.Single(0, 1), solver.Single(1, 0))),
                                solver.Single(2, 0)))


def test_a_nested_piece_round_trips_and_is_refused_with_keeps():
    piece = PlannedBlock(block=0, plain=False, nested=True)
    plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=(piece,),
                block_paths=("blocks.0",), fingerprint={})
    assert json.loads(plan.to_json())["version"] == 2 and Plan.from_json(plan.to_json()) == plan
    assert plan.decisions()[0]["decision"] == "recompute all, pieces nested"
    with pytest.raises(ValueError, match="must be checkpointed keeping nothing"):
        PlannedBlock(block=0, plain=False, keep=(3,), nested=True)


def test_block_pieces_are_the_children_with_parameters():
    from torchckpt.models import gpt
    model = gpt("tiny")
    assert [type(p).__name__ for p in block_pieces(model.blocks[0])] == ["LayerNorm", "CausalSelfAttention",
                                                                        "LayerNorm", "MLP"]
    assert block_pieces(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_profiled_nested_plans_hold_their_budget_bitwise_on_hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2))
    ids = torch.randint(0, 256, (4, 128))
    batch = {"input_ids": ids, "labels": ids}
    costs = torchckpt.profile(model, batch, loss_head=False)
    assert all(b.nested_recompute_peak_bytes >= 0 for b in costs.blocks)
    options = [(i, k) for i, b in enumerate(costs.blocks) for k, o in enumerate(solver.block_menu(b)) if o.nested]
    assert options, [(b.saved_bytes, b.backward_peak_bytes, b.nested_recompute_peak_bytes) for b in costs.blocks]
    nested = tuple(solver.Single(block=i, option=k) for i, k in options)
    peak, _ = solver.evaluate(costs, nested)
    budget = peak + costs.margin_bytes
    plan = costs.plan(budget)
    assert any(piece.nested for piece in plan.schedule if isinstance(piece, PlannedBlock)), plan.table()
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and abs(report.prediction_error) <= 0.01, report.table()
    assert report.gradients_equal and report.max_gradient_difference == 0 and report.buffers_equal
    nested_blocks = {piece.block for piece in plan.schedule if isinstance(piece, PlannedBlock) and piece.nested}
    with torchckpt.apply(model, plan):  # exactly the nested blocks' pieces are wrapped while applied
        for i, layer in enumerate(model.model.layers):
            assert all(("forward" in vars(p)) == (i in nested_blocks) for p in block_pieces(layer))
    assert not any("forward" in vars(p) for layer in model.model.layers for p in block_pieces(layer))
