"""Reading a step's safetensors file into one storage per tensor, hashed on the way.

Rules kept here (named in ``docs/design.md``):

1. **[each tensor reads into its own memory]** A restore reads a local ``.safetensors`` file tensor by
   tensor: the header first (checked by every rule of the format, format/codec.py), then each tensor's
   bytes straight into a fresh tensor of its own (``torch.empty``: aligned, never shared), in file
   order, every piece handed to the hash as it lands. So a restored tensor's storage is its own bytes
   and nothing else (``torch.save`` of one restored tensor writes that tensor), the bytes decoded are
   the bytes hashed (read/step.py's [decode the bytes that were hashed]), and a restore needs no memory
   beyond the restored tensors: tensors under 64 KiB are read many at a time through one reused
   1 MiB buffer and copied out, larger ones in 16 MiB pieces into their own memory. Ties and views come
   back sharing one storage from the tree (format/storages.py's [a storage is written once]).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch

from torchckpt._progress import add_bytes
from torchckpt.state.format.codec import SAFETENSORS_MAX_HEADER_BYTES, safetensors_entries
from torchckpt.state.storage.base import PIECE_BYTES
from torchckpt.state.storage.local_files import open_in_step

_SMALL_BYTES = 64 << 10  # tensors below this are read through the shared buffer
_BATCH_BYTES = 1 << 20  # the shared buffer

OnPieces = Callable[[list[memoryview]], Callable[[], object]]


def read_tensors(step_dir: str, name: str, size_bytes: int,
                 on_pieces: OnPieces | None) -> tuple[dict[str, torch.Tensor] | None, int]:
    """(tensors, bytes read) of the safetensors file ``name`` of a local step whose manifest says ``size_bytes``
    ([each tensor reads into its own memory]). ``on_pieces`` gets the file's bytes, in order, as lists of
    pieces, and returns a callable that waits until they are consumed. The bytes read are ``size_bytes + 1``
    if the file is longer, fewer if shorter (the tensors are then incomplete: the caller reports the size).
    Returns ``(None, 0)``, having handed nothing to ``on_pieces``, when the file's header is not a valid
    safetensors header: the caller reads it whole and names the problem.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.format.tensor_chunks import encode_safetensors
        >>> tmp = tempfile.TemporaryDirectory(); data = encode_safetensors({"w": torch.ones(3)})
        >>> _ = open(os.path.join(tmp.name, "m.safetensors"), "wb").write(data)
        >>> tensors, size = read_tensors(tmp.name, "m.safetensors", len(data), None)
        >>> tensors["w"], size == len(data), tensors["w"].untyped_storage().nbytes()
        (tensor([1., 1., 1.]), True, 12)
        >>> tmp.cleanup()
    """
    fd = open_in_step(step_dir, name)
    try:
        head = os.pread(fd, 8, 0)
        header_bytes = int.from_bytes(head, "little") if len(head) == 8 else -1
        if sys.byteorder != "little" or not 0 < header_bytes <= min(size_bytes - 8, SAFETENSORS_MAX_HEADER_BYTES):
            return None, 0
        header = os.pread(fd, header_bytes, 8)
        start = 8 + header_bytes
        try:
            entries = safetensors_entries(header, size_bytes - start) if header[:1] == b"{" else None
        except (ValueError, TypeError):
            entries = None
        if entries is None or len(header) != header_bytes:
            return None, 0
        waits = [] if on_pieces is None else [on_pieces([memoryview(head), memoryview(header)])]
        tensors = {key: torch.empty(shape, dtype=dtype) for key, dtype, shape, _, _ in entries}
        done = _read_data(fd, [(tensors[key], begin, end) for key, _, _, begin, end in entries], start,
                          on_pieces, waits)
        for wait in waits:
            wait()
        total = start + done
        if total == size_bytes and os.pread(fd, 1, total):
            total += 1
        return tensors, total
    finally:
        os.close(fd)


def _read_data(fd: int, spans: list[tuple[torch.Tensor, int, int]], start: int, on_pieces: OnPieces | None,
               waits: list[Callable[[], object]]) -> int:
    """Read every tensor's bytes (``spans``: tensor, begin, end after ``start``, in order); returns the data
    bytes read (fewer than the spans cover only at an early end of file)."""
    batch = torch.empty(_BATCH_BYTES, dtype=torch.uint8)
    batch_view, batch_address = batch.numpy().data, batch.data_ptr()
    done = 0
    index = 0
    while index < len(spans):
        tensor, begin, end = spans[index]
        if end - begin >= _SMALL_BYTES:
            memory = tensor.reshape(-1).view(torch.uint8).numpy().data
            for offset in range(0, end - begin, PIECE_BYTES):
                piece = memory[offset : offset + PIECE_BYTES]
                count = _pread_fully(fd, piece, start + begin + offset)
                done += count
                add_bytes(count)  # _progress.py's [reported per phase, never per op]
                if on_pieces is not None and count:
                    waits.append(on_pieces([piece[:count]]))
                if count < len(piece):
                    return done
            index += 1
            continue
        last = index  # a run of small tensors that fits the shared buffer
        while (last < len(spans) and spans[last][2] - spans[last][1] < _SMALL_BYTES
               and spans[last][2] - begin <= _BATCH_BYTES):
            last += 1
        run_bytes = spans[last - 1][2] - begin
        count = _pread_fully(fd, batch_view[:run_bytes], start + begin)
        done += count
        if on_pieces is not None and count:
            on_pieces([batch_view[:count]])()  # hashed before the buffer is reused
        if count < run_bytes:
            return done
        for tensor, small_begin, small_end in spans[index:last]:
            if small_end > small_begin:
                ctypes.memmove(tensor.data_ptr(), batch_address + small_begin - begin, small_end - small_begin)
        index = last
    return done


def _pread_fully(fd: int, into: memoryview, offset: int) -> int:
    """Fill ``into`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < len(into):
        count = os.preadv(fd, [into[done:]], offset + done)
        if not count:
            break
        done += count
    return done
