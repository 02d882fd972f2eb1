"""[storage resizes are seen]: ``UntypedStorage.resize_`` (how FSDP2 frees and refills its all-gathered
parameters) changes the meter's figures at once, and the wrapper is gone when no meter is active."""

from __future__ import annotations

import torch

from torchckpt import MemoryMeter


def test_a_freed_and_refilled_storage_counts_when_it_changes() -> None:
    original = torch.UntypedStorage.resize_
    with MemoryMeter() as meter:
        assert torch.UntypedStorage.resize_ is not original
        tensor = torch.empty(1024)  # 4096 bytes
        storage = tensor.untyped_storage()
        assert meter.current_bytes == 4096
        storage.resize_(0)  # freed, as FSDP2 frees an unsharded parameter after a block's forward
        assert meter.current_bytes == 0
        storage.resize_(8192)  # refilled larger (all-gathered again for the backward)
        assert meter.current_bytes == 8192
        assert meter.peak_bytes == 8192
        storage.resize_(0)
        assert meter.current_bytes == 0
    assert torch.UntypedStorage.resize_ is original  # no meter active: torch's own method again
    assert meter.peak_bytes == 8192


def test_nested_meters_both_see_a_resize() -> None:
    with MemoryMeter() as outer:
        tensor = torch.empty(256)
        with MemoryMeter() as inner:
            tensor.untyped_storage().resize_(0)
            assert inner.current_bytes == outer.current_bytes == 0
            tensor.untyped_storage().resize_(2048)
            assert outer.current_bytes == 2048
        assert outer.peak_bytes == 2048
