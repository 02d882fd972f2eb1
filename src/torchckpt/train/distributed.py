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
3. **[the job exits in bounded time]** After its last step, a process of the job destroys its process group
   within ``EXIT_TIMEOUT_S`` seconds or exits without waiting further (``Ranks.leave``): a DDP or FSDP job can
   hang in PyTorch's shutdown, and a finished job must not.
4. **[rank 0 speaks for the run]** Every rank trains; only rank 0 prints, writes the run directory
   (``run.json``, ``plan.json``, ``losses.jsonl``, ``summary.json``) and reports figures over all
   ranks: the loss is the mean of the ranks' losses, the peak the largest rank's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch import nn

from torchckpt.planner.distributed import collective_device
from torchckpt.train.config import TrainConfig

__all__ = ["EXIT_TIMEOUT_S", "Ranks", "failed_ranks", "join_process_group", "launch", "shard_model"]


EXIT_TIMEOUT_S = 30.0  # [the job exits in bounded time]


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

    def leave(self, timeout_s: float = EXIT_TIMEOUT_S, failed: bool = False) -> None:
        """Destroy the process group if this job created it, within ``timeout_s`` ([the job exits in bounded
        time]): a shutdown that hangs (a known PyTorch behaviour at exit) is left behind and the process ends at
        once, with exit status 1 if ``failed`` else 0, after saying so on stderr."""
        import torch.distributed as dist

        if not (self.owned and dist.is_initialized()):
            return
        shutdown = threading.Thread(target=dist.destroy_process_group, name="torchckpt-leave", daemon=True)
        shutdown.start()
        shutdown.join(timeout_s)
        if shutdown.is_alive():
            print(f"torchckpt train: rank {self.rank}: the process group did not shut down within {timeout_s:g} s "
                  "(a known PyTorch hang at exit); the job's work is done and saved, so this process exits now",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1 if failed else 0)


def join_process_group(environ: dict[str, str] | None = None, timeout_s: float = 300.0) -> Ranks | None:
    """[the main job runs on torchrun]: join the group torchrun's environment describes; None for one process.

    The rendezvous (every one of ``WORLD_SIZE`` processes reaching ``MASTER_ADDR:MASTER_PORT``) waits at most
    ``timeout_s`` (``--rendezvous-timeout``; PyTorch's own default is 30 minutes), then raises ``ValueError`` (the
    environment does not match the processes started) saying how many joined, or that rank 0's address could not be
    reached. Collectives keep PyTorch's timeout.

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
    store = _rendezvous(env, rank, world, timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    return Ranks(rank, world, owned=True)


def _rendezvous(env: Mapping[str, str], rank: int, world: int, timeout_s: float) -> Any:
    """PyTorch's rendezvous at ``env``'s MASTER_ADDR:MASTER_PORT (torchrun's agent store when there is one),
    bounded by ``timeout_s``."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    where = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    try:
        store, _, _ = next(rendezvous(f"tcp://{where}", rank, world, timeout=datetime.timedelta(seconds=timeout_s)))
    except dist.DistStoreError as error:  # rank 0, waiting for the others
        joined = re.search(r"(\d+)/(\d+) clients joined", str(error))
        count = f"{joined.group(1)} of the {world}" if joined else f"not all {world}"
        raise ValueError(
            f"rank {rank}: {count} processes of WORLD_SIZE={world} joined at {where} within --rendezvous-timeout "
            f"{timeout_s:g} s; the others never started, or were told another MASTER_ADDR/MASTER_PORT. Fix: start "
            f"all {world} processes with the same MASTER_ADDR and MASTER_PORT (torchrun does), or set WORLD_SIZE to "
            "the number started") from None
    except dist.DistNetworkError:  # another rank, waiting for rank 0
        raise ValueError(
            f"rank {rank}: rank 0 of WORLD_SIZE={world} could not be reached at {where} within --rendezvous-timeout "
            f"{timeout_s:g} s: it was never started there, or it listens on another MASTER_ADDR/MASTER_PORT. Fix: "
            f"start all {world} processes with the same MASTER_ADDR and MASTER_PORT (torchrun does), or set "
            "WORLD_SIZE to the number started") from None
    store.set_timeout(datetime.timedelta(minutes=30))  # PyTorch's default again, for the job's own waits
    return store


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
    report: list[str] = []
    dropped = _forward_without_launcher_report(process.stderr, sys.stderr, report)
    code = process.wait()
    if code != 0:
        failed = failed_ranks(report)
        then = "".join(f"; then rank {rank} {how}" for rank, how in failed[1:])
        said = f"rank {failed[0][0]} {failed[0][1]} first{then}" if failed else f"a process failed (exit {code})"
        print(f"torchckpt train --nproc {nproc}: {said}; its error, if it could write one, is above"
              + ("; the rest of torchrun's own report was left out" if dropped else ""), file=sys.stderr, flush=True)
    return code


def failed_ranks(report: Sequence[str]) -> list[tuple[int, str]]:
    """The ranks torchrun's failure report names, each with how it ended: ``(rank, "was killed by signal 9
    (SIGKILL)")`` or ``(rank, "exited with code 1")``, in the report's order (the root cause first).

    Example:
        >>> failed_ranks(["  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 7)", "  traceback : Signal 9"])
        [(1, 'was killed by signal 9 (SIGKILL)')]
    """
    failed: list[tuple[int, str]] = []
    rank: int | None = None
    root = 0  # where the root cause goes: torchrun lists the other failures before it
    for line in report:
        if line.startswith("Root Cause"):
            root = len(failed)
        found = re.match(r"\s*rank\s*:\s*(\d+)", line)
        if found:
            rank = int(found.group(1))
            continue
        found = re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)
        if found and rank is not None:
            code = int(found.group(1))
            if code < 0:
                try:
                    name = f" ({signal.Signals(-code).name})"
                except ValueError:
                    name = ""
                failed.append((rank, f"was killed by signal {-code}{name}"))
            else:
                failed.append((rank, f"exited with code {code}"))
            rank = None
    return failed[root:root + 1] + failed[:root] + failed[root + 1:]


_LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d")  # torchrun's agent logs (glog style)


def _forward_without_launcher_report(source: IO[str], sink: IO[str], report: list[str] | None = None) -> bool:
    """Copy ``source`` to ``sink`` line by line, leaving out torchrun's agent: its log lines and, when a
    process fails, its traceback and failure table (the process's own one-line error is already shown).
    Returns whether anything was left out. A traceback from one of our processes is kept; the agent's report,
    from its traceback on, is appended to ``report`` (``failed_ranks`` reads it).

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
                if report is not None:
                    report.extend(pending)
                return _drain(source, report) or True  # the agent's traceback and table run to the end
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


def _drain(source: IO[str], report: list[str] | None) -> bool:
    for line in source:
        if report is not None:
            report.append(line)
    return True
