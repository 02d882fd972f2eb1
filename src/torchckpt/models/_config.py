"""Shared checks and lookups for the built-in models' config dataclasses."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from torchckpt._units import check_positive_int

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Config = TypeVar("Config", bound="DataclassInstance")


def check_config(config: Any, positive_ints: tuple[str, ...]) -> None:
    """Raise naming the field when a size is not a positive int (``check_positive_int``) or dropout is outside [0, 1).

    Example:
        >>> from torchckpt.models import GPTConfig
        >>> check_config(GPTConfig(), ("n_layer",))
    """
    owner = type(config).__name__
    for option in positive_ints:
        check_positive_int(f"{owner}.{option}", getattr(config, option))
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"{owner}.dropout must be in [0, 1); got {config.dropout!r}")


def sized_config(kind: str, sizes: dict[str, Config], size: str, overrides: dict[str, object]) -> Config:
    """The named size's config with ``overrides`` applied; errors list the sizes or name the config fields.

    Example:
        >>> from torchckpt.models import GPT_SIZES
        >>> sized_config("gpt", GPT_SIZES, "tiny", {"n_layer": 3}).n_layer
        3
    """
    if size not in sizes:
        raise ValueError(f"{kind}(size={size!r}): unknown size; choose one of {', '.join(sizes)}")
    try:
        return replace(sizes[size], **overrides)
    except TypeError as error:
        fields = type(sizes[size]).__name__
        raise TypeError(f"{kind}(size={size!r}, ...): {error}; valid overrides are the fields of {fields}") from None
