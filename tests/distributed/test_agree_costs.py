"""``planner.distributed.agree_costs`` in two real gloo processes: each figure becomes the largest any rank
measured, flags combine as documented, and ranks that measured different models are named."""

from __future__ import annotations

import json
import os

from torchckpt.planner.costs import BlockCosts, OpCosts
from torchckpt.planner.distributed import agree_costs
from torchckpt.planner.from_costs import ChainCosts


def _costs(rank: int, op_name: str = "aten::mm") -> ChainCosts:
    def block(k: int) -> BlockCosts:
        big = rank == k % 2  # rank 0 measures more in block 0, rank 1 in block 1
        last_on_rank_1 = rank == 1 and k == 1  # rank 1 found no chain: its outputs need not be inputs
        return BlockCosts(name=f"b{k}", input_bytes=100 + 10 * big, output_bytes=100 + 20 * last_on_rank_1,
                          saved_bytes=300 + 30 * big, forward_time_s=1.0 + big,
                          input_held_when_plain=big and k == 1,
                          ops=(OpCosts(index=0, name=op_name, output_bytes=40 + 4 * big, saved=True,
                                       time_s=0.5 + big),))
    return ChainCosts(fixed_bytes=1000 + rank, head_bytes=50 - rank, blocks=(block(0), block(1)),
                      step_time_s=2.0 + rank, chain=rank == 0, notes={"said by": f"rank {rank}"},
                      block_paths=("b0", "b1"))


def _worker(rank: int, port: int, out: str, differ: bool) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        agreed = agree_costs(_costs(rank, "aten::bmm" if differ and rank == 1 else "aten::mm"))
        result = {"fixed": agreed.fixed_bytes, "head": agreed.head_bytes, "step": agreed.step_time_s,
                  "chain": agreed.chain, "notes": agreed.notes,
                  "blocks": [[b.input_bytes, b.output_bytes, b.saved_bytes, b.forward_time_s,
                              b.input_held_when_plain, b.ops[0].output_bytes, b.ops[0].time_s]
                             for b in agreed.blocks]}
    except ValueError as error:
        result = {"error": str(error)}
    with open(os.path.join(out, f"{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()



def test_every_figure_is_the_largest_any_rank_measured(two_ranks) -> None:
    results = two_ranks(_worker, False)
    assert results[0] == results[1]
    agreed = results[0]
    assert (agreed["fixed"], agreed["head"], agreed["step"]) == (1001, 50, 3.0)
    assert agreed["chain"] is False  # one rank found no chain: nobody plans regions
    assert agreed["notes"]["said by"] == "rank 0" and "2 ranks profiled" in agreed["notes"]["ranks"]
    assert "another rank" in agreed["notes"]["chain"]
    # block 0: rank 0's larger figures; block 1: rank 1's; held-input is "any rank"
    assert agreed["blocks"] == [[110, 100, 330, 2.0, False, 44, 1.5], [110, 120, 330, 2.0, True, 44, 1.5]]


def test_ranks_that_measured_another_model_are_named(two_ranks) -> None:
    results = two_ranks(_worker, True)
    for result in results:
        assert "ranks [1] profiled a different model from rank 0" in result["error"]
        assert "Fix:" in result["error"]


def _plan_on_rank_0(rank: int, port: int, out: str) -> None:
    """torchtitan's recipe: rank 0 plans the unsharded model alone and sends the plan; the other waits for it."""
    import datetime

    import torch
    import torch.distributed as dist

    import torchckpt
    from torchckpt.models.registry import BatchShape, get_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        sent: list = [None]
        if rank == 0:
            entry = get_model("hf-llama-tiny")
            model, batch = entry.build(seed=0, shape=BatchShape(batch_size=4, seq_len=128))
            costs = torchckpt.profile(model, batch, blocks=entry.blocks(model))
            sent = [{"plan": costs.plan("90%").to_json(), "head": sorted(costs.loss_head)}]
        dist.broadcast_object_list(sent, src=0)
        with open(os.path.join(out, f"{rank}.json"), "w") as handle:
            json.dump(sent[0], handle)
    finally:
        dist.destroy_process_group()


def test_a_model_planned_by_one_rank_alone_takes_part_in_no_collective(two_ranks) -> None:
    # the chunked loss head's timing vote (options_step.py) ran agree_flag with group None, an all_reduce over the
    # whole world: rank 0 waited in it while rank 1 waited in the broadcast, until gloo's timeout
    results = two_ranks(_plan_on_rank_0)
    assert results[0] == results[1]
    # the head was measured in chunks, so the vote that hung ran (whether the plan then takes the head depends on
    # the measured times)
    assert "chunk_tokens" in results[0]["head"] and json.loads(results[0]["plan"])["block_paths"]


def _fsdp2_adamw_offload(rank: int, port: int, out: str) -> None:
    """FSDP2 units with AdamW's state made (DTensors), profiled with offload on both ranks."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import torchckpt
    from torchckpt.models import gpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = gpt("tiny", dropout=0.0)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        batch = model.example_batch(batch_size=2, seq_len=32)
        optimizer = torch.optim.AdamW(model.parameters())
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        costs = torchckpt.profile(model, batch, optimizer=optimizer, offload=True)
        result = {"offload": costs.offload, "state": costs.state_bytes,
                  "host": [b.offload_host_bytes for b in costs.blocks], "notes": costs.notes.get("offload", "")}
        with open(os.path.join(out, f"{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def test_fsdp2_with_adamw_state_is_profiled_and_the_ranks_agree_on_the_offload(two_ranks) -> None:
    # is_host_tensor read a DTensor's storage and every FSDP2 profile with an optimizer's state failed
    results = two_ranks(_fsdp2_adamw_offload)
    assert results[0] == results[1]  # planner/offload_step.py's [offload where it can run]: agreed figures
    agreed = results[0]
    assert agreed["state"]["optimizer_state"] > 0 and all(n > 0 for n in agreed["host"]), agreed
    assert agreed["offload"]["host_budget_bytes"] > 0 and agreed["notes"].startswith("every block offloaded")
