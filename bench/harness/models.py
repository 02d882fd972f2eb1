"""The benchmark's suites: which models of the registry (``torchckpt.models.registry``) each run uses.

Models are built by name from the one registry, in every worker process alike
(registry.py's [build seeds itself]).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from torchckpt.models.registry import MODELS, ModelEntry, get_model

__all__ = ["FULL_MODELS", "MODELS", "QUICK_MODELS", "REGIME_MODELS", "ModelEntry", "count_parameters", "get_model",
           "uses_transformers"]

FULL_MODELS: tuple[str, ...] = ("gpt-small", "unet-small", "hf-llama", "hf-gpt2", "hf-t5", "gpt-small-long")
QUICK_MODELS: tuple[str, ...] = ("gpt-tiny", "hf-llama-tiny")
# Activations >= 3x parameters + gradients + optimizer state (the regime users are in): ``python bench/run.py
# --models`` with these (bench/README.md).
REGIME_MODELS: tuple[str, ...] = ("hf-llama-8x256", "hf-gpt2-8x256", "unet-small-b8", "hf-vit-224", "gpt-small-8x512")


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
