"""``torchckpt train``: train a model on real text under a memory budget, resumable bit-exactly.

Public: :class:`TrainConfig`, :func:`train`, :func:`read_losses`, :func:`load_stdlib_corpus`.
"""

from torchckpt.train.config import TrainConfig
from torchckpt.train.data import load_stdlib_corpus
from torchckpt.train.records import read_losses
from torchckpt.train.run import TrainError, train

__all__ = ["TrainConfig", "TrainError", "load_stdlib_corpus", "read_losses", "train"]
