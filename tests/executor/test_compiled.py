"""Plans under torch.compile (Note: [under torch.compile a region is torch's checkpoint], [compiled plans keep ops
by name and occurrence], [a compiled model is planned through its original], [Python side effects run once under
compile]).

Before: every compiled model was refused, and a plan compiled after it was applied graph-broke on every block. Now a
plan made eagerly runs inside compiled code, whole-model or per block, and what the meter measures is the compiled
step (the meter's mode lets compiled code run; with ``aot_eager`` every op of the compiled graphs dispatches through
it). References are the same model compiled the same way without a plan.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.executor import (
    checkpoint,
    checkpoint_modules,
    save_from_both_policies,
    save_only_these_names,
    save_ops,
    tag,
)
from torchckpt.executor.compiled import is_compiled_module, uncompiled
from torchckpt.memory import MemoryMeter
from torchckpt.models import gpt
from torchckpt.planner.plan import Plan, PlannedBlock

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch (no graph cached by an earlier test, no recompile limit reached)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _gpt() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = gpt("mini", dropout=0.0)
    return model, model.example_batch(batch_size=4, seq_len=256)


def _graph_breaks() -> dict:
    return dict(torch._dynamo.utils.counters["graph_break"])


def _measured(model: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[int, list[np.ndarray]]:
    """Peak bytes of one step of ``run`` (after a warm-up step that compiles) and the gradients it made (as NumPy
    copies, which the meter does not count in a later measurement)."""
    run().backward()
    for p in model.parameters():
        p.grad = None
    with MemoryMeter() as meter:
        run().backward()
    grads = [p.grad.numpy().copy() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return meter.peak_bytes, grads


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_the_meter_lets_compiled_code_run_and_sees_its_ops() -> None:
    """Before, Dynamo skipped every frame under the meter's dispatch mode, so a 'compiled' step was measured eagerly."""
    calls = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        def run(*args: torch.Tensor) -> object:
            calls.append(1)
            return gm(*args)
        return run

    compiled = torch.compile(lambda x: (x.sin() * 2).cos(), backend=backend)
    x = torch.randn(1024)
    compiled(x)
    with MemoryMeter(include_existing=False) as meter:
        y = compiled(x)
    assert len(calls) == 2  # the compiled graph ran inside the meter
    assert meter.current_bytes == y.untyped_storage().nbytes() == 4096
    assert meter.peak_bytes == 2 * 4096  # sin's output and cos's output were alive together


@pytest.mark.parametrize("how", ["whole", pytest.param("module.compile per block", marks=pytest.mark.slow),
                                 "torch.compile per block"])
def test_a_plan_runs_compiled_within_budget_with_the_compiled_gradients(how: str) -> None:
    model, batch = _gpt()

    def compile_(m: nn.Module) -> nn.Module:
        if how == "whole":
            return torch.compile(m, backend="aot_eager")
        for i, block in enumerate(m.blocks):  # torchtitan's order: checkpoint wrapper first, then compile per block
            if how == "module.compile per block":
                block.compile(backend="aot_eager")
            else:
                m.blocks[i] = torch.compile(block, backend="aot_eager")
        return m

    plan = torchckpt.plan(model, batch, budget="60%", loss_head=False)  # compiled: the head stays whole
    kinds = {p.block: bool(p.keep) for p in plan.schedule if isinstance(p, PlannedBlock)}
    assert any(kinds.values()), plan.table()  # the plan keeps ops somewhere, so the selective path is exercised
    reference = compile_(model)
    plain_peak, plain_grads = _measured(model, lambda: reference(*batch))
    torch._dynamo.reset()
    with torchckpt.apply(model, plan):
        compiled = compile_(model) if how == "whole" else model
        peak, grads = _measured(model, lambda: compiled(*batch))
    assert _graph_breaks() == {}
    assert peak <= plan.budget_bytes < plain_peak
    assert abs(peak - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes
    assert _equal(grads, plain_grads)


def test_a_compiled_model_is_planned_applied_and_recompiled(tmp_path: Path) -> None:
    """plan(torch.compile(model)) measures the original eagerly; apply() on the compiled module takes effect at its
    next call (Dynamo's guards see the blocks' new forward), and remove() puts the plain graph back."""
    model, batch = _gpt()
    compiled = torch.compile(model, backend="aot_eager")
    plain_peak, plain_grads = _measured(model, lambda: compiled(*batch))
    plan = torchckpt.plan(compiled, batch, budget="60%", loss_head=False)  # compiled: the head stays whole
    assert plan.block_paths[0] == "blocks.0" and is_compiled_module(compiled) and uncompiled(compiled) is model
    handle = torchckpt.apply(compiled, plan)
    # the wraps are on the original's blocks, inside the compiled code (which blocks: the plan's choice, and
    # that follows the measured block times, so it is not always block 0)
    assert handle.modules and all(any(m is b for b in model.blocks) and "forward" in vars(m) for m in handle.modules)
    peak, grads = _measured(model, lambda: compiled(*batch))
    handle.remove()
    after, _ = _measured(model, lambda: compiled(*batch))
    assert peak <= plan.budget_bytes < plain_peak == after
    assert _equal(grads, plain_grads)
    report = torchckpt.verify_plan(compiled, plan, batch)  # eager proof on the original model
    assert report.gradients_equal and report.buffers_equal and report.within_budget
    path = tmp_path / "plan.json"
    plan.save(path)
    assert torchckpt.Plan.load(path, compiled, batch).schedule == plan.schedule  # the fingerprint sees through


@pytest.mark.slow  # 20 s; compiled plans are checked fast on the project's GPT
def test_hf_llama_compiled_whole_has_no_graph_break() -> None:
    """HF decoder layers set a context variable in every call, which Dynamo refuses inside a checkpoint unless
    forward side effects may run once (Note: [Python side effects run once under compile]); it graph-broke 7 times."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    before = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    plain_peak, plain_grads = _measured(model, lambda: torch.compile(model, backend="aot_eager")(**batch).loss)
    torch._dynamo.reset()
    plan = torchckpt.plan(model, batch, budget="60%", loss_head=False)  # compiled: the head stays whole
    with torchckpt.apply(model, plan):
        compiled = torch.compile(model, backend="aot_eager")
        peak, grads = _measured(model, lambda: compiled(**batch).loss)
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == before  # set back by remove()
    assert _graph_breaks() == {}
    assert peak <= plan.budget_bytes < plain_peak
    assert abs(peak - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes
    assert _equal(grads, plain_grads)


def test_batchnorm_statistics_are_updated_once_under_compile() -> None:
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 2, 1],
                                       num_labels=10)
    model = transformers.ResNetForImageClassification(config).train()
    batch = {"pixel_values": torch.randn(4, 3, 64, 64), "labels": torch.randint(0, 10, (4,))}
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _, plain_grads = _measured(model, lambda: torch.compile(model, backend="aot_eager")(**batch).loss)
    plain_buffers = {k: v.clone() for k, v in model.named_buffers()}
    model.load_state_dict(start)
    torch._dynamo.reset()
    plan = torchckpt.plan(model, batch, budget="95%", loss_head=False)  # compiled: the head stays whole
    assert any(p.recomputes for p in plan.schedule if isinstance(p, PlannedBlock))
    with torchckpt.apply(model, plan):
        peak, grads = _measured(model, lambda: torch.compile(model, backend="aot_eager")(**batch).loss)
    assert _graph_breaks() == {}
    assert peak <= plan.budget_bytes
    assert _equal(grads, plain_grads)
    for name, value in model.named_buffers():  # two steps each: num_batches_tracked 2, as without the plan
        assert torch.equal(value, plain_buffers[name]), name


def test_a_checkpoint_under_inductor_matches_inductor_without_it() -> None:
    """The slow test below at a small size: one checkpointed function with a selective policy, inductor's
    kernels, gradients as inductor gives them without checkpointing."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x = torch.randn(4, 16)

    def f(v: torch.Tensor) -> torch.Tensor:
        return torch.sin(layer(torch.relu(layer(v)))).sum()

    torch.compile(f, backend="inductor")(x).backward()
    plain = layer.weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    torch.compile(lambda v: checkpoint(f, v, policy="dots_saveable"), backend="inductor")(x).backward()
    assert _graph_breaks() == {}
    torch.testing.assert_close(layer.weight.grad, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_plan_under_inductor_matches_inductor_without_it() -> None:
    """Inductor's kernels allocate outside the dispatcher, so the meter does not measure them: gradients only here;
    bench/compiled.py measures inductor's peak RSS."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    batch = model.example_batch(batch_size=4, seq_len=64)
    compiled = torch.compile(model, backend="inductor")
    compiled(*batch).backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plan = torchckpt.plan(model, batch, budget="80%", loss_head=False)  # compiled: the head stays whole
    with torchckpt.apply(model, plan):
        compiled(*batch).backward()
    assert _graph_breaks() == {}
    for p, expected in zip(model.parameters(), plain_grads):
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "names"])
def test_checkpoint_policies_compile_in_one_graph(policy: str) -> None:
    layer = nn.Linear(16, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = tag(torch.relu(layer(x)), "h")
        return torch.sin(layer(h)).sum()

    chosen = save_only_these_names("h") if policy == "names" else policy
    x = torch.randn(4, 16, requires_grad=True)
    torch.compile(lambda v: checkpoint(f, v, policy=chosen), backend="aot_eager", fullgraph=True)(x).backward()
    compiled_grad, x.grad = x.grad, None
    f(x).backward()
    assert torch.equal(compiled_grad, x.grad)


def test_a_policy_by_eager_position_is_refused_under_compile_naming_the_fix() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    run = torch.compile(lambda v: checkpoint(torch.nn.functional.gelu, v, policy=save_ops([0])), backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"save_ops\(indices, ops=\[") as error:
        run(x)
    assert "make the plan again" in str(error.value)


def test_plans_name_kept_ops_by_occurrence_and_round_trip_through_json(tmp_path: object) -> None:
    model, batch = _gpt()
    plan = torchckpt.plan(model, batch, budget="60%", loss_head=False)  # compiled: the head stays whole
    kept = [p for p in plan.schedule if isinstance(p, PlannedBlock) and p.keep]
    assert kept and all(len(p.keep_ops) == len(p.keep) for p in kept)
    named = [op for p in kept for op in p.keep_ops if op != "-"]
    assert named and all(op.rpartition("#")[0].startswith("aten.") and op.rpartition(":")[2].isdigit() for op in named)
    again = Plan.from_json(plan.to_json())
    assert again.schedule == plan.schedule
    entry = json.loads(plan.to_json())
    for piece in entry["schedule"]:
        piece.pop("keep_ops", None)  # a plan saved before keep_ops existed still loads, and runs eagerly
    old = Plan.from_json(json.dumps(entry))
    assert all(not p.keep_ops for p in old.schedule if isinstance(p, PlannedBlock))
    with pytest.raises(ValueError, match=r"one 'name#k:bytes' \(or '-'\) per index"):
        PlannedBlock(block=0, plain=False, keep=(1, 2), keep_ops=("aten.mm#0",))
    with pytest.raises(ValueError, match="written 'name#k' or 'name#k:bytes'"):
        PlannedBlock(block=0, plain=False, keep=(1,), keep_ops=("aten.mm",))


@pytest.mark.slow  # 16 s; docs commands in the slow tier
def test_the_docs_compile_example_runs_as_written() -> None:
    """docs/planner.md's "Under torch.compile" example, executed; its printed check must hold."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    section = text.split("## Under torch.compile", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    printed: list = []
    namespace: dict = {"print": lambda *values: printed.append(values)}
    exec(compile(block, "docs/planner.md", "exec"), namespace)  # noqa: S102 - our own docs
    assert printed == [(True,)]
    assert "forward" not in vars(namespace["model"].blocks[0])


@pytest.mark.slow  # its plan depends on measured op times, so it fails under load (a plan keeping only an addmm)
def test_a_plan_with_dropout_recomputes_the_ops_it_cannot_name_and_stays_exact() -> None:
    """Eager dropout is bernoulli_, div_ and mul; traced, one native_dropout: ops after it cannot be numbered, so
    they are written '-' and recomputed under compile, with a warning, instead of keeping whichever op lands on
    their number (HF GPT-2 kept its gating product for its dropout output)."""
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.1)
    batch = model.example_batch(batch_size=4, seq_len=64)
    plan = torchckpt.plan(model, batch, budget="80%", loss_head=False)  # compiled: the head stays whole
    kept = [op for p in plan.schedule if isinstance(p, PlannedBlock) for op in p.keep_ops]
    assert "-" in kept, plan.schedule
    torch.manual_seed(3)
    torch.compile(model, backend="aot_eager")(*batch).backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with torchckpt.apply(model, plan), pytest.warns(RuntimeWarning, match=r"recomputes \d+ op\(s\) the plan keeps"):
        torch.manual_seed(3)
        torch.compile(model, backend="aot_eager")(*batch).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return x + torch.bmm(h, h.transpose(1, 2)) @ x


def _held_after_forward(run: Callable[[], torch.Tensor]) -> int:
    with MemoryMeter(include_existing=False) as meter:
        out = run()
        held = meter.current_bytes - out.untyped_storage().nbytes()
    return held


def test_blocks_compiled_one_by_one_keep_their_own_policies() -> None:
    """Blocks of one class share code; a closure context_fn was guarded by its code only, so the second block
    reused the first block's graph (and kept no bmm). Held after the forward: more when block 1 keeps its bmm
    outputs than when both blocks keep only addmm."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block() for _ in range(2)])
    x = torch.randn(2, 4, 32, requires_grad=True)

    def held(first: str, second: str) -> int:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        handles = [checkpoint_modules([blocks[0]], policy=first), checkpoint_modules([blocks[1]], policy=second)]
        compiled = [torch.compile(block, backend="aot_eager") for block in blocks]
        compiled[1](compiled[0](x)).sum().backward()  # compiles
        found = _held_after_forward(lambda: compiled[1](compiled[0](x)))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == (1 if first == second else 2)
        for handle in handles:
            handle.remove()
        return found

    same = held("dots_with_no_batch_dims_saveable", "dots_with_no_batch_dims_saveable")
    different = held("dots_with_no_batch_dims_saveable", "dots_saveable")
    assert different > same


def test_a_higher_order_op_inside_a_compiled_region_is_recomputed() -> None:
    layer = nn.Linear(16, 16)

    @torch.compiler.nested_compile_region
    def inner(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(h))

    def f(v: torch.Tensor) -> torch.Tensor:
        return inner(inner(v)).sin().sum()

    x = torch.randn(8, 16, requires_grad=True)
    run = torch.compile(lambda v: checkpoint(f, v, policy="dots_saveable"), backend="aot_eager", fullgraph=True)
    run(x).backward()  # was: AttributeError: 'InvokeSubgraphHOP' object has no attribute '_schema'
    compiled_grad, x.grad = x.grad, None
    f(x).backward()
    torch.testing.assert_close(compiled_grad, x.grad)


def test_a_combination_with_positions_is_refused_under_compile() -> None:
    policy = save_from_both_policies(save_ops([0]), save_only_these_names("x"))
    run = torch.compile(lambda v: checkpoint(torch.nn.functional.gelu, v, policy=policy), backend="aot_eager")
    with pytest.raises(RuntimeError, match="or combined with one"):
        run(torch.randn(4, 4, requires_grad=True))


def test_the_meter_refuses_a_higher_order_op_whose_body_it_cannot_see() -> None:
    x = torch.randn(4)
    with pytest.raises(NotImplementedError, match="cannot measure inside the higher-order op 'cond'"):
        with MemoryMeter():
            torch.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))


def test_a_handle_dropped_without_remove_sets_the_side_effect_flag_back() -> None:
    before = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    handle = checkpoint_modules([nn.Linear(2, 2)])
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is True
    del handle
    gc.collect()
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == before


def test_a_chunked_loss_head_under_compile_runs_whole_without_a_graph_break() -> None:
    """Dynamo does not trace deferred logits: compiled, the head computes its logits whole, recorded on its
    handle, without breaking the graph (plans for compiled training are made with loss_head=False)."""
    from torchckpt.executor import CheckpointHandle, wrap_forward
    from torchckpt.executor.loss_head import ChunkedHeadHandle

    model, batch = _gpt()
    handle = ChunkedHeadHandle(head=model.head, chunk_tokens=16, warn=True)
    wrapped: list[nn.Module] = []
    wrap_forward(model.head, handle.forward, wrapped)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        compiled(*batch).backward()
    finally:
        CheckpointHandle(wrapped).remove()
    assert _graph_breaks() == {}
    assert handle.materialized == ["torch.compile"] and handle.chunked_losses == 0
