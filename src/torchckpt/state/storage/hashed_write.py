"""Writing one file of a step while a second thread hashes it (checkpointer/checkpointer.py's [hash while writing])."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from torchckpt._progress import add_bytes, counting_bytes
from torchckpt.state.format.hashing import new_hasher
from torchckpt.state.format.manifest import FileEntry
from torchckpt.state.format.snapshot import FileChunks
from torchckpt.state.storage.base import StepWriter, split_pieces


def write_hashed(
    writer: StepWriter, name: str, chunks: FileChunks, algorithm: str, hash_thread: ThreadPoolExecutor
) -> FileEntry:
    """Write one file and hash it on the way (checkpointer/checkpointer.py's [hash while writing]): each piece is queued
    for hashing on ``hash_thread``, then written; returns its manifest entry.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); writer = open_storage(tmp.name).begin_step(1)
        >>> with ThreadPoolExecutor(max_workers=1) as pool:
        ...     write_hashed(writer, "a.bin", [b"abc"], "sha256", pool).size_bytes
        3
        >>> writer.abort(); tmp.cleanup()
    """
    hasher = new_hasher(algorithm)
    updates: list[Future[None]] = []

    def hashed_pieces() -> Iterator[memoryview]:
        for piece in split_pieces(chunks):
            updates.append(hash_thread.submit(hasher.update, piece))  # one worker: pieces hash in order
            yield piece
            add_bytes(piece.nbytes)  # _progress.py's [reported per phase, never per op]

    size_bytes = writer.write(name, hashed_pieces(), sum(memoryview(chunk).nbytes for chunk in chunks))
    for update in updates:
        update.result()
    return FileEntry(size_bytes=size_bytes, hash=hasher.hexdigest())


def hash_thread() -> ThreadPoolExecutor:
    """The one thread that hashes a save's pieces while they are written (use it as a context manager).

    Example:
        >>> with hash_thread() as pool:
        ...     pool.submit(sum, [1, 2]).result()
        3
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchckpt-hash")


def write_files_hashed(writer: StepWriter, files: Mapping[str, FileChunks], algorithm: str,
                       what: str = "writing a step") -> dict[str, FileEntry]:
    """Write every file of ``files`` in order, each hashed on the way; returns their manifest entries. The bytes
    written are reported as ``what`` (``torchckpt._progress``; nothing is shown unless an application listens).

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory(); writer = open_storage(tmp.name).begin_step(1)
        >>> sorted(write_files_hashed(writer, {"a.json": [b"{}"], "b.json": [b"[]"]}, "crc32"))
        ['a.json', 'b.json']
        >>> writer.abort(); tmp.cleanup()
    """
    total = sum(memoryview(chunk).nbytes for chunks in files.values() for chunk in chunks)
    entries: dict[str, FileEntry] = {}
    with hash_thread() as pool, counting_bytes(what, total) as reached:
        for name, chunks in files.items():
            entries[name] = write_hashed(writer, name, chunks, algorithm, pool)
            reached(sum(entry.size_bytes for entry in entries.values()))
    return entries
