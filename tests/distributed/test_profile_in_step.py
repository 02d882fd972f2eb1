"""Profiling under DDP when the ranks' own steps disagree (their data takes another branch): every rank takes
the same path through profiling, so no rank waits in a collective the others never join. A short gloo timeout
turns a regression into a failure, not a hang."""

from __future__ import annotations

import datetime
import gc
import json
import os

import pytest
import torch
from torch import nn


class _Branchy(nn.Module):
    """Three blocks; on a batch whose first value is positive, code outside the blocks reads block 0's output
    after block 1 (not a chain), or block 1 runs twice."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.blocks[0](x)
        h1 = self.blocks[1](h0)
        if x[0, 0] > 0:
            h1 = self.blocks[1](h1) if self.twice else h1 + h0
        return self.blocks[2](h1)


def _worker(rank: int, port: int, out: str, twice: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    result = _profile_on_rank(rank, twice)
    gc.collect()  # the DDP model (and a traceback holding it) goes before its group: see bench/harness/distributed.py
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


def _profile_on_rank(rank: int, twice: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from torchckpt.planner import profile

    torch.manual_seed(0)
    model = _Branchy(twice)
    batch = torch.randn(4, 32).abs() * (1 if rank == 0 else -1)  # rank 0 takes the branch, rank 1 does not
    try:
        costs = profile(DistributedDataParallel(model), (batch,), loss_fn=lambda out: out.sum(),
                        blocks=list(model.blocks))
        return {"chain": costs.chain, "note": costs.notes.get("chain", "")}
    except Exception as error:  # noqa: BLE001 - the test reads it
        return {"error": f"{type(error).__name__}: {error}"}



def test_a_chain_on_one_rank_only_is_no_chain_on_every_rank(two_ranks) -> None:
    results = two_ranks(_worker, False)
    assert [r.get("chain") for r in results] == [False, False], results
    assert all("read by code outside the blocks" in r["note"] for r in results)  # rank 0's reason, on both


@pytest.mark.parametrize("twice", [True], ids=["block-runs-twice-on-rank-0"])
def test_an_error_on_one_rank_stops_every_rank_with_its_message(two_ranks, twice: bool) -> None:
    results = two_ranks(_worker, twice)
    assert "ran 2 times" in results[0]["error"]
    assert results[1]["error"].startswith("ValueError: profiling failed on another rank, so every rank stops here: "
                                          "rank 0: ValueError: block 1")
