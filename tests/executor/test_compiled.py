"""torch.compile'd models are refused with an error naming torch.compile and the fix (Note: [compiled models are
refused]); before, ``plan(torch.compile(model))`` said the model "already runs under a torchckpt plan", and a plan
compiled after it was applied graph-broke silently and had no memory effect."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchckpt
from torchckpt.executor.compiled import is_compiled_module, refuse_compiled
from torchckpt.models import gpt


def _model() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = gpt("tiny", dropout=0.0)
    return model, model.example_batch(batch_size=2, seq_len=16)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("call", ["plan", "profile", "checkpoint_modules", "verify", "apply"])
def test_a_compiled_model_is_refused_naming_torch_compile(call: str) -> None:
    model, batch = _model()
    plan = torchckpt.plan(model, batch, budget="100%") if call in ("verify", "apply") else None
    before = _state(model)
    compiled = torch.compile(model)  # compiles lazily: nothing runs until it is called
    assert is_compiled_module(compiled) and not is_compiled_module(model)
    with pytest.raises(TypeError) as error:
        if call == "plan":
            torchckpt.plan(compiled, batch, budget="60%")
        elif call == "profile":
            torchckpt.planner.profile(compiled, batch)
        elif call == "checkpoint_modules":
            torchckpt.checkpoint_modules([compiled])
        elif call == "verify":
            torchckpt.verify_plan(compiled, plan, batch)
        else:
            torchckpt.apply(compiled, plan)
    message = str(error.value)
    assert "torch.compile" in message and "_orig_mod" in message
    assert "already runs under a torchckpt plan" not in message  # the old, wrong diagnosis
    assert all(torch.equal(before[k], v) for k, v in _state(model).items())  # refused before anything ran
    assert "forward" not in vars(model.blocks[0])  # nothing was wrapped


def test_a_compiled_submodule_is_refused_with_its_path() -> None:
    model, _ = _model()
    model.blocks[1] = torch.compile(model.blocks[1])
    with pytest.raises(TypeError, match=r"submodule 'blocks\.1' is a torch\.compile'd module"):
        refuse_compiled([model], "torchckpt.plan")


@pytest.mark.slow
def test_compiling_after_a_plan_is_applied_is_refused_not_silently_eager() -> None:
    """Dynamo would trace into the checkpoint, graph-break and run without the plan's memory effect; the error
    comes through the graph break (it is raised by a torch.compiler.disable'd function)."""
    model, batch = _model()
    handle = torchckpt.checkpoint_modules(model.blocks)
    compiled = torch.compile(model, backend="eager")
    try:
        with pytest.raises(RuntimeError, match=r"torch\.compile is tracing a model that runs under a torchckpt plan"):
            compiled(*batch)
    finally:
        handle.remove()
        torch._dynamo.reset()
    loss = model(*batch)  # eager, without the plan, the model still works
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
