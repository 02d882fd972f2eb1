"""The benchmark's models: a registry of name -> how to build the model, its batch and its blocks.

Rules every entry keeps (so that every method sees exactly the same work):

1. ``build()`` seeds the global RNG itself, so every process that builds a model by name gets the same
   parameters and the same batch, bit for bit.
2. ``blocks(model)`` returns every repeated layer in forward order: what "checkpoint every block" wraps
   (HF's ``gradient_checkpointing_enable()`` wraps the same layers) and what the planner is given.
3. Models train with dropout on (``train()``), and HF models with ``use_cache=False``.

Add a model with ``register(BenchModel(...))`` from a module that ``torchckpt.bench.models`` imports
(the worker processes rebuild models by name), or add an entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchckpt.models import block_modules, gpt, unet

__all__ = ["FULL_MODELS", "MODELS", "QUICK_MODELS", "BenchModel", "get_model", "register"]

Inputs = tuple | dict


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """One benchmark model: ``build()`` returns ``(model, inputs)``; ``blocks(model)`` its layers in order."""

    name: str
    description: str
    build_fn: Callable[[], tuple[nn.Module, Inputs]]
    blocks: Callable[[nn.Module], list[nn.Module]]
    family: str  # "gpt" for the built-in GPTs (the >= 1.15x target applies to them), else the model kind

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"BenchModel.name must be a non-empty word; got {self.name!r}")

    def build(self, seed: int = 0) -> tuple[nn.Module, Inputs]:
        """Build the model (train mode) and its batch from ``seed`` (rule 1).

        Example:
            >>> model, batch = get_model("gpt-tiny").build()
            >>> len(get_model("gpt-tiny").blocks(model))
            2
        """
        torch.manual_seed(seed)
        model, inputs = self.build_fn()
        return model.train(), inputs


MODELS: dict[str, BenchModel] = {}


def register(entry: BenchModel) -> BenchModel:
    """Add ``entry`` to the registry; a second entry with the same name is an error.

    Example:
        >>> "gpt-small" in MODELS
        True
    """
    if entry.name in MODELS:
        raise ValueError(f"benchmark model {entry.name!r} is already registered")
    MODELS[entry.name] = entry
    return entry


def get_model(name: str) -> BenchModel:
    """The registered model called ``name``; the error lists the names there are.

    Example:
        >>> get_model("unet-tiny").family
        'unet'
    """
    if name not in MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


# --------------------------------------------------------------------------------------------- built-in
def _gpt(size: str, batch_size: int, seq_len: int) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        model = gpt(size)
        return model, model.example_batch(batch_size=batch_size, seq_len=seq_len)
    return build


def _unet(size: str, batch_size: int, image_size: int) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        model = unet(size)
        return model, model.example_batch(batch_size=batch_size, image_size=image_size)
    return build


# --------------------------------------------------------------------------------------------- HF
def _token_batch(vocab: int, batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))


def _llama(width: int, layers: int, batch_size: int, seq_len: int) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        import transformers

        config = transformers.LlamaConfig(vocab_size=1024, hidden_size=width, intermediate_size=width * 8 // 3,
                                          num_hidden_layers=layers, num_attention_heads=max(2, width // 32),
                                          num_key_value_heads=max(1, width // 64), max_position_embeddings=1024,
                                          attention_dropout=0.0)
        ids = _token_batch(1024, batch_size, seq_len)
        return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False}
    return build


def _gpt2(width: int, layers: int, batch_size: int, seq_len: int) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        import transformers

        config = transformers.GPT2Config(vocab_size=1024, n_embd=width, n_layer=layers, n_head=max(2, width // 32),
                                         n_positions=1024, bos_token_id=0, eos_token_id=0)
        ids = _token_batch(1024, batch_size, seq_len)
        return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids, "use_cache": False}
    return build


def _t5(width: int, layers: int, batch_size: int, seq_len: int) -> Callable[[], tuple[nn.Module, Inputs]]:
    def build() -> tuple[nn.Module, Inputs]:
        import transformers

        config = transformers.T5Config(vocab_size=1024, d_model=width, d_kv=32, d_ff=4 * width, num_layers=layers,
                                       num_heads=max(2, width // 32), decoder_start_token_id=0, pad_token_id=0,
                                       eos_token_id=1)
        ids = _token_batch(1024, batch_size, seq_len)
        labels = _token_batch(1024, batch_size, max(1, seq_len // 2))
        return (transformers.T5ForConditionalGeneration(config),
                {"input_ids": ids, "labels": labels, "use_cache": False})
    return build


def _gpt_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)


def _llama_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


def _gpt2_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h)


def _t5_blocks(model: nn.Module) -> list[nn.Module]:
    return [*model.encoder.block, *model.decoder.block]


def _describe(kind: str, shape: str, batch: str) -> str:
    return f"{kind} {shape}, batch {batch}"


for _entry in (
    # Full suite. Sizes are chosen so that the whole suite fits ~30 minutes on a shared 2-core CPU
    # (bench/README.md); the "larger GPT" is gpt('small') at 2x the tokens, where activations matter more.
    BenchModel(name="gpt-small", description=_describe("gpt('small')", "12 x 384", "2 x 256"),
               build_fn=_gpt("small", 2, 256), blocks=_gpt_blocks, family="gpt"),
    BenchModel(name="gpt-small-long", description=_describe("gpt('small')", "12 x 384", "2 x 512"),
               build_fn=_gpt("small", 2, 512), blocks=_gpt_blocks, family="gpt"),
    BenchModel(name="gpt-medium", description=_describe("gpt('medium')", "24 x 512", "2 x 512"),
               build_fn=_gpt("medium", 2, 512), blocks=_gpt_blocks, family="gpt"),
    BenchModel(name="unet-small", description=_describe("unet('small')", "3 levels x 2 blocks, 32 ch", "2 x 64 x 64"),
               build_fn=_unet("small", 2, 64), blocks=block_modules, family="unet"),
    BenchModel(name="hf-llama", description=_describe("HF Llama", "8 x 256", "2 x 256"),
               build_fn=_llama(256, 8, 2, 256), blocks=_llama_blocks, family="hf-llama"),
    BenchModel(name="hf-gpt2", description=_describe("HF GPT-2", "8 x 256", "2 x 256"),
               build_fn=_gpt2(256, 8, 2, 256), blocks=_gpt2_blocks, family="hf-gpt2"),
    BenchModel(name="hf-t5", description=_describe("HF T5", "6+6 x 256", "2 x 256 -> 128"),
               build_fn=_t5(256, 6, 2, 256), blocks=_t5_blocks, family="hf-t5"),
    # --quick: tiny models, seconds each.
    BenchModel(name="gpt-tiny", description=_describe("gpt('tiny')", "2 x 64", "2 x 64"),
               build_fn=_gpt("tiny", 2, 64), blocks=_gpt_blocks, family="gpt"),
    BenchModel(name="hf-llama-tiny", description=_describe("HF Llama", "4 x 64", "2 x 64"),
               build_fn=_llama(64, 4, 2, 64), blocks=_llama_blocks, family="hf-llama"),
    BenchModel(name="unet-tiny", description=_describe("unet('tiny')", "2 levels x 1 block, 8 ch", "2 x 16 x 16"),
               build_fn=_unet("tiny", 2, 16), blocks=block_modules, family="unet"),
    BenchModel(name="hf-t5-tiny", description=_describe("HF T5", "2+2 x 64", "2 x 32 -> 16"),
               build_fn=_t5(64, 2, 2, 32), blocks=_t5_blocks, family="hf-t5"),
):
    register(_entry)

FULL_MODELS: tuple[str, ...] = ("gpt-small", "unet-small", "hf-llama", "hf-gpt2", "hf-t5", "gpt-small-long")
QUICK_MODELS: tuple[str, ...] = ("gpt-tiny", "hf-llama-tiny")


def count_parameters(model: nn.Module) -> int:
    """Distinct parameter elements (tied weights once).

    Example:
        >>> count_parameters(nn.Linear(2, 3))
        9
    """
    return sum(p.numel() for p in model.parameters())


def uses_transformers(names: Any) -> bool:
    """Whether any of the named models needs ``transformers`` (the harness preloads it once).

    Example:
        >>> uses_transformers(["gpt-tiny"]), uses_transformers(["hf-t5-tiny"])
        (False, True)
    """
    return any(name.startswith("hf-") for name in names)
