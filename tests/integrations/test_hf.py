"""torchckpt.integrations.hf on HF Llama, GPT-2, BERT (masked LM) and T5 from small configs: gradients
bitwise equal to the model without checkpointing (dropout on), measured peak within the budget with
AdamW state alive, frozen parameters, save_pretrained unchanged, and a short transformers.Trainer run."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import MODELS, freeze

import torchckpt
from torchckpt.integrations import hf
from torchckpt.memory import MemoryMeter

BUDGET = "70%"


def _step_grads(model: torch.nn.Module, batch: dict, seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    grads = {name: p.grad.detach().view(-1).view(torch.uint8).numpy().copy()
             for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# With every weight matrix frozen ("lora") a frozen linear layer saves its weight but not its input: BERT's
# post-norm blocks then keep nothing of their input, and T5's decoder blocks keep neither the encoder output
# nor the position biases they read, all of which a checkpoint does hold. The profiler measures both
# (BlockCosts.input_held_when_plain, BlockCosts.freed_side_input_bytes), so every case's peak is strict.
CASES = [pytest.param(name, frozen, id=f"{name}-{frozen}")
         for name in ("llama", "gpt2", "bert", "t5") for frozen in ("none", "embeddings", "lora")]


@pytest.mark.parametrize(("name", "frozen"), CASES)
def test_gradients_bitwise_and_peak_within_budget(name: str, frozen: str) -> None:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    freeze(model, frozen)
    model.config.use_cache = True
    reference = _step_grads(model, {**batch, "use_cache": False}, seed=1)
    assert reference and len(reference) == sum(p.requires_grad for p in model.parameters())
    params_before = {k: v.detach().clone() for k, v in model.state_dict().items()}

    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "use_cache")}
    use_cache_before = {key: config.use_cache for key, config in configs.items()}
    handle = hf.enable(model, budget=BUDGET, example_inputs=batch)
    assert all(c.use_cache is False for c in configs.values())  # T5's decoder stack has its own config
    assert hf.is_enabled(model)
    assert all(torch.equal(params_before[k], v) for k, v in model.state_dict().items())  # planning undid its steps
    # AdamW state as in training (lr=0: the parameters do not move), then the measured step.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0)
    model(**batch).loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    gc.collect()  # garbage of earlier tests must not be freed (or counted) inside the measured step
    torch.manual_seed(1)
    with MemoryMeter() as meter:
        loss = model(**batch).loss
        loss.backward()
        del loss
    grads = {n: p.grad.detach().view(-1).view(torch.uint8).numpy().copy()
             for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == reference.keys()
    different = [n for n in grads if not np.array_equal(grads[n], reference[n])]
    assert not different, f"gradients differ from the uncheckpointed model: {different[:5]}"
    assert meter.peak_bytes <= handle.plan.budget_bytes, (meter.peak_bytes, handle.plan.table())
    assert handle.plan.predicted_extra_time_s > 0  # the budget needs recomputation: the plan did something
    hf.disable(model)
    assert {key: config.use_cache for key, config in configs.items()} == use_cache_before
    assert model.config.use_cache is True and not hf.is_enabled(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_save_pretrained_writes_the_same_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model, batch = MODELS["llama"]()
    model.save_pretrained(tmp_path / "plain")
    hf.enable(model, budget=BUDGET, example_inputs=batch)
    model.save_pretrained(tmp_path / "enabled")
    hf.disable(model)
    plain, enabled = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "enabled"))
    assert list(plain) == list(enabled)
    assert all(torch.equal(plain[k], enabled[k]) for k in plain)


def test_refusals_name_the_fix() -> None:
    model, batch = MODELS["gpt2"]()
    new_names = hasattr(model, "activation_checkpointing_enable")  # transformers >= 5 renamed these
    getattr(model, "activation_checkpointing_enable" if new_names else "gradient_checkpointing_enable")()
    with pytest.raises(ValueError, match=r"gradient_checkpointing_disable\(\)"):
        hf.enable(model, budget=BUDGET, example_inputs=batch)
    # torchckpt.plan itself too (its plain step would be HF's checkpointed one, the floor equal to it)
    with pytest.raises(ValueError, match=r"own gradient checkpointing on .*gradient_checkpointing_disable\(\)"):
        torchckpt.plan(model, batch, budget=BUDGET)
    getattr(model, "activation_checkpointing_disable" if new_names else "gradient_checkpointing_disable")()
    hf.enable(model, budget="100%", example_inputs=batch)
    with pytest.raises(ValueError, match=r"call hf.disable\(model\) first"):
        hf.enable(model, budget=BUDGET, example_inputs=batch)
    hf.disable(model)
    with pytest.raises(ValueError, match="smallest feasible peak"):
        hf.enable(model, budget=1000, example_inputs=batch)
    assert model.config.use_cache is True and not hf.is_enabled(model)  # a failed enable leaves no trace
    with pytest.raises(TypeError, match="example_inputs must be a dict"):
        hf.enable(model, budget=BUDGET, example_inputs="text")


def _trainer_losses(tmp_path: Path, enable: bool) -> list[float]:
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")
    import transformers

    torch.manual_seed(0)
    model, _ = MODELS["gpt2"]()
    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(3))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                                          logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    if enable:  # the three lines of docs/hf.md, as written there (they end with trainer.train())
        text = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
        section = text.split("## With `transformers.Trainer`", 1)[1]
        block = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)[0]
        assert block.strip().endswith("trainer.train()")
        exec(compile(block, "docs/hf.md", "exec"), {"trainer": trainer})  # noqa: S102 - our own docs
        assert hf.is_enabled(model)
        hf.disable(model)
    else:
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_runs_and_its_losses_equal_training_without_the_plan(tmp_path: Path) -> None:
    plain = _trainer_losses(tmp_path / "plain", enable=False)
    planned = _trainer_losses(tmp_path / "planned", enable=True)
    assert len(plain) == 4
    assert planned == plain
