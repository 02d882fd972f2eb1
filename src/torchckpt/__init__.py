"""torchckpt: activation checkpointing under an absolute memory budget, and crash-proof training state."""

from torchckpt._version import __version__

__all__ = ["__version__"]
