"""Blocks that may not run: LayerDrop turned off while a model is measured.

Rules:

1. **[every block runs while measuring]** LayerDrop (Fan et al. 2019; HF Wav2Vec2, HuBERT, WavLM, BART, Whisper
   and others: ``config.layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``, or a module attribute so named)
   skips each block of a training step with some probability. The profiler measures steps in which every block
   runs: the largest a step can be, so that a plan's peak holds whichever blocks a step skips. While profiling,
   every such attribute above 0 (on a module or its ``config``) is set to 0 and put back afterwards, however the
   profile ends. Plans for such a model have no regions: a region runs all its blocks from its first, so a
   skipped block would run and the draw that skips it would move (the profiler also refuses regions wherever a
   random number is drawn between blocks, probe.py's recorder).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["layerdrop_off"]


def _layerdrop_attributes(model: nn.Module) -> list[tuple[Any, str, float]]:
    """(owner, attribute, value) for every LayerDrop probability above 0 on ``model``'s modules and configs."""
    found: list[tuple[Any, str, float]] = []
    seen: set[int] = set()
    for module in model.modules():
        for owner in (module, getattr(module, "config", None)):
            if owner is None or id(owner) in seen:
                continue
            seen.add(id(owner))
            attributes = getattr(owner, "__dict__", None)  # a config may be a dict or have slots: not one of these
            for name, value in list((attributes or {}).items()):
                if "layerdrop" in name.lower() and isinstance(value, float) and 0 < value <= 1:  # a probability
                    found.append((owner, name, value))
    return found


@contextlib.contextmanager
def layerdrop_off(model: nn.Module) -> Iterator[str | None]:
    """Set every LayerDrop probability of ``model`` to 0 inside the block ([every block runs while measuring]);
    yields a note naming them (None when there are none).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> layer.layerdrop = 0.1
        >>> with layerdrop_off(layer) as note:
        ...     layer.layerdrop
        0.0
        >>> layer.layerdrop, note
        (0.1, 'blocks may be skipped at random (layerdrop=0.1): measured with every block run, single blocks only')
    """
    found = _layerdrop_attributes(model)
    for owner, name, _ in found:
        setattr(owner, name, 0.0)
    try:
        shown = ", ".join(sorted({f"{name}={value:g}" for _, name, value in found}))
        yield (f"blocks may be skipped at random ({shown}): measured with every block run, single blocks only"
               if found else None)
    finally:
        for owner, name, value in found:
            setattr(owner, name, value)
