"""Models nobody here wrote (transformers, diffusers, peft) and two plain-torch shapes, from tiny configs
with random weights (no downloads), each with one training batch.

Every builder returns a ``Case``: the model (in train mode), its example inputs, the loss function (None:
torchckpt's default), the blocks to plan by hand today, and the block paths ``blocks="auto"`` should find.
The library imports happen inside the builders, so this module imports without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCH, SEQ, VOCAB, IMAGE = 4, 32, 128, 32


@dataclass
class Case:
    model: nn.Module
    inputs: tuple | dict
    blocks: list[nn.Module]
    auto_paths: list[str]  # what blocks="auto" should find, in forward order
    loss_fn: Callable[[Any], torch.Tensor] | None = None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=_gen(seed))


def _pixels(seed: int = 0, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size, generator=_gen(seed))


def _labels(classes: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH,), generator=_gen(seed))


def _paths(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in blocks]


def _decoder(model: nn.Module) -> Case:
    ids = _ids()
    layers = list(model.model.layers)
    return Case(model.train(), {"input_ids": ids, "labels": ids}, layers, _paths(model, layers))


# Decoders: everything default but the sizes (use_cache stays True, as a user gets it).
def llama() -> Case:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, max_position_embeddings=2 * SEQ)
    assert config.use_cache is True
    return _decoder(transformers.LlamaForCausalLM(config))


def mistral() -> Case:
    import transformers

    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    return _decoder(transformers.MistralForCausalLM(config))


def qwen2() -> Case:
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    return _decoder(transformers.Qwen2ForCausalLM(config))


def gpt2() -> Case:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=2 * SEQ,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = transformers.GPT2LMHeadModel(config)  # dropout 0.1 everywhere (the default)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    ids = _ids()
    layers = list(model.transformer.h)
    return Case(model.train(), {"input_ids": ids, "labels": ids}, layers, _paths(model, layers))


def roberta() -> Case:
    import transformers

    config = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=SEQ + 4)
    model = transformers.RobertaForMaskedLM(config)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=_gen(0))  # 0-2: <s>, <pad>, </s>
    masked = torch.rand(ids.shape, generator=_gen(1)) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = {"input_ids": torch.where(masked, torch.full_like(ids, 4), ids), "attention_mask": torch.ones_like(ids),
              "labels": labels}
    layers = list(model.roberta.encoder.layer)
    return Case(model.train(), inputs, layers, _paths(model, layers))


# Vision models (HF versions).
def vit() -> Case:
    import transformers

    config = transformers.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=128, num_labels=10,
                                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = transformers.ViTForImageClassification(config)
    layers = list(model.vit.layers)
    return Case(model.train(), {"pixel_values": _pixels(), "labels": _labels(10)}, layers, _paths(model, layers))


def convnext() -> Case:
    import transformers

    config = transformers.ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[16, 32, 64], depths=[2, 2, 2],
                                         num_stages=3, num_labels=10, drop_path_rate=0.1, image_size=IMAGE)
    model = transformers.ConvNextForImageClassification(config)
    # By hand: every ConvNextLayer, stage by stage (each stage's downsampling runs between them).
    layers = [layer for stage in model.convnext.encoder.stages for layer in stage.layers]
    inputs = {"pixel_values": _pixels(size=2 * IMAGE), "labels": _labels(10)}
    return Case(model.train(), inputs, layers, _paths(model, layers))


def resnet() -> Case:
    import transformers

    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[2, 2, 2],
                                       layer_type="basic", num_labels=10, downsample_in_first_stage=False)
    model = transformers.ResNetForImageClassification(config)  # BatchNorm: running statistics are buffers
    layers = [layer for stage in model.resnet.encoder.stages for layer in stage.layers]
    inputs = {"pixel_values": _pixels(size=2 * IMAGE), "labels": _labels(10)}
    return Case(model.train(), inputs, layers, _paths(model, layers))


def unet() -> Case:
    import diffusers

    model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32),
                                  layers_per_block=1, down_block_types=("DownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=8)
    sample = torch.randn(BATCH, 3, 16, 16, generator=_gen(0))
    timestep = torch.tensor([10, 500, 250, 999])[:BATCH]
    blocks = [*model.down_blocks, model.mid_block, *model.up_blocks]
    return Case(model.train(), {"sample": sample, "timestep": timestep}, blocks, _paths(model, blocks),
                loss_fn=lambda out: out.sample.pow(2).mean())


def lora_llama() -> Case:
    import peft
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, max_position_embeddings=2 * SEQ)
    base = transformers.LlamaForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                      target_modules=["q_proj", "v_proj"]))
    ids = _ids()
    layers = list(base.model.layers)
    return Case(model.train(), {"input_ids": ids, "labels": ids}, layers, _paths(model, layers))


# Plain torch.
def sequential_mlp() -> Case:
    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(nn.Linear(16, width), *(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4)),
                          nn.Linear(width, 1))
    x = torch.randn(64, 16, generator=_gen(0))
    blocks = list(model[1:5])
    return Case(model.train(), (x,), blocks, ["1", "2", "3", "4"], loss_fn=lambda out: out.pow(2).mean())


class _DictBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class DictNet(nn.Module):
    """``forward(batch)`` with ``batch = {"x": features, "y": targets}``; returns the loss."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.layers = nn.ModuleList(_DictBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.embed(batch["x"])
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.mse_loss(self.head(h).squeeze(-1), batch["y"])


def dict_input() -> Case:
    torch.manual_seed(0)
    model = DictNet()
    batch = {"x": torch.randn(64, 16, generator=_gen(0)), "y": torch.randn(64, generator=_gen(1))}
    blocks = list(model.layers)
    return Case(model.train(), (batch,), blocks, _paths(model, blocks))


BUILDERS: dict[str, Callable[[], Case]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "gpt2": gpt2, "roberta": roberta, "vit": vit,
    "convnext": convnext, "resnet": resnet, "unet": unet, "lora_llama": lora_llama, "sequential_mlp": sequential_mlp,
    "dict_input": dict_input,
}
NEEDS = {"unet": "diffusers", "lora_llama": "peft", "sequential_mlp": None, "dict_input": None}  # else transformers


def case_for(name: str) -> Case:
    """The family ``name`` built (seeded), or the test skipped when the library it needs is not installed."""
    import importlib.util

    import pytest

    package = NEEDS.get(name, "transformers")
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name} needs {package}")
    torch.manual_seed(0)
    return BUILDERS[name]()
