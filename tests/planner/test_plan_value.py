"""Block discovery and the Plan value: JSON round trip, refusal on a model it was not made for."""

from __future__ import annotations

import pytest
import torch
import transformers

from torchckpt.models import gpt, mlp, unet
from torchckpt.planner.blocks import find_blocks
from torchckpt.planner.plan import Plan, PlanMismatchError, PlannedBlock, PlannedRegion, fingerprint


def _plan_for(model: torch.nn.Module, batch: tuple) -> Plan:
    paths = [f"blocks.{i}" for i in range(len(model.blocks))]
    inner = (PlannedBlock(block=0, plain=True), PlannedBlock(block=1, plain=True))
    region = PlannedRegion(start=0, stop=2, inner=inner)
    schedule = (region, PlannedBlock(block=2, plain=False, keep=(3, 12)), PlannedBlock(block=3, plain=True))
    return Plan(budget_bytes=10**6, predicted_peak_bytes=9 * 10**5, predicted_extra_time_s=0.01, schedule=schedule,
                block_paths=tuple(paths), fingerprint=fingerprint(model, batch, paths),
                reference={"no_checkpointing_peak_bytes": 2e6})


def test_find_blocks_on_built_in_and_hf_models() -> None:
    assert find_blocks(gpt("tiny"))[0] == "blocks"
    assert len(find_blocks(mlp(depth=5, width=8))[1]) == 5
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2))
    assert find_blocks(llama) == ("model.layers", list(llama.model.layers))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4))
    assert find_blocks(gpt2)[0] == "transformer.h"
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                                          num_attention_heads=4, intermediate_size=64))
    assert find_blocks(bert)[0] == "encoder.layer"


def test_model_without_blocks_names_the_blocks_option() -> None:
    with pytest.raises(ValueError, match=r"pass them explicitly, in the order they run: torchckpt.plan\(model, "
                                         r"inputs, budget='6GiB', blocks=\[...\]\)"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)))


def test_plan_round_trips_and_reports_decisions(tmp_path) -> None:  # noqa: ANN001
    model = gpt("mini")
    batch = model.example_batch(batch_size=2, seq_len=8)
    plan = _plan_for(model, batch)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", model, batch)
    assert loaded == plan
    decisions = [row["decision"] for row in plan.decisions()]
    assert decisions == ["keep all", "keep all", "recompute, keep 2 ops", "keep all"]
    assert plan.decisions()[0]["region"] == (0, 2)
    assert "predicted peak" in str(plan) and "this plan's predicted peak is 45% of that" in str(plan)


def test_plan_is_refused_on_another_model_or_input_shape(tmp_path) -> None:  # noqa: ANN001
    model = gpt("mini")
    batch = model.example_batch(batch_size=2, seq_len=8)
    _plan_for(model, batch).save(tmp_path / "plan.json")
    with pytest.raises(PlanMismatchError, match="different inputs: the plan has .*2, 8.* the model and inputs given "
                                                "have .*4, 8"):
        Plan.load(tmp_path / "plan.json", model, model.example_batch(batch_size=4, seq_len=8))
    with pytest.raises(PlanMismatchError, match="different structure"):
        Plan.load(tmp_path / "plan.json", gpt("mini", d_model=64), batch)


def test_not_a_plan_is_explained(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "x.json").write_text("{\"a\": 1}")
    with pytest.raises(ValueError, match="not a torchckpt plan"):
        Plan.load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        Plan.load(tmp_path / "y.json")


def test_incomplete_plan_is_explained() -> None:
    with pytest.raises(ValueError, match="not a complete torchckpt plan: missing or malformed field 'budget_bytes'"):
        Plan.from_json('{"format": "torchckpt.plan", "version": 1}')


def test_regions_keep_tuple_outputs_and_leave_nothing_behind() -> None:
    """Blocks that return 1-tuples (as older HF layers do), run as one region: same output and gradients."""
    import gc

    from torchckpt.planner import apply_plan
    from torchckpt.planner.profile import profile

    class TupleBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.tanh(self.linear(h)),)

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(TupleBlock() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)[0]
            return x.square().sum()

    torch.manual_seed(0)
    model, x = Chain(), torch.randn(2, 4, requires_grad=True)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    profile(model, (x,))
    assert not x._backward_hooks  # the profiler's gradient hooks are gone
    paths = [f"blocks.{i}" for i in range(3)]
    schedule = (PlannedRegion(start=0, stop=3, inner=tuple(PlannedBlock(block=i, plain=True) for i in range(3))),)
    plan = Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0, schedule=schedule,
                block_paths=tuple(paths), fingerprint=fingerprint(model, (x,), paths))
    model.zero_grad(set_to_none=True)
    x.grad = None
    with apply_plan(model, plan):
        model(x).backward()
        gc.collect()
        region_forward = model.blocks[0].forward
        kept = dict(zip(region_forward.__code__.co_freevars, (c.cell_contents for c in region_forward.__closure__)))
        assert kept["shape_of_output"] == {}  # nothing of the region's output (or its graph) kept after the step
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_find_blocks_uses_a_models_own_block_list() -> None:
    model = unet("tiny")
    name, blocks = find_blocks(model)
    assert name == "torchckpt_blocks()" and blocks == [*model.down, model.mid, *model.up]

    class Broken(torch.nn.Module):
        def torchckpt_blocks(self) -> list:
            return ["not a module"]

    with pytest.raises(ValueError, match="torchckpt_blocks"):
        find_blocks(Broken())


def test_blocks_given_out_of_forward_order_are_refused() -> None:
    from torchckpt.planner.profile import profile

    model = gpt("tiny", dropout=0.0)
    with pytest.raises(ValueError, match=r"order \[1, 0\].*forward order"):
        profile(model, model.example_batch(batch_size=2, seq_len=8), blocks=[model.blocks[1], model.blocks[0]])


def test_plan_pieces_are_typed_and_checked() -> None:
    with pytest.raises(TypeError, match="Plan.schedule holds PlannedBlock/PlannedRegion pieces; got dict"):
        Plan(budget_bytes=1, predicted_peak_bytes=1, predicted_extra_time_s=0.0,
             schedule=({"block": 0, "plain": True},), block_paths=("blocks.0",), fingerprint={})
    with pytest.raises(ValueError, match=r"inner covers blocks \[0, 2\]; it must cover \[0, 1\]"):
        PlannedRegion(start=0, stop=2, inner=(PlannedBlock(block=0, plain=True), PlannedBlock(block=2, plain=True)))
    with pytest.raises(ValueError, match="is plain .* and cannot also list ops to keep"):
        PlannedBlock(block=0, plain=True, keep=(1,))
    with pytest.raises(ValueError, match="PlannedBlock.block must be an int >= 0; got -1"):
        PlannedBlock(block=-1, plain=True)


def test_malformed_json_pieces_are_refused_by_name(tmp_path) -> None:  # noqa: ANN001
    model = gpt("mini")
    batch = model.example_batch(batch_size=2, seq_len=8)
    text = _plan_for(model, batch).to_json().replace('"plain": false', '"plain": "no"')
    with pytest.raises(ValueError, match="not a complete torchckpt plan: .*PlannedBlock.plain must be a bool"):
        Plan.from_json(text)
