"""Training-state checkpoints: atomic, verified, pickle-free, bit-exact resume.

Public names are re-exported here; the modules behind them are private.
"""

from torchckpt.state.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
from torchckpt.state.checkpointer import Checkpointer, CheckpointerConfig
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFallbackWarning,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeFileError,
    UnsupportedStateError,
)
from torchckpt.state.interchange import export_model_weights, import_torch_save
from torchckpt.state.rank_group import RankLostError
from torchckpt.state.rank_local import ElasticResumeWarning
from torchckpt.state.reader import load
from torchckpt.state.retention import RetentionPolicy

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CheckpointerConfig",
    "ElasticResumeWarning",
    "RankLostError",
    "RetentionPolicy",
    "UnsafeFileError",
    "UnsupportedStateError",
    "export_model_weights",
    "import_torch_save",
    "list_checkpoints",
    "load",
    "verify_checkpoint",
]
