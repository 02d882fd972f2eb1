"""[storage resizes are seen]: ``UntypedStorage.resize_`` (how FSDP2 frees and refills its all-gathered
parameters) changes the meter's figures at once, and the wrapper is gone when no meter is active."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from torchckpt import MemoryMeter
from torchckpt._testing import free_port


def test_a_freed_and_refilled_storage_counts_when_it_changes() -> None:
    original = torch.UntypedStorage.resize_
    with MemoryMeter() as meter:  # figures relative to what lived at entry (earlier tests may leave tensors)
        base = meter.baseline_bytes
        assert torch.UntypedStorage.resize_ is not original
        tensor = torch.empty(1024)  # 4096 bytes
        storage = tensor.untyped_storage()
        assert meter.current_bytes - base == 4096
        storage.resize_(0)  # freed, as FSDP2 frees an unsharded parameter after a block's forward
        assert meter.current_bytes - base == 0
        storage.resize_(8192)  # refilled larger (all-gathered again for the backward)
        assert meter.current_bytes - base == 8192
        assert meter.peak_bytes - base == 8192
        storage.resize_(0)
        assert meter.current_bytes - base == 0
    assert torch.UntypedStorage.resize_ is original  # no meter active: torch's own method again
    assert meter.peak_bytes - base == 8192


def test_nested_meters_both_see_a_resize() -> None:
    with MemoryMeter() as outer:
        tensor = torch.empty(256)
        with MemoryMeter() as inner:  # counts the tensor, alive at its entry, in its baseline
            tensor.untyped_storage().resize_(0)
            assert inner.current_bytes - inner.baseline_bytes == -1024
            assert outer.current_bytes - outer.baseline_bytes == 0
            tensor.untyped_storage().resize_(2048)
            assert outer.current_bytes - outer.baseline_bytes == 2048
            assert inner.current_bytes - inner.baseline_bytes == 1024
        assert outer.peak_bytes - outer.baseline_bytes == 2048


def test_a_resize_on_another_thread_is_not_this_meters() -> None:
    """A meter's dispatch mode sees its own thread's ops only; its resizes likewise."""
    elsewhere = torch.empty(1 << 18)  # 1 MiB, made before the meter and freed on another thread
    with MemoryMeter(include_existing=False) as meter:
        worker = threading.Thread(target=lambda: elsewhere.untyped_storage().resize_(2 << 20))
        worker.start()
        worker.join()
        assert meter.current_bytes == 0 and meter.peak_bytes == 0


def test_a_dtensor_counts_as_its_local_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    port = free_port()
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 1, is_master=True), rank=0,
                            world_size=1)
    try:
        sharded = distribute_tensor(torch.ones(512, 256), init_device_mesh("cpu", (1,)), [Shard(0)])  # 512 KiB
        with MemoryMeter() as meter:
            assert meter.baseline_bytes >= 512 * 1024
            doubled = sharded * 2  # DTensor ops run on the shard with the meter's mode set aside
            zeros = torch.zeros_like(sharded)
            assert meter.current_bytes - meter.baseline_bytes == 2 * 512 * 1024
            del doubled, zeros
            assert meter.current_bytes == meter.baseline_bytes
    finally:
        dist.destroy_process_group()
