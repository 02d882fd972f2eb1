"""The training text: the Python standard library's own source files, as bytes.

Files are ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), sorted by
relative path. A file goes to validation when the first byte of the SHA-256 of its relative path is
below 13 (about 5% of files), so the split is deterministic and does not depend on file contents or
order. The text is kept as a NumPy array, not a tensor: it is not part of the training step, and
``MemoryMeter`` counts tensors only.
"""

from __future__ import annotations

import hashlib
import sysconfig
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ByteChunks", "Corpus", "load_stdlib_corpus", "make_loader"]

VALIDATION_HASH_BELOW = 13  # of 256: ~5% of files


class Corpus:
    """Train and validation bytes with the file counts they came from."""

    def __init__(self, root: Path, train: np.ndarray, validation: np.ndarray, train_files: int,
                 validation_files: int) -> None:
        self.root = root
        self.train = train
        self.validation = validation
        self.train_files = train_files
        self.validation_files = validation_files

    def describe(self) -> str:
        """One line: where the text comes from and how much of it there is.

        Example:
            >>> load_stdlib_corpus().describe().startswith("Python standard library")
            True
        """
        return (f"Python standard library ({self.root}): {self.train_files} files / {len(self.train) / 1e6:.1f} MB "
                f"for training, {self.validation_files} files / {len(self.validation) / 1e6:.1f} MB for validation")


def _is_validation(relative: str) -> bool:
    return hashlib.sha256(relative.encode()).digest()[0] < VALIDATION_HASH_BELOW


def load_stdlib_corpus(root: str | Path | None = None) -> Corpus:
    """Read every stdlib ``*.py`` file (sorted) and split train/validation by path hash.

    Example:
        >>> corpus = load_stdlib_corpus()
        >>> corpus.train.dtype, len(corpus.validation) > 0
        (dtype('uint8'), True)
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"the standard library directory {base} does not exist; this Python installation "
                                "has no stdlib sources to train on")
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in sorted(base.rglob("*.py")):
        relative = path.relative_to(base)
        if {"site-packages", "dist-packages"} & set(relative.parts) or not path.is_file():
            continue
        parts[_is_validation(relative.as_posix())].append(path.read_bytes())
    if not parts[False] or not parts[True]:
        raise FileNotFoundError(f"found too few *.py files under {base} to train and validate on "
                                f"({len(parts[False])} train, {len(parts[True])} validation)")
    return Corpus(base, np.frombuffer(b"".join(parts[False]), dtype=np.uint8),
                  np.frombuffer(b"".join(parts[True]), dtype=np.uint8), len(parts[False]), len(parts[True]))


class ByteChunks(Dataset):
    """Non-overlapping chunks of ``seq_len + 1`` bytes: item ``i`` is ``(ids, next-byte targets)``.

    Example:
        >>> data = np.frombuffer(b"hello world!", dtype=np.uint8)
        >>> ids, targets = ByteChunks(data, seq_len=5)[1]
        >>> bytes(ids.tolist()), bytes(targets.tolist())
        (b' worl', b'world')
    """

    def __init__(self, data: np.ndarray, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"the text has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        chunk = torch.from_numpy(self.data[start:start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def batch(self, indices: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The items at ``indices`` stacked into a batch (no shuffling, no RNG).

        Example:
            >>> data = np.frombuffer(b"abcdefghij", dtype=np.uint8)
            >>> ByteChunks(data, seq_len=3).batch(range(2))[0].shape
            torch.Size([2, 3])
        """
        items = [self[i] for i in indices]
        return torch.stack([ids for ids, _ in items]), torch.stack([targets for _, targets in items])


def make_loader(dataset: ByteChunks, batch_size: int, seed: int, rank: int = 0, world: int = 1):
    """A StatefulDataLoader that shuffles with its own seeded generator (epoch after epoch, resumable).

    With ``world`` > 1 (``torchckpt train`` under torchrun), rank ``rank`` gets its own share of each
    epoch (torchdata's ``StatefulDistributedSampler``, seeded with ``seed``: the ranks' shares are disjoint);
    the caller calls ``loader.sampler.set_epoch(n)`` before epoch ``n``.

    Example:
        >>> data = np.frombuffer(bytes(range(200)), dtype=np.uint8)
        >>> loader = make_loader(ByteChunks(data, seq_len=9), batch_size=4, seed=0)
        >>> next(iter(loader))[0].shape
        torch.Size([4, 9])
    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler
    except ImportError:
        raise ImportError("torchckpt train needs torchdata for a resumable data loader: "
                          "pip install 'torchckpt[train]' (or pip install torchdata)") from None
    if len(dataset) < batch_size:
        raise ValueError(f"--batch-size {batch_size} is more than the {len(dataset)} sequences in the training text; "
                         "use a smaller --batch-size or --seq-len")
    if len(dataset) < batch_size * world:
        raise ValueError(f"--batch-size {batch_size} on each of {world} processes needs {batch_size * world} "
                         f"sequences; the training text holds {len(dataset)}; use a smaller --batch-size or --seq-len")
    sampler: Any
    if world > 1:
        sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                             drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in recent torch
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
