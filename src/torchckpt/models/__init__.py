"""Built-in models for demos, tests and benchmarks. Each has ``example_batch()``; ``model(*batch)`` is the loss."""

from torchckpt.models.gpt import GPT, GPT_SIZES, GPTConfig, gpt
from torchckpt.models.mlp import MLP, mlp
from torchckpt.models.registry import MODELS, BatchShape, ModelEntry, ModelSpecError, get_model, load_model, register
from torchckpt.models.unet import UNET_SIZES, UNet, UNetConfig, unet

__all__ = ["GPT", "GPTConfig", "GPT_SIZES", "gpt", "UNet", "UNetConfig", "UNET_SIZES", "unet", "MLP", "mlp",
           "block_modules", "MODELS", "BatchShape", "ModelEntry", "ModelSpecError", "get_model", "load_model",
           "register"]


def block_modules(model: GPT | UNet | MLP) -> list:
    """The repeated blocks of a built-in model, in forward order (what "checkpoint every block" wraps).

    Example:
        >>> len(block_modules(gpt("tiny")))
        2
    """
    if isinstance(model, (GPT, MLP)):
        return list(model.blocks)
    if isinstance(model, UNet):
        return model.torchckpt_blocks()
    raise TypeError(f"block_modules: expected a built-in model (GPT, UNet, MLP); got {type(model).__name__}")
