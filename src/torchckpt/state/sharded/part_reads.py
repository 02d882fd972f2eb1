"""A part of a saved chunk read straight into the restore's target tensor, then verified.

Rules kept here (named in ``docs/design.md``):

1. **[a part is read into its target]** When the part of a chunk a rank needs is one run of bytes in the
   chunk and its target is a contiguous CPU tensor of the saved dtype (a whole chunk into a slice of a new
   tensor, as a restore onto fewer ranks reads), the file's bytes are read (one ``preadv``) into the target's
   own memory, with the bytes of the first and last blocks outside the part read into two small buffers; then
   every block is hashed from those pieces and checked (shard_storage.py's [every byte read is verified]),
   on the hash thread while the next part is read. The target is one of the restore's fresh copies
   (restore.py's [restore loads into copies]) and DCP is told a part is loaded only once every check passed,
   so a block that fails its hash raises before anything live changes. The restore then neither fills a
   buffer with zeros first nor copies the bytes a second time. Any other part goes the general way (read,
   verify, copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from torchckpt.state.format.hashing import new_hasher
from torchckpt.state.storage.hashed_write import hash_thread

__all__ = ["IntoReader", "load_parts", "read_part_into", "readable_into"]

# (file name, byte offset, buffers) -> the bytes read into the buffers, in order (fewer only at the file's end)
IntoReader = Callable[[str, int, Sequence[memoryview]], int]


def readable_into(target: torch.Tensor, dtype: torch.dtype, count: int, first: int, last: int) -> bool:
    """Whether a part of ``count`` elements spanning elements ``first``..``last`` of its chunk can be read
    straight into ``target`` ([a part is read into its target]).

    Example:
        >>> target = torch.empty(4)
        >>> readable_into(target, torch.float32, 4, 8, 11), readable_into(target, torch.float32, 4, 8, 13)
        (True, False)
    """
    return (count > 0 and last - first + 1 == count and target.numel() == count and target.dtype == dtype
            and target.device.type == "cpu" and target.is_contiguous())


def read_part_into(read_into: IntoReader, file: str, chunk_at: int, chunk_bytes: int, blocks: Sequence[str],
                   algorithm: str, block_bytes: int, part: tuple[int, int], target: torch.Tensor,
                   corrupt: Callable[[str], None]) -> tuple[int, Callable[[], None]]:
    """Read bytes ``part`` = (start, end) of a chunk stored at ``chunk_at`` in ``file`` into ``target``; returns
    the bytes read from the file and the check of the hashes of the blocks covering them (``corrupt(problem)``
    raises), to run before the target is used.

    Example:
        >>> from torchckpt.state.format.hashing import hash_bytes
        >>> data = bytes(range(30))
        >>> def reader(file, at, views):
        ...     done = 0
        ...     for view in views:
        ...         view[:] = data[at + done:at + done + len(view)]
        ...         done += len(view)
        ...     return done
        >>> blocks = [hash_bytes(data[i:i + 8], "crc32") for i in range(0, 30, 8)]
        >>> target = torch.empty(6, dtype=torch.uint8)
        >>> count, check = read_part_into(reader, "f", 0, 30, blocks, "crc32", 8, (5, 11), target, print)
        >>> count, target.tolist(), check()
        (16, [5, 6, 7, 8, 9, 10], None)
        >>> blocks[1] = "0"; read_part_into(reader, "f", 0, 30, blocks, "crc32", 8, (5, 11), target, print)[1]()
        block 1: hash mismatch
    """
    start, end = part
    begin = start // block_bytes * block_bytes
    stop = min(-(-end // block_bytes) * block_bytes, chunk_bytes)
    body = target.reshape(-1).view(torch.uint8).numpy().data
    head, tail = memoryview(bytearray(start - begin)), memoryview(bytearray(stop - end))
    got = read_into(file, chunk_at + begin, [head, body, tail])
    if got != stop - begin:
        corrupt(f"{got} of {stop - begin} bytes could be read")
    pieces = ((begin, head), (start, body), (end, tail))  # each piece's position in the chunk

    def check() -> None:
        for number in range(begin // block_bytes, -(-stop // block_bytes)):
            low, high = number * block_bytes, min((number + 1) * block_bytes, chunk_bytes)
            hasher = new_hasher(algorithm)
            for at, view in pieces:
                a, b = max(low, at), min(high, at + len(view))
                if a < b:
                    hasher.update(view[a - at:b - at])
            if hasher.hexdigest() != blocks[number]:
                corrupt(f"block {number}: hash mismatch")

    return stop - begin, check


def load_parts(items: Iterable[Any], planner: Any,
               read_straight: Callable[[Any, torch.Tensor], Callable[[], None] | None],
               read_general: Callable[[Any], torch.Tensor]) -> None:
    """Load each of DCP's read ``items`` into the tensor ``planner`` resolves for it: straight into it where
    ``read_straight`` can (its block checks run on the hash thread while the next part is read), else
    ``read_general``'s verified part copied in; DCP is told (``commit_tensor``) only once every check passed.

    Example:
        >>> class Planner:
        ...     targets = {"a": torch.zeros(2), "b": torch.zeros(2)}
        ...     def resolve_tensor(self, item): return self.targets[item]
        ...     def commit_tensor(self, item, tensor): print("committed", item, tensor.tolist())
        >>> def straight(item, target):
        ...     if item == "b":
        ...         return None
        ...     target.fill_(1)
        ...     return lambda: None
        >>> load_parts(["a", "b"], Planner(), straight, lambda item: torch.full((2,), 2.0))
        committed a [1.0, 1.0]
        committed b [2.0, 2.0]
    """
    loaded = []
    with hash_thread() as pool:
        checks = []
        for item in items:
            target = planner.resolve_tensor(item).detach()
            check = read_straight(item, target)
            if check is None:
                target.copy_(read_general(item))
            else:
                checks.append(pool.submit(check))
            loaded.append((item, target))
        for done in checks:
            done.result()
    for item, target in loaded:
        planner.commit_tensor(item, target)
