"""Training-state checkpoints: atomic, verified, pickle-free, bit-exact resume.

Public names are re-exported here; the modules behind them are private. The subpackages, each one idea,
from the bottom up; a subpackage imports only errors.py and the ones listed before it, never one after it:

- ``process/``: the process a Checkpointer lives in: the writer's lock file, exit and fork hooks, preemption
  signals and the safe points where a preemption saves.
- ``live/``: the live side: items and RNG streams captured and applied back, tensors copied to host memory.
- ``format/``: what a step is on disk: names, hashing, the manifest, the pickle-free codec, a step's files.
- ``storage/``: where the bytes live: the local and fsspec back ends, safe local reads, hashed writes.
- ``read/``: reading steps back: one step read and verified, the steps of a directory, the newest valid
  one, a decoded step loaded into live objects.
- ``sharded/``: sharded checkpoints on DCP: the ranks, the shard storage layer, the save, the restore.
- ``checkpointer/``: the Checkpointer (config, retention, branches, its unsharded save) and interchange
  with other formats.
"""

from torchckpt.state.checkpointer.checkpointer import Checkpointer
from torchckpt.state.checkpointer.config import CheckpointerConfig
from torchckpt.state.checkpointer.dcp_interchange import export_dcp, import_dcp
from torchckpt.state.checkpointer.interchange import export_model_weights, import_torch_save
from torchckpt.state.checkpointer.retention import RetentionPolicy
from torchckpt.state.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFallbackWarning,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointNewerFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeFileError,
    UnsupportedStateError,
)
from torchckpt.state.read.catalog import CheckpointInfo, list_checkpoints, verify_checkpoint
from torchckpt.state.read.load import load
from torchckpt.state.sharded.rank_group import RankLostError
from torchckpt.state.sharded.rank_local import ElasticResumeWarning

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFallbackWarning",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNewerFormatError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CheckpointerConfig",
    "ElasticResumeWarning",
    "RankLostError",
    "RetentionPolicy",
    "UnsafeFileError",
    "UnsupportedStateError",
    "export_dcp",
    "export_model_weights",
    "import_dcp",
    "import_torch_save",
    "list_checkpoints",
    "load",
    "verify_checkpoint",
]
