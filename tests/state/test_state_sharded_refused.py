"""A DTensor (FSDP2's sharded parameters and optimizer state) is saved sharded when a process group is
initialised; a Checkpointer told to write whole tensors (``sharded=False``) refuses it by name before anything
is written: saving one rank's shard as the whole tensor would be a wrong checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchckpt import Checkpointer
from torchckpt._testing import free_port
from torchckpt.state import UnsupportedStateError


@pytest.fixture
def one_rank_group():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded_linear(mesh) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    return model


def test_a_dtensor_is_refused_by_an_unsharded_checkpointer_and_nothing_is_written(one_rank_group, tmp_path) -> None:
    model = _sharded_linear(one_rank_group)
    with Checkpointer(tmp_path / "ckpt", sharded=False) as checkpointer:
        with pytest.raises(UnsupportedStateError, match=r"weight is a DTensor .*sharded=False"):
            checkpointer.save(1, model=model)
        assert checkpointer.latest_step() is None
        checkpointer.save(1, extras={"w": torch.ones(2)})  # the Checkpointer still works afterwards
        assert checkpointer.latest_step() == 1


def test_with_a_process_group_a_dtensor_is_saved_sharded_and_restored(one_rank_group, tmp_path) -> None:
    model = _sharded_linear(one_rank_group)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(1, model=model)
        [info] = checkpointer.list("full")
        assert info.valid
    fresh = _sharded_linear(one_rank_group)
    with torch.no_grad():
        fresh.weight.zero_()
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        assert checkpointer.restore(model=fresh) == 1
    assert torch.equal(fresh.weight.full_tensor(), model.weight.full_tensor())
