"""Sharded checkpoints on torch.distributed.checkpoint: the ranks (rank_group.py), DCP's storage layer
(shard_storage.py), which items are sharded (items.py), the save and its vote (save.py), a committed
sharded step opened for reading (step.py), rank-local state (rank_local.py) and the restore on any world
size (restore.py).

May import: ``state.errors``, ``state.process``, ``state.live``, ``state.format``, ``state.storage``,
``state.read``.
"""
