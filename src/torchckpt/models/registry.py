"""The one model registry: name -> how to build the model, its example batch and its blocks.

``torchckpt plan --model NAME``, ``torchckpt train --model``, the benchmark and the tests all build
models by name from here. Rules every entry keeps, so that every user of a name sees the same work (named in
``docs/design.md``):

1. **[build seeds itself]** ``build()`` seeds the global RNG itself, so every process that builds a
   model by name gets the same parameters and the same batch, bit for bit.
2. **[blocks in forward order]** ``blocks(model)`` returns every repeated layer in forward order: what
   "checkpoint every block" wraps (HF's ``gradient_checkpointing_enable()`` wraps the same layers) and
   what the planner is given.
3. **[models train with dropout on]** Models train with dropout on (``train()``), and HF models with
   ``use_cache=False``. HF entries import ``transformers`` only when built.

Add a model with ``register(ModelEntry(...))``; ``load_model`` also takes ``path/to/file.py:factory``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchckpt._optional import require
from torchckpt._units import check_positive_int
from torchckpt.models.gpt import gpt
from torchckpt.models.mlp import mlp
from torchckpt.models.unet import unet

__all__ = ["MODELS", "BatchShape", "ModelEntry", "ModelSpecError", "get_model", "load_model", "register"]

Inputs = tuple | dict


class ModelSpecError(ValueError):
    """A model name or ``path.py:factory`` cannot be built; the message names the spec and the fix."""


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    """The example batch an entry builds: ``batch_size`` samples of ``seq_len`` tokens or ``image_size`` pixels."""

    batch_size: int
    seq_len: int = 256
    image_size: int = 64

    def __post_init__(self) -> None:
        for option in ("batch_size", "seq_len", "image_size"):
            check_positive_int(f"BatchShape.{option}", getattr(self, option))


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One named model: ``make(shape)`` returns ``(model, inputs)``; ``blocks(model)`` its layers in order."""

    name: str
    description: str
    make: Callable[[BatchShape], tuple[nn.Module, Inputs]]
    shape: BatchShape
    blocks: Callable[[nn.Module], list[nn.Module]]
    family: str  # "gpt" for the built-in GPTs (the benchmark's >= 1.15x target applies to them), else the kind

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"ModelEntry.name must be a non-empty word; got {self.name!r}")

    def build(self, seed: int = 0, shape: BatchShape | None = None) -> tuple[nn.Module, Inputs]:
        """Build the model (train mode) and its batch from ``seed`` ([build seeds itself]), at ``shape``
        or the entry's own.

        Example:
            >>> model, batch = get_model("gpt-tiny").build()
            >>> len(get_model("gpt-tiny").blocks(model)), tuple(batch[0].shape)
            (2, (2, 64))
        """
        torch.manual_seed(seed)
        model, inputs = self.make(shape or self.shape)
        return model.train(), inputs


MODELS: dict[str, ModelEntry] = {}


def register(entry: ModelEntry) -> ModelEntry:
    """Add ``entry`` to the registry; a second entry with the same name is an error.

    Example:
        >>> "gpt-small" in MODELS
        True
    """
    if entry.name in MODELS:
        raise ValueError(f"model {entry.name!r} is already registered")
    MODELS[entry.name] = entry
    return entry


def get_model(name: str) -> ModelEntry:
    """The registered model called ``name``; the error lists the names there are.

    Example:
        >>> get_model("unet-tiny").family
        'unet'
    """
    if name not in MODELS:
        raise ModelSpecError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]


def load_model(spec: str, shape: BatchShape | None = None, seed: int | None = None) -> tuple[nn.Module, Inputs]:
    """Build a registered model (``gpt-small``, ``hf-llama``, ...) or ``path/to/file.py:factory`` and its inputs.

    A factory returns a model with ``example_batch(batch_size=..., seq_len=...)`` or a tuple
    ``(model, example_inputs)``. With ``seed`` given the global RNG is seeded first (registered models
    always seed, [build seeds itself]). Raises :class:`ModelSpecError` naming the problem.

    Example:
        >>> model, batch = load_model("gpt-tiny", BatchShape(batch_size=2, seq_len=8))
        >>> batch[0].shape
        torch.Size([2, 8])
    """
    if spec in MODELS:
        return MODELS[spec].build(seed or 0, shape)
    if ":" not in spec:
        raise ModelSpecError(f"--model {spec}: unknown; use one of {', '.join(MODELS)} or path/to/file.py:factory")
    if seed is not None:
        torch.manual_seed(seed)
    model = _call_factory(spec)
    if isinstance(model, tuple):
        return model[0], model[1]
    return model, _example_batch(spec, model, shape or BatchShape(batch_size=8))


def _call_factory(spec: str) -> Any:
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ModelSpecError(f"--model {spec}: file {path} not found; give path/to/file.py:factory")
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"--model {spec}: {path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelSpecError(f"--model {spec}: {path} has no callable {name!r}")
    return factory()


def _example_batch(spec: str, model: Any, shape: BatchShape) -> Inputs:
    if not hasattr(model, "example_batch"):
        raise ModelSpecError(f"--model {spec}: the model has no example_batch(); return (model, example_inputs) "
                             "from the factory instead")
    names = model.example_batch.__code__.co_varnames
    if "seq_len" in names:
        return model.example_batch(batch_size=shape.batch_size, seq_len=shape.seq_len)
    if "image_size" in names:
        return model.example_batch(batch_size=shape.batch_size, image_size=shape.image_size)
    return model.example_batch(batch_size=shape.batch_size)


# --------------------------------------------------------------------------------------------- built-in
def _built_in(factory: Callable[[], nn.Module]) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        model = factory()
        return model, _example_batch("built-in", model, shape)
    return make


def _own_blocks(model: nn.Module) -> list[nn.Module]:
    """The built-in models' blocks: ``torchckpt_blocks()`` where a model names them, else ``model.blocks``."""
    named = getattr(model, "torchckpt_blocks", None)
    return list(named()) if callable(named) else list(model.blocks)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------- HF
def _token_batch(vocab: int, shape: BatchShape, seq_len: int | None = None) -> torch.Tensor:
    return torch.randint(0, vocab, (shape.batch_size, seq_len or shape.seq_len),
                         generator=torch.Generator().manual_seed(0))


def _llama(width: int, layers: int, vocab: int = 1024) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        transformers = require("transformers", "the hf-* models")

        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3,
                                          num_hidden_layers=layers, num_attention_heads=max(2, width // 32),
                                          num_key_value_heads=max(1, width // 64), max_position_embeddings=1024,
                                          attention_dropout=0.0)
        ids = _token_batch(vocab, shape)
        return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False}
    return make


def _gpt2(width: int, layers: int, vocab: int = 1024) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        transformers = require("transformers", "the hf-* models")

        config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=max(2, width // 32),
                                         n_positions=1024, bos_token_id=0, eos_token_id=0)
        ids = _token_batch(vocab, shape)
        return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids, "use_cache": False}
    return make


def _t5(width: int, layers: int) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        transformers = require("transformers", "the hf-* models")

        config = transformers.T5Config(vocab_size=1024, d_model=width, d_kv=32, d_ff=4 * width, num_layers=layers,
                                       num_heads=max(2, width // 32), pad_token_id=0, eos_token_id=1)
        # Not a T5Config field (its typed __init__ lacks it); the model shifts labels right with it.
        config.decoder_start_token_id = 0
        ids = _token_batch(1024, shape)
        labels = _token_batch(1024, shape, max(1, shape.seq_len // 2))
        return (transformers.T5ForConditionalGeneration(config),
                {"input_ids": ids, "labels": labels, "use_cache": False})
    return make


def _labelled_images(shape: BatchShape) -> dict[str, torch.Tensor]:
    """A batch of random RGB images and labels of 10 classes (an HF image classifier's inputs)."""
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(shape.batch_size, 3, shape.image_size, shape.image_size, generator=generator)
    labels = torch.randint(0, 10, (shape.batch_size,), generator=generator)
    return {"pixel_values": pixels, "labels": labels}


def _vit(width: int, layers: int) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        transformers = require("transformers", "the hf-* models")

        config = transformers.ViTConfig(hidden_size=width, num_hidden_layers=layers,
                                        num_attention_heads=max(2, width // 64), intermediate_size=4 * width,
                                        image_size=shape.image_size, patch_size=16)
        config.num_labels = 10
        return transformers.ViTForImageClassification(config), _labelled_images(shape)
    return make


def _resnet(hidden: list[int], depths: list[int]) -> Callable[[BatchShape], tuple[nn.Module, Inputs]]:
    def make(shape: BatchShape) -> tuple[nn.Module, Inputs]:
        transformers = require("transformers", "the hf-* models")

        config = transformers.ResNetConfig(num_channels=3, embedding_size=hidden[0], hidden_sizes=hidden,
                                           depths=depths, layer_type="bottleneck")
        config.num_labels = 10
        return transformers.ResNetForImageClassification(config), _labelled_images(shape)
    return make


def _resnet_blocks(model: nn.Module) -> list[nn.Module]:
    return [layer for stage in model.resnet.encoder.stages for layer in stage.layers]  # type: ignore[union-attr]


def _vit_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.vit.layers)  # type: ignore[union-attr, arg-type]


def _llama_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)  # type: ignore[union-attr, arg-type]


def _gpt2_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.transformer.h)  # type: ignore[union-attr, arg-type]


def _t5_blocks(model: nn.Module) -> list[nn.Module]:
    return [*model.encoder.block, *model.decoder.block]  # type: ignore[union-attr, misc]


def _entry(name: str, kind: str, layout: str, make: Callable[[BatchShape], tuple[nn.Module, Inputs]],
           shape: BatchShape, blocks: Callable[[nn.Module], list[nn.Module]], family: str) -> ModelEntry:
    batch = (f"{shape.batch_size} x {shape.image_size} x {shape.image_size}" if family in ("unet", "hf-vit",
                                                                                           "hf-resnet") else
             f"{shape.batch_size} x {shape.seq_len}" + (f" -> {shape.seq_len // 2}" if family == "hf-t5" else ""))
    return ModelEntry(name=name, description=f"{kind} {layout}, batch {batch}", make=make, shape=shape,
                      blocks=blocks, family=family)


def _tokens(batch_size: int, seq_len: int) -> BatchShape:
    return BatchShape(batch_size=batch_size, seq_len=seq_len)


def _images(batch_size: int, image_size: int) -> BatchShape:
    return BatchShape(batch_size=batch_size, image_size=image_size)


for _model in (
    # The benchmark's full suite. Sizes are chosen so that the whole suite fits ~30 minutes on a shared
    # 2-core CPU (bench/README.md); the "larger GPT" is gpt('small') at 2x the tokens.
    _entry("gpt-small", "gpt('small')", "12 x 384", _built_in(lambda: gpt("small")), _tokens(2, 256), _own_blocks,
           "gpt"),
    _entry("gpt-small-long", "gpt('small')", "12 x 384", _built_in(lambda: gpt("small")), _tokens(2, 512),
           _own_blocks, "gpt"),
    _entry("gpt-medium", "gpt('medium')", "24 x 512", _built_in(lambda: gpt("medium")), _tokens(2, 512),
           _own_blocks, "gpt"),
    _entry("unet-small", "unet('small')", "3 levels x 2 blocks, 32 ch", _built_in(lambda: unet("small")),
           _images(2, 64), _own_blocks, "unet"),
    _entry("hf-llama", "HF Llama", "8 x 256", _llama(256, 8), _tokens(2, 256), _llama_blocks, "hf-llama"),
    _entry("hf-gpt2", "HF GPT-2", "8 x 256", _gpt2(256, 8), _tokens(2, 256), _gpt2_blocks, "hf-gpt2"),
    _entry("hf-t5", "HF T5", "6+6 x 256", _t5(256, 6), _tokens(2, 256), _t5_blocks, "hf-t5"),
    # The regime where activations dominate (tracker: the speed claim where it matters; bench/README.md's
    # REGIME_MODELS): batch 8 for decoders, 32 images of 224 px for ViT.
    _entry("gpt-small-8x512", "gpt('small')", "12 x 384", _built_in(lambda: gpt("small")), _tokens(8, 512),
           _own_blocks, "gpt"),
    _entry("hf-llama-8x256", "HF Llama", "8 x 256", _llama(256, 8), _tokens(8, 256), _llama_blocks, "hf-llama"),
    _entry("hf-gpt2-8x256", "HF GPT-2", "8 x 256", _gpt2(256, 8), _tokens(8, 256), _gpt2_blocks, "hf-gpt2"),
    _entry("hf-vit-224", "HF ViT", "12 x 192", _vit(192, 12), _images(32, 224), _vit_blocks, "hf-vit"),
    _entry("unet-small-b8", "unet('small')", "3 levels x 2 blocks, 32 ch", _built_in(lambda: unet("small")),
           _images(8, 64), _own_blocks, "unet"),
    # A second CNN for the floor benchmark (bench/README.md, "Below every block"): bottleneck residual blocks in four
    # stages after a strided stem, BatchNorm in training.
    _entry("hf-resnet-b32", "HF ResNet (bottleneck)", "4 stages x 2 blocks, 64-512 ch", _resnet([64, 128, 256, 512],
           [2, 2, 2, 2]), _images(32, 128), _resnet_blocks, "hf-resnet"),
    # Decoders with real vocabularies (Llama 2's 32,000; GPT-2's 50,257), where the loss head dominates once the
    # blocks are checkpointed: the loss head's benchmark (bench/README.md, "Below every block").
    _entry("hf-llama-32k-4x512", "HF Llama, vocab 32,000", "8 x 256", _llama(256, 8, 32000), _tokens(4, 512),
           _llama_blocks, "hf-llama"),
    _entry("hf-gpt2-50k-4x512", "HF GPT-2, vocab 50,257", "8 x 256", _gpt2(256, 8, 50257), _tokens(4, 512),
           _gpt2_blocks, "hf-gpt2"),
    # Tiny models (the benchmark's --quick, tests), seconds each.
    _entry("gpt-tiny", "gpt('tiny')", "2 x 64", _built_in(lambda: gpt("tiny")), _tokens(2, 64), _own_blocks, "gpt"),
    _entry("hf-llama-tiny", "HF Llama", "4 x 64", _llama(64, 4), _tokens(2, 64), _llama_blocks, "hf-llama"),
    _entry("unet-tiny", "unet('tiny')", "2 levels x 1 block, 8 ch", _built_in(lambda: unet("tiny")),
           _images(2, 16), _own_blocks, "unet"),
    _entry("hf-t5-tiny", "HF T5", "2+2 x 64", _t5(64, 2), _tokens(2, 32), _t5_blocks, "hf-t5"),
    # Built-in sizes the benchmark does not use, for `torchckpt plan --model`.
    _entry("gpt-mini", "gpt('mini')", "6 x 128", _built_in(lambda: gpt("mini")), _tokens(8, 256), _own_blocks, "gpt"),
    _entry("unet-medium", "unet('medium')", "4 levels x 2 blocks, 64 ch", _built_in(lambda: unet("medium")),
           _images(8, 64), _own_blocks, "unet"),
    _entry("mlp", "mlp()", "residual MLP", _built_in(lambda: mlp()), BatchShape(batch_size=8), _own_blocks, "mlp"),
):
    register(_model)
