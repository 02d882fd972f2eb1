"""HF models with their default config (use_cache=True) plan, checkpoint and apply: the cache is turned
off while torchckpt checkpoints, with a one-line notice, and put back on removal."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import torchckpt


def _llama() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    assert config.use_cache is True  # the default, as a user gets it
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _grads(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_checkpoint_modules_on_a_default_config(caplog: pytest.LogCaptureFixture) -> None:
    model, batch = _llama()
    model.config.use_cache = False
    reference = _grads(model, batch)
    model.config.use_cache = True
    with caplog.at_level(logging.WARNING, logger="torchckpt"):
        handle = torchckpt.checkpoint_modules(model.model.layers, policy="nothing_saveable")
    assert model.config.use_cache is False
    assert [r.getMessage() for r in caplog.records if "use_cache=False on LlamaConfig" in r.getMessage()]
    grads = _grads(model, batch)  # raised "control flow that depends on global state" before
    handle.remove()
    assert model.config.use_cache is True
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_plan_apply_verify_on_a_default_config() -> None:
    model, batch = _llama()
    plan = torchckpt.plan(model, batch, budget="100%")  # tiny model: its floor is near the plain peak
    assert model.config.use_cache is True  # profiling put it back
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and report.gradients_equal
    with torchckpt.apply(model, plan):
        # Off while any plan is applied, even one that recomputes nothing: profiling measured every step,
        # the plain one too, with the cache off, and a default GPT-2 step's peak differs with it on.
        assert model.config.use_cache is False
        model(**batch).loss.backward()
    assert model.config.use_cache is True
