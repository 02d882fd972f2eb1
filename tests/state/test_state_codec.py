"""The pickle-free codec round-trips state exactly and refuses what it cannot store."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import safetensors.torch
import torch
from state_workers import bitwise_equal

from torchckpt.state.errors import CheckpointCorruptError, UnsafeFileError, UnsupportedStateError
from torchckpt.state.format.codec import (
    decode_json,
    decode_safetensors,
    encode_json,
    join_tensors,
    split_tensors,
)
from torchckpt.state.format.tensor_chunks import encode_safetensors, safetensors_chunks

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]


def _round_trip(tree):
    encoded, tensors = split_tensors(tree, "item")
    data = encode_safetensors(tensors)
    text = encode_json(encoded)
    return join_tensors(decode_json(text, "x.json"), decode_safetensors(data, "x.safetensors"), "x.json")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_round_trip_bitwise(dtype):
    if dtype.is_floating_point:
        source = (torch.randn(3, 5) * 100).to(dtype)
    else:
        source = torch.randint(0, 200, (3, 5), dtype=torch.int64).to(dtype)
    tree = {"t": source, "scalar": source[0, 0].clone(), "empty": source[:0], "strided": source.t()}
    back = _round_trip(tree)
    assert bitwise_equal(back["t"], source)
    assert bitwise_equal(back["strided"], source.t().contiguous())
    assert back["empty"].shape == (0, 5) and back["scalar"].shape == ()


def test_python_values_round_trip_with_types():
    tree = {
        "floats": [0.1, -0.0, 1e-310, float("inf"), 2.0**70],
        "big_int": 2**80,
        "tuple": (0.9, 0.999),
        "int_keys": {0: {"step": 3}, 7: None},
        "nested": [{"a": (1, [2, (3,)])}],
        "np_array": np.arange(5, dtype=np.uint32),
        "np_scalar": np.float32(1.5),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "__torchckpt__": "a user key that looks like ours",
    }
    back = _round_trip(tree)
    assert back["floats"][:4] == tree["floats"][:4] and str(back["floats"][1]) == "-0.0"
    assert back["big_int"] == 2**80 and back["tuple"] == (0.9, 0.999) and type(back["tuple"]) is tuple
    assert back["int_keys"] == {0: {"step": 3}, 7: None}
    assert back["nested"] == [{"a": (1, [2, (3,)])}]
    assert back["np_array"].dtype == np.uint32 and (back["np_array"] == tree["np_array"]).all()
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == np.float32(1.5)
    assert back["dtype"] is torch.bfloat16 and back["size"] == torch.Size([2, 3])
    assert back["__torchckpt__"] == tree["__torchckpt__"]


def test_tied_tensors_are_stored_separately_and_keys_follow_paths():
    weight = torch.randn(4, 4)
    _, tensors = split_tensors({"enc.weight": weight, "dec.weight": weight}, "model")
    assert sorted(tensors) == ["dec.weight", "enc.weight"]
    assert bitwise_equal(decode_safetensors(encode_safetensors(tensors), "m")["dec.weight"], weight)


def test_unsupported_value_names_its_path():
    with pytest.raises(UnsupportedStateError, match=r"item 'item': value at state\.0\.fn has type function"):
        split_tensors({"state": {0: {"fn": lambda: None}}}, "item")


def test_pickle_bytes_are_refused_before_parsing():
    payload = pickle.dumps({"a": 1})
    with pytest.raises(UnsafeFileError, match="x.safetensors: expected a torchckpt file, found a Python pickle"):
        decode_safetensors(payload, "x.safetensors")
    with pytest.raises(UnsafeFileError, match="found a Python pickle"):
        decode_json(payload, "x.json")


def test_safetensors_whose_header_length_looks_like_pickle_magic_still_loads():
    # Header length 0x280 starts with bytes 80 02, which is also pickle protocol 2's magic.
    for length in range(1, 2000):
        tensors = {"k" * length: torch.ones(1)}
        data = encode_safetensors(tensors)
        if data[:2] == b"\x80\x02":
            assert bitwise_equal(decode_safetensors(data, "m")["k" * length], torch.ones(1))
            return
    pytest.fail("no header length with the pickle-like prefix was produced")


def test_garbage_safetensors_is_corrupt_not_a_crash():
    with pytest.raises(CheckpointCorruptError, match="m.safetensors: not a safetensors file"):
        decode_safetensors(b"\x00" * 20, "m.safetensors")
    data = encode_safetensors({"w": torch.ones(100)})
    with pytest.raises(CheckpointCorruptError, match=r"m.safetensors: not a valid safetensors file \(tensors cover"):
        decode_safetensors(data[:-10], "m.safetensors")


def test_writer_output_matches_the_reference_library_and_format_rules():
    tensors = {"b": torch.arange(3, dtype=torch.int8), "a": torch.randn(2, 2, dtype=torch.float64), "e": torch.ones(0)}
    ours = bytes(encode_safetensors(tensors))
    header_bytes = int.from_bytes(ours[:8], "little")
    assert header_bytes % 8 == 0 and ours[8:9] == b"{"
    reference = safetensors.torch.load(safetensors.torch.save(tensors))
    assert all(bitwise_equal(safetensors.torch.load(ours)[k], reference[k]) for k in tensors)


def test_complex_tensors_are_refused_with_a_fix():
    with pytest.raises(UnsupportedStateError, match="dtype torch.complex64.*view_as_real"):
        split_tensors({"z": torch.zeros(2, dtype=torch.complex64)}, "item")


def _file(entries: dict, data: bytes) -> bytes:
    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + data


MALFORMED = {
    "gap": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
    "overlap": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
    "size_mismatch": ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
    "trailing_bytes": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12)),
    "unknown_dtype": ({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "negative_dim": ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b""),
    "bad_offsets": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, bytes(1)),
    "metadata_not_strings": ({"__metadata__": {"k": 1}, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
                             bytes(1)),
    "entry_not_object": ({"a": [1, 2]}, b""),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_parser_refuses_what_the_reference_library_refuses(case):
    data = _file(*MALFORMED[case])
    with pytest.raises(Exception):  # noqa: B017 (the reference raises its own SafetensorError)
        safetensors.torch.load(data)
    with pytest.raises(CheckpointCorruptError, match="x.safetensors: not a valid safetensors file"):
        decode_safetensors(data, "x.safetensors")


def test_parser_accepts_what_the_reference_writes_including_metadata_and_unaligned_offsets():
    tensors = {"i8": torch.arange(3, dtype=torch.int8), "f": torch.randn(2, 3), "b": torch.tensor([True, False])}
    reference = safetensors.torch.save(tensors, metadata={"format": "pt"})
    assert all(bitwise_equal(decode_safetensors(reference, "r")[k], v) for k, v in tensors.items())
    # a file another tool might write: a float32 tensor at data byte 1 (valid, but not aligned)
    unaligned = _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                       "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}},
                      b"\x07" + torch.tensor([1.5, -2.0]).numpy().tobytes())
    ours, theirs = decode_safetensors(unaligned, "u"), safetensors.torch.load(unaligned)
    assert bitwise_equal(ours["f"], theirs["f"]) and bitwise_equal(ours["a"], theirs["a"])


def test_chunks_view_tensor_memory_and_decoded_tensors_view_the_buffer():
    weight = torch.randn(1024, 256)  # 1 MiB: decoded as a view (smaller tensors are copied)
    chunks = safetensors_chunks({"w": weight, "n": torch.arange(5)})
    assert len(chunks) == 3 and any(
        np.shares_memory(np.asarray(chunk), weight.numpy()) for chunk in chunks if isinstance(chunk, memoryview)
    )
    buffer = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    decoded = decode_safetensors(memoryview(buffer.numpy()), "m.safetensors")
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert start <= decoded["w"].data_ptr() < end  # a view, not a copy
    assert not start <= decoded["n"].data_ptr() < end  # small: copied
    assert bitwise_equal(decoded["w"], weight) and bitwise_equal(decoded["n"], torch.arange(5))
