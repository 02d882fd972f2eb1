"""``torchckpt train``: train a model on real text under a memory budget, resumable bit-exactly.

Public: :class:`TrainConfig`, :func:`train`, :func:`read_losses`, :func:`load_stdlib_corpus`,
:func:`plan_without_side_effects`.
"""

from torchckpt.train.config import TrainConfig
from torchckpt.train.data import load_stdlib_corpus
from torchckpt.train.planning import plan_without_side_effects
from torchckpt.train.run import TrainError, read_losses, train

__all__ = ["TrainConfig", "TrainError", "load_stdlib_corpus", "plan_without_side_effects", "read_losses", "train"]
