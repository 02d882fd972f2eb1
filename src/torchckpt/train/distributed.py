"""``torchckpt train`` on several processes: torchrun's environment, FSDP2 sharding, figures over ranks.

Rules kept here (named in ``docs/design.md``):

1. **[the main job runs on torchrun]** Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the
   job joins the process group torchrun describes (gloo: the job trains on CPUs), shards the model
   with FSDP2 (``fully_shard`` on every block, then on the root, as torchtitan does), gives every
   rank its own share of the data (a distributed sampler seeded with ``--seed``) and plans once on
   all ranks for a per-rank budget. ``torchckpt train --nproc N`` starts torchrun itself.
2. **[every rank saves its shard]** On several processes the job's Checkpointer writes sharded
   checkpoints (state/sharded/): every rank takes part in each save and restore. Run again on the
   same number of processes, the job resumes bit-exactly; on another number, the model and AdamW are
   resharded exactly and the data loader starts its epoch again (rank_local.py's [the rank-local rule]).
3. **[rank 0 speaks for the run]** Every rank trains; only rank 0 prints, writes the run directory
   (``run.json``, ``plan.json``, ``losses.jsonl``, ``summary.json``) and reports figures over all
   ranks: the loss is the mean of the ranks' losses, the peak the largest rank's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import torch
from torch import nn

from torchckpt.planner.distributed import collective_device
from torchckpt.train.config import TrainConfig

__all__ = ["Ranks", "join_process_group", "launch", "shard_model"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: ``rank`` of ``world``; ``owned``: the job started the group."""

    rank: int
    world: int
    owned: bool

    @property
    def leader(self) -> bool:
        """Rank 0: the one that prints and writes ([rank 0 speaks for the run])."""
        return self.rank == 0

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks (a collective: every rank calls it)."""
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=collective_device())
        dist.all_reduce(total)
        return float(total.item()) / self.world

    def largest(self, value: int) -> int:
        """The largest ``value`` over the ranks (a collective)."""
        import torch.distributed as dist

        top = torch.tensor([value], dtype=torch.int64, device=collective_device())
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return int(top.item())

    def leave(self) -> None:
        """Destroy the process group if this job created it."""
        import torch.distributed as dist

        if self.owned and dist.is_initialized():
            dist.destroy_process_group()


def join_process_group(environ: dict[str, str] | None = None) -> Ranks | None:
    """[the main job runs on torchrun]: join the group torchrun's environment describes; None for one process.

    Example:
        >>> join_process_group({}) is None  # not under torchrun
        True
    """
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r}, RANK={env.get('RANK')!r}: expected integers "
                         "(set by torchrun); start the job with torchrun or torchckpt train --nproc N") from None
    if world <= 1:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the job with torchrun "
                         "(torchrun --nproc-per-node N -m torchckpt train ...) or torchckpt train --nproc N")
    import torch.distributed as dist

    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), owned=False)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Ranks(rank, world, owned=True)


def shard_model(model: nn.Module, blocks: Sequence[nn.Module]) -> nn.Module:
    """FSDP2 on every block, then on the root (torchtitan's order); returns ``model``, sharded in place.

    Example (in a process group)::

        model = shard_model(gpt("mini"), gpt_model.blocks)
    """
    from torch.distributed.fsdp import fully_shard

    if not blocks:
        raise ValueError("shard_model: no blocks to shard; pass the model's repeated layers")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def launch(nproc: int, config: TrainConfig) -> int:
    """``torchckpt train --nproc N``: train ``config`` on ``nproc`` local processes under torchrun
    (``torch.distributed.run --standalone``); each process gets ``config.argv()``. Returns the exit code.

    Example::

        launch(2, TrainConfig(size="tiny", save=False))  # torchrun --standalone --nproc-per-node 2 ...
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer; got {nproc!r}")
    argv = config.argv()  # before starting anything: a config the command line cannot give is refused here
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "torchckpt", "train", *argv]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert process.stderr is not None
    dropped = _forward_without_launcher_report(process.stderr, sys.stderr)
    code = process.wait()
    if code != 0:
        print(f"torchckpt train --nproc {nproc}: a process failed (exit {code}); its error is above"
              + ("; torchrun's own report was left out" if dropped else ""), file=sys.stderr, flush=True)
    return code


_LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")  # torchrun's agent logs (glog style)


def _forward_without_launcher_report(source: IO[str], sink: IO[str]) -> bool:
    """Copy ``source`` to ``sink`` line by line, leaving out torchrun's agent: its log lines and, when a
    process fails, its traceback and failure table (the process's own one-line error is already shown).
    Returns whether anything was left out. A traceback from one of our processes is kept.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> _forward_without_launcher_report(io.StringIO("kept\\nE1205 06:21:52.768000 1 api.py] failed\\n"), out)
        True
        >>> out.getvalue()
        'kept\\n'
    """
    dropped = False
    pending: list[str] = []  # the start of a traceback, until its frames tell whose it is
    for line in source:
        if pending:
            pending.append(line)
            if any("torch/distributed/run.py" in item or "torch/distributed/launcher" in item for item in pending):
                return _drain(source) or True  # the agent's traceback and table run to the end of the stream
            if len(pending) < 8:
                continue
            sink.writelines(pending)
            pending = []
            continue
        if line.startswith("Traceback (most recent call last):"):
            pending = [line]
        elif _LAUNCHER_LOG.match(line):
            dropped = True
        else:
            sink.write(line)
            sink.flush()
    sink.writelines(pending)
    return dropped


def _drain(source: IO[str]) -> bool:
    for _ in source:
        pass
    return True
