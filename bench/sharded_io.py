"""Sharded checkpoint I/O: torchckpt's sharded save and resharding restore against raw I/O and DCP's own writer.

    .venv/bin/python bench/sharded_io.py            # the full run (~2 min on a 2-core box)
    .venv/bin/python bench/sharded_io.py --quick    # tiny model, one repeat (what the test runs)

The state: an MLP of ``--layers`` Linear(``--width``, ``--width``) layers (default 6 x 2048: 101 MB of fp32
parameters; with AdamW's two moments 302 MB), FSDP2 (``fully_shard`` per layer, then the root) on gloo CPU
ranks after one training step. Three phases, each in freshly spawned processes:

1. **save, 2 ranks**: ``Checkpointer(dir).save(1, model=..., optimizer=...)`` (sync, default options: every
   rank writes its safetensors shard, hashed, fsynced; rank 0 commits after the vote);
   ``torch.distributed.checkpoint.save`` of ``get_state_dict(model, optimizer)`` with its default
   ``FileSystemWriter`` (the state dict is taken inside the timing for both); a raw write: each rank opens a
   new file in the same file system, writes a buffer of exactly the bytes its Checkpointer.save wrote (its
   shard, its rank-local files; rank 0 also the index, state.json and the manifest) and fsyncs it.
2. **restore, 1 rank** (a plain model, no process group) and 3. **restore, 4 ranks** (FSDP2) of the 2-rank
   checkpoints: ``Checkpointer(dir).restore(model=..., optimizer=...)`` (reads only the 1 MiB blocks each
   rank needs, verifies their hashes); ``dcp.load`` with its default ``FileSystemReader`` then
   ``set_state_dict``; a raw read: each rank reads exactly as many bytes as its Checkpointer.restore read
   from the shard files (counted by the ShardReader), from those same files, into fresh memory (first
   touched by the read, as a restore's new tensors are: the target's baseline) and, for reference, into a
   buffer allocated and touched once before (the kernel's copy alone). Every restore goes into a freshly
   built model and optimizer (built untimed), as a resumed run's does; DCP's restore initialises the
   optimizer's state first (torch's ``_init_optim_state``: zero gradients and a zero-lr AdamW step), timed
   on its own as a reference row (torchckpt's restore did too before commit 56de375; it now shapes the state
   without a step: state/sharded/optimizer_shapes.py). Restored values are checked against the saved ones
   (global sums).

Inside torchckpt's save and restore, parts are timed on their own (a clock read around each call of the
functions named in SAVE_PARTS and RESTORE_PARTS); "rest" is the save's or restore's time outside them.
A derived row gives each restore less its optimizer state init (torch's cost, paid by DCP's load too).

Reads come from the page cache: the files were written just before and the page cache is not dropped
(dropping it is not possible on the shared bench machine; bench/state/bench_throughput.py measures cold
single-process reads with posix_fadvise), so the raw read reads them warm too. Every timed operation starts
after a barrier; each rank times its own. Before the timed repeats one untimed warm-up round runs every
method (it also counts the bytes the raw write and read use). In each repeat the methods run in a rotated
order (ours, dcp, raw; then dcp, raw, ours; ...). Reported per method: MB/s per rank (the rank's bytes over
its seconds), median and min-max over ranks x repeats, and the seconds.

Targets (issue 30, "speed against the disk"; they were 0.8 and 0.7 before): per-rank save throughput >= 0.9 x
raw write; resharding restore (2 -> 1 and 2 -> 4 ranks) throughput >= 0.8 x raw read (into fresh memory); each a
ratio of per-rank
medians, met if the worst rank meets it. Reference ratios (not targets): DCP's against the same raw I/O,
torchckpt's restore against the reused-buffer read, and torchckpt's restore less the optimizer init.
Writes bench/results/sharded_io.json (``--out``) with the commit and the command line, and prints the
tables. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

MB = 10**6
SAVE_METHODS = ("torchckpt save", "dcp.save (FileSystemWriter)", "raw write (write+fsync)")
RAW_FRESH, RAW_REUSED = "raw read (page cache, into fresh memory)", "raw read (page cache, into a reused buffer)"
RESTORE_METHODS = ("torchckpt restore", "dcp.load (FileSystemReader) + set_state_dict", RAW_FRESH, RAW_REUSED)
LESS_INIT = "torchckpt restore less its optimizer state init (derived from the parts)"
INIT_ROW = "optimizer state init (inside both restores, reference)"
TARGETS = {"save": 0.9, "restore": 0.8}


# ----- in the spawned ranks ---------------------------------------------------------------------------


def _join(rank: int, world: int, port: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    warnings.filterwarnings("ignore")  # DCP warns on every single-process call
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _build(world: int, layers: int, width: int, seed: int) -> tuple[Any, Any]:
    """The bench MLP (FSDP2 on more than one rank) and its AdamW, optimizer state not yet created."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _local_tensors(model: Any, optimizer: Any) -> list[Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchckpt._host import local_part

    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = list(model_state.values())
    tensors += [t for state in optim_state["state"].values() for t in state.values() if hasattr(t, "numel")]
    return [local_part(t).detach() for t in tensors]


def _global_sums(model: Any, optimizer: Any) -> list[float]:
    """Sum of the parameters, of exp_avg and of exp_avg_sq over every rank (float64): the restore check."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchckpt._host import local_part

    model_state, optim_state = get_state_dict(model, optimizer)
    sums = torch.zeros(3, dtype=torch.float64)
    for tensor in model_state.values():
        sums[0] += local_part(tensor).double().sum()
    for state in optim_state["state"].values():
        sums[1] += local_part(state["exp_avg"]).double().sum()
        sums[2] += local_part(state["exp_avg_sq"]).double().sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return sums.tolist()


def _timed(action: Any) -> float:
    _barrier()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _rank_files(directory: Path, rank: int, world: int, rank_tag: str, leader_files: bool) -> int:
    """Bytes of the files under ``directory`` that rank ``rank`` wrote: those named with its tag, and (rank 0)
    every file named with no rank's tag."""
    total = 0
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        tags = [rank_tag.format(rank=r, world=world) for r in range(world)]
        mine = tags[rank] in path.name
        if mine or (leader_files and rank == 0 and not any(tag in path.name for tag in tags)):
            total += path.stat().st_size
    return total


def save_phase(rank: int, port: int, out_dir: str, world: int, cfg: dict[str, Any]) -> None:
    """Train one step, then a warm-up round and ``repeats`` rotated rounds of every save method."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torchckpt import Checkpointer

    _join(rank, world, port)
    model, optimizer = _build(world, cfg["layers"], cfg["width"], seed=0)
    model(torch.randn(8, cfg["width"], generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(model, optimizer))
    sums = _global_sums(model, optimizer)
    root = Path(cfg["data"])
    parts = _Breakdown(SAVE_PARTS)
    blob: list[Any] = []  # the raw write's buffer, sized by the warm-up round's torchckpt save

    def ours(where: Path) -> None:
        with Checkpointer(where / "ours") as ckpt:  # built and closed untimed; the save alone is timed
            parts.take(0.0)
            seconds = _timed(lambda: ckpt.save(1, model=model, optimizer=optimizer))
            breakdown.update(parts.take(seconds))
        record["torchckpt save"] = (seconds, _rank_files(where / "ours", rank, world, "-{rank:05d}-of-{world:05d}",
                                                          leader_files=True))

    def dcp_save(where: Path) -> None:
        def save() -> None:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state},
                     storage_writer=dcp.FileSystemWriter(str(where / "dcp")))

        seconds = _timed(save)
        record["dcp.save (FileSystemWriter)"] = (seconds, _rank_files(where / "dcp", rank, world, "__{rank}_",
                                                                       leader_files=True))

    def raw(where: Path) -> None:
        path = where / f"raw-{rank}.bin"

        def write() -> None:
            with open(path, "wb", buffering=0) as handle:
                view, done = memoryview(blob[0].numpy()), 0
                while done < len(view):
                    done += handle.write(view[done:])
                os.fsync(handle.fileno())

        record["raw write (write+fsync)"] = (_timed(write), path.stat().st_size)

    rounds = []
    methods = {"torchckpt save": ours, "dcp.save (FileSystemWriter)": dcp_save, "raw write (write+fsync)": raw}
    for number in range(cfg["repeats"] + 1):  # round 0: the untimed warm-up
        where = root / f"save-{number}"
        if rank == 0:
            if number > 0:
                shutil.rmtree(root / f"save-{number - 1}")  # untimed; the last round's files stay for the restores
            where.mkdir()
        _barrier()
        record: dict[str, tuple[float, int]] = {}
        breakdown: dict[str, float] = {}
        turn = number % len(SAVE_METHODS)
        order = list(SAVE_METHODS)[turn:] + list(SAVE_METHODS)[:turn]
        for name in order:
            if name == "raw write (write+fsync)" and not blob:
                ours_bytes = record["torchckpt save"][1]
                blob.append(torch.randint(0, 256, (ours_bytes,), dtype=torch.uint8,
                                          generator=torch.Generator().manual_seed(rank)))
            methods[name](where)
        rounds.append({"order": order, "seconds": {k: v[0] for k, v in record.items()},
                       "bytes": {k: v[1] for k, v in record.items()}, "torchckpt_parts": breakdown})
    _barrier()
    if rank == 0:
        final = root / f"save-{cfg['repeats']}"
        final.rename(root / "saved")
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"rank": rank, "state_bytes": state_bytes, "sums": sums,
                                                         "rounds": rounds}))
    _barrier()


# Parts of torchckpt's save and restore timed on their own (seconds summed per call): label -> the places the
# function may live, (module, attribute), the first that exists is wrapped where its callers look it up.
SAVE_PARTS = {
    "snapshot: get_state_dict and rank-local state": [("torchckpt.state.checkpointer.checkpointer", "snapshot_sharded"),
                                                      ("torchckpt.state.checkpointer", "snapshot_sharded")],
    "dcp.save: plans exchanged over gloo, write_data, results gathered": [("torch.distributed.checkpoint",
                                                                           "save")],
    "of which write_data: hash + write + fsync of the shard file": [("torchckpt.state.sharded.shard_storage",
                                                                     "ShardWriter.write_data"),
                                                                    ("torchckpt.state.shard_storage",
                                                                     "ShardWriter.write_data")],
    "commit (rank 0: state.json, manifest, rename, fsync)": [("torchckpt.state.sharded.save", "_commit"),
                                                             ("torchckpt.state.sharded", "_commit")],
}
RESTORE_PARTS = {
    "live state dicts (includes the optimizer state init)": [("torchckpt.state.sharded.restore", "live_state"),
                                                             ("torchckpt.state.sharded_restore", "live_state"),
                                                             ("torchckpt.state.sharded", "_live_state")],
    "dcp.load: plans exchanged over gloo, read_data": [("torch.distributed.checkpoint", "load")],
    "of which read_data: read + verify + copy into the targets": [("torchckpt.state.sharded.shard_storage",
                                                                   "ShardReader.read_data"),
                                                                  ("torchckpt.state.shard_storage",
                                                                   "ShardReader.read_data")],
    "of which pread: the shards' byte ranges (and the small index)": [("torchckpt.state.storage.local",
                                                                        "LocalStorage.read_range"),
                                                                       ("torchckpt.state.storage",
                                                                        "LocalStorage.read_range")],
    "of which preadv straight into the targets (part_reads.py)": [("torchckpt.state.storage.local",
                                                                    "LocalStorage.read_range_into")],
    "apply into the live model and optimizer (apply_restore)": [("torchckpt.state.sharded.restore", "apply_restore"),
                                                                ("torchckpt.state.sharded_restore", "apply_restore"),
                                                                ("torchckpt.state.checkpointer", "apply_restore")],
}
REST = "rest: index, manifest, rank-local files, store vote, waits for the other ranks"
INIT_PART = "live state dicts (includes the optimizer state init)"


class _Breakdown:
    """Times calls of torchckpt's functions named in ``parts`` (a wrapper around each: a clock read per call)."""

    def __init__(self, parts: dict[str, list[tuple[str, str]]]) -> None:
        import importlib

        self.seconds: dict[str, float] = {}
        for label, places in parts.items():
            for module_name, attribute in places:
                try:
                    owner: Any = importlib.import_module(module_name)
                    *path, name = attribute.split(".")
                    for part in path:
                        owner = getattr(owner, part)
                    function = getattr(owner, name)
                except (ImportError, AttributeError):
                    continue
                setattr(owner, name, self._timed(label, function))
                self.seconds[label] = 0.0
                break

    def _timed(self, label: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        return timed

    def take(self, total: float) -> dict[str, float]:
        """The seconds of each part since the last take, and the rest of ``total`` (outside every part but
        the nested "of which" ones)."""
        taken = dict(self.seconds)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        taken[REST] = total - sum(
            seconds for label, seconds in taken.items() if not label.startswith("of which"))
        return taken


class _CountingReaders:
    """Adds up the bytes the ShardReaders of a restore read from the shard files (untimed bookkeeping)."""

    def __init__(self) -> None:
        from torchckpt.state.sharded.shard_storage import ShardReader

        self.readers: list[Any] = []
        original = ShardReader.__init__

        def init(reader: Any, *args: Any, **kwargs: Any) -> None:
            original(reader, *args, **kwargs)
            self.readers.append(reader)

        ShardReader.__init__ = init  # type: ignore[method-assign]

    def take(self) -> int:
        total = sum(reader.bytes_read for reader in self.readers)
        self.readers.clear()
        return total


def restore_phase(rank: int, port: int, out_dir: str, world: int, cfg: dict[str, Any]) -> None:
    """Restore the 2-rank checkpoints on ``world`` ranks: a warm-up round and ``repeats`` rotated rounds."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

    from torchckpt import Checkpointer

    _join(rank, world, port)
    saved = Path(cfg["data"]) / "saved"
    counter = _CountingReaders()
    parts = _Breakdown(RESTORE_PARTS)
    shard_files = sorted((saved / "ours").glob("step-*/shards-*.safetensors"))
    sizes = [path.stat().st_size for path in shard_files]
    raw_bytes: list[int] = []  # from the warm-up round's torchckpt restore on this rank
    checks: list[bool] = []

    def fresh() -> tuple[Any, Any]:
        return _build(world, cfg["layers"], cfg["width"], seed=1)

    state_bytes = sum(t.numel() * t.element_size() for t in _local_tensors(*fresh()))

    def check(model: Any, optimizer: Any) -> None:
        got = _global_sums(model, optimizer)
        checks.append(all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(got, cfg["sums"])))

    def ours() -> None:
        model, optimizer = fresh()
        with Checkpointer(saved / "ours") as ckpt:
            parts.take(0.0)
            seconds = _timed(lambda: ckpt.restore(model=model, optimizer=optimizer))
            breakdown.update(parts.take(seconds))
        record["torchckpt restore"] = (seconds, counter.take())
        check(model, optimizer)

    def dcp_load() -> None:
        model, optimizer = fresh()

        def load() -> None:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(saved / "dcp")))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

        seconds = _timed(load)
        record["dcp.load (FileSystemReader) + set_state_dict"] = (seconds, state_bytes)  # what the rank loads
        check(model, optimizer)

    reused: list[Any] = []  # the reused buffer: allocated and touched once, untimed

    def raw(name: str) -> None:
        wanted = raw_bytes[0]
        total = sum(sizes)
        if name == RAW_REUSED and not reused:
            reused.append(torch.zeros(wanted, dtype=torch.uint8))

        def read() -> None:
            # fresh memory (first touched by the read, as a restore's new tensors are), or the reused buffer
            out = torch.empty(wanted, dtype=torch.uint8) if name == RAW_FRESH else reused[0]
            view, done = memoryview(out.numpy()), 0
            at = rank * total // world  # this rank's share of the shard files, wrapping round
            while done < wanted:
                index, offset = _locate(sizes, at % total)
                with open(shard_files[index], "rb", buffering=0) as handle:
                    handle.seek(offset)
                    while done < wanted:
                        got = handle.readinto(view[done:])
                        if not got:
                            break
                        done += got
                        at += got

        record[name] = (_timed(read), wanted)

    def init() -> None:
        model, optimizer = fresh()
        record[INIT_ROW] = (_timed(lambda: get_optimizer_state_dict(model, optimizer)), 0)

    rounds = []
    methods = {"torchckpt restore": ours, "dcp.load (FileSystemReader) + set_state_dict": dcp_load,
               RAW_FRESH: lambda: raw(RAW_FRESH), RAW_REUSED: lambda: raw(RAW_REUSED)}
    for number in range(cfg["repeats"] + 1):
        record: dict[str, tuple[float, int]] = {}
        breakdown: dict[str, float] = {}
        turn = number % len(RESTORE_METHODS)
        order = list(RESTORE_METHODS)[turn:] + list(RESTORE_METHODS)[:turn]
        for name in order:
            if name in (RAW_FRESH, RAW_REUSED) and not raw_bytes:
                if "torchckpt restore" not in record:
                    ours()  # untimed (warm-up round): the byte count the raw read uses
                raw_bytes.append(record["torchckpt restore"][1])
            methods[name]()
        init()
        rounds.append({"order": order, "seconds": {k: v[0] for k, v in record.items()},
                       "bytes": {k: v[1] for k, v in record.items()}, "torchckpt_parts": breakdown})
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"rank": rank, "state_bytes": state_bytes,
                                                         "restored_equal": all(checks), "rounds": rounds}))
    _barrier()


def _locate(sizes: list[int], at: int) -> tuple[int, int]:
    """(file index, offset in it) of byte ``at`` of the files' concatenation.

    Example:
        >>> _locate([10, 5], 12)
        (1, 2)
    """
    for index, size in enumerate(sizes):
        if at < size:
            return index, at
        at -= size
    raise ValueError(f"byte {at} is past the end")


# ----- in the parent ----------------------------------------------------------------------------------


def run_ranks(worker: Any, world: int, cfg: dict[str, Any], deadline_s: float) -> list[dict[str, Any]]:
    """``worker(rank, port, out_dir, world, cfg)`` on ``world`` spawned processes; their records in rank order."""
    from torchckpt._testing import spawn_processes

    with tempfile.TemporaryDirectory(prefix="sharded-io-ranks-") as out_dir:
        codes = spawn_processes(worker, world, cfg, out_dir=out_dir, deadline_s=deadline_s)
        if codes != [0] * world:
            raise RuntimeError(f"{worker.__name__} on {world} ranks: exit codes {codes} (None: past {deadline_s} s)")
        return [json.loads(Path(out_dir, f"{rank}.json").read_text()) for rank in range(world)]


def summarize(records: list[dict[str, Any]], methods: tuple[str, ...]) -> dict[str, Any]:
    """Per method: bytes and seconds of every rank in every timed round (round 0, the warm-up, is left out),
    MB/s per rank, and their median and min-max.

    Example:
        >>> rounds = [{"seconds": {"m": 9.0}, "bytes": {"m": 1}}, {"seconds": {"m": 0.5}, "bytes": {"m": 10**6}}]
        >>> summarize([{"rounds": rounds}], ("m",))["m"]["mb_per_s"]["median"]
        2.0
    """
    out = {}
    for name in methods:
        seconds = [[r["seconds"][name] for r in record["rounds"][1:]] for record in records]
        nbytes = [[r["bytes"][name] for r in record["rounds"][1:]] for record in records]
        rates = [[b / MB / s for b, s in zip(bs, ss)] for bs, ss in zip(nbytes, seconds)]
        flat_s, flat_r = [s for row in seconds for s in row], [r for row in rates for r in row]
        out[name] = {"bytes_per_rank": [row[0] for row in nbytes], "seconds_per_rank": seconds,
                     "mb_per_s_per_rank": rates,
                     "seconds": {"median": statistics.median(flat_s), "min": min(flat_s), "max": max(flat_s)},
                     "mb_per_s": {"median": statistics.median(flat_r), "min": min(flat_r), "max": max(flat_r)},
                     "rank_median_mb_per_s": [statistics.median(row) for row in rates]}
    return out


def parts_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and min-max seconds of each timed part of torchckpt's save or restore, over ranks x timed rounds.

    Example:
        >>> rounds = [{"torchckpt_parts": {"a": 9.0}}, {"torchckpt_parts": {"a": 0.5}}]
        >>> parts_summary([{"rounds": rounds}])["a"]["median"]
        0.5
    """
    values: dict[str, list[float]] = {}
    for record in records:
        for round_ in record["rounds"][1:]:
            for label, seconds in round_["torchckpt_parts"].items():
                values.setdefault(label, []).append(seconds)
    return {label: {"median": statistics.median(v), "min": min(v), "max": max(v)} for label, v in values.items()}


def add_less_init(records: list[dict[str, Any]]) -> None:
    """Add the derived row: each torchckpt restore's seconds less its optimizer state init (the timed part that
    builds the live state dicts), the same bytes.

    Example:
        >>> rounds = [{"seconds": {"torchckpt restore": 1.0}, "bytes": {"torchckpt restore": 8},
        ...            "torchckpt_parts": {INIT_PART: 0.75}}]
        >>> add_less_init([{"rounds": rounds}]); rounds[0]["seconds"][LESS_INIT]
        0.25
    """
    for record in records:
        for round_ in record["rounds"]:
            if INIT_PART in round_["torchckpt_parts"]:
                round_["seconds"][LESS_INIT] = (round_["seconds"]["torchckpt restore"]
                                                - round_["torchckpt_parts"][INIT_PART])
                round_["bytes"][LESS_INIT] = round_["bytes"]["torchckpt restore"]


def ratio(summary: dict[str, Any], ours: str, raw: str, target: float) -> dict[str, Any]:
    """ours / raw throughput: per rank (of the per-rank medians) and pooled; met if the worst rank meets it.

    Example:
        >>> s = {"a": {"rank_median_mb_per_s": [80.0, 90.0], "mb_per_s": {"median": 85.0}},
        ...      "b": {"rank_median_mb_per_s": [100.0, 100.0], "mb_per_s": {"median": 100.0}}}
        >>> ratio(s, "a", "b", 0.8)["met"], ratio(s, "a", "b", 0.8)["worst_rank"]
        (True, 0.8)
    """
    per_rank = [a / b for a, b in zip(summary[ours]["rank_median_mb_per_s"], summary[raw]["rank_median_mb_per_s"])]
    worst = min(per_rank)
    return {"method": ours, "against": raw, "per_rank": per_rank, "worst_rank": worst,
            "pooled_medians": summary[ours]["mb_per_s"]["median"] / summary[raw]["mb_per_s"]["median"],
            "target": target, "met": worst >= target}


def _command() -> str:
    executable = sys.executable
    try:
        relative = os.path.relpath(executable)
        executable = relative if not relative.startswith("..") else executable
    except ValueError:
        pass
    return " ".join(shlex.quote(part) for part in [executable, *sys.argv])


def _uncommitted(where: Path) -> list[str]:
    try:
        found = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10,
                               check=False, cwd=where)
    except (OSError, subprocess.SubprocessError):
        return []
    return found.stdout.splitlines()


def table(results: dict[str, Any]) -> str:
    """The Markdown table of a results file: one row per phase and method, then one per target."""
    rows = ["| phase | method | MB per rank | MB/s per rank, median (min-max) | seconds, median (min-max) |",
            "|---|---|---|---|---|"]
    for phase in results["phases"]:
        for name, row in phase["methods"].items():
            rate, secs = row["mb_per_s"], row["seconds"]
            size = "/".join(f"{b / MB:.1f}" for b in row["bytes_per_rank"]) if any(row["bytes_per_rank"]) else "-"
            speed = f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})" if any(row["bytes_per_rank"]) else "-"
            rows.append(f"| {phase['name']} | {name} | {size} | {speed} | {secs['median']:.3f} "
                        f"({secs['min']:.3f}-{secs['max']:.3f}) |")
    rows += ["", "| phase | part of torchckpt's save / restore | seconds, median (min-max) |", "|---|---|---|"]
    for phase in results["phases"]:
        for label, secs in phase["torchckpt_parts"].items():
            rows.append(f"| {phase['name']} | {label} | {secs['median']:.3f} ({secs['min']:.3f}-{secs['max']:.3f}) |")
    rows += ["", "| ratio of MB/s (per-rank medians) | worst rank | per rank | pooled medians | target | met |",
             "|---|---|---|---|---|---|"]
    for kind in ("targets", "reference_ratios"):
        for target in results[kind]:
            per_rank = ", ".join(f"{value:.2f}" for value in target["ratio"]["per_rank"])
            met = ("yes" if target["ratio"]["met"] else "NO") if kind == "targets" else "(reference)"
            rows.append(f"| {target['name']} | {target['ratio']['worst_rank']:.2f} | {per_rank} | "
                        f"{target['ratio']['pooled_medians']:.2f} | >= {target['ratio']['target']} | {met} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the three phases, print the table, write the results file."""
    from harness.provenance import run_record, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="Linear layers of the MLP (default 6)")
    parser.add_argument("--width", type=int, default=2048, help="their width (default 2048: 6 x 16.8 MB)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after the warm-up round (default 7)")
    parser.add_argument("--restore-worlds", default="1,4", help="ranks restoring the 2-rank save (default 1,4)")
    parser.add_argument("--dir", default=None, help="parent of the data directory (default: the system temp dir)")
    parser.add_argument("--quick", action="store_true", help="2 x 256 layers, 1 repeat (for tests)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sharded_io.json"))
    parser.add_argument("--note", default="", help="a remark stored in the results (e.g. what else ran meanwhile)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.repeats = 2, 256, 1
    worlds = [int(world) for world in args.restore_worlds.split(",")]
    if args.repeats < 1 or args.width % 4 or any(world < 1 for world in worlds):
        parser.error("--repeats must be >= 1, --width a multiple of 4, every --restore-worlds >= 1")
    here = Path(__file__).parent
    params = args.layers * (args.width * args.width + args.width)
    results = run_record(here, command=_command(), uncommitted=_uncommitted(here), layers=args.layers,
                         width=args.width, parameter_bytes=params * 4, state_bytes_approx=params * 4 * 3,
                         repeats=args.repeats, quick=args.quick, backend="gloo", save_world=2,
                         restore_worlds=worlds, note=args.note,
                         page_cache="warm: reads come from the page cache (not dropped); the raw reads read warm too",
                         threads_per_rank="cpu_count // world")
    data = tempfile.mkdtemp(prefix="torchckpt-sharded-io-", dir=args.dir)
    results["filesystem_dir"] = str(Path(data).parent)
    cfg = {"layers": args.layers, "width": args.width, "repeats": args.repeats, "data": data}
    deadline = 120.0 + 120.0 * args.repeats
    phases = []
    try:
        start = time.perf_counter()
        saved = run_ranks(save_phase, 2, cfg, deadline)
        phases.append({"name": "save, 2 ranks (FSDP2)", "kind": "save", "world": 2,
                       "wall_s": time.perf_counter() - start,
                       "state_bytes_per_rank": [r["state_bytes"] for r in saved],
                       "methods": summarize(saved, SAVE_METHODS), "torchckpt_parts": parts_summary(saved),
                       "rounds": [r["rounds"] for r in saved]})
        print(f"save on 2 ranks: {phases[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
        for world in worlds:
            start = time.perf_counter()
            records = run_ranks(restore_phase, world, {**cfg, "sums": saved[0]["sums"]}, deadline)
            add_less_init(records)
            phases.append({"name": f"restore 2 -> {world} rank{'s' if world > 1 else ''} "
                                   f"({'FSDP2' if world > 1 else 'plain model'})",
                           "kind": "restore", "world": world, "wall_s": time.perf_counter() - start,
                           "state_bytes_per_rank": [r["state_bytes"] for r in records],
                           "restored_equal": all(r["restored_equal"] for r in records),
                           "methods": summarize(records, (*RESTORE_METHODS, LESS_INIT, INIT_ROW)),
                           "torchckpt_parts": parts_summary(records),
                           "rounds": [r["rounds"] for r in records]})
            print(f"restore on {world} ranks: {phases[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    targets, references = [], []
    for phase in phases:
        methods, world = phase["methods"], phase["world"]
        if phase["kind"] == "save":
            targets.append({"name": "save 2 ranks: torchckpt / raw write",
                            "ratio": ratio(methods, SAVE_METHODS[0], SAVE_METHODS[2], TARGETS["save"])})
            references.append({"name": "save 2 ranks: dcp.save / raw write",
                               "ratio": ratio(methods, SAVE_METHODS[1], SAVE_METHODS[2], TARGETS["save"])})
        else:
            targets.append({"name": f"restore 2 -> {world}: torchckpt / raw read (fresh memory)",
                            "ratio": ratio(methods, RESTORE_METHODS[0], RAW_FRESH, TARGETS["restore"])})
            references += [
                {"name": f"restore 2 -> {world}: torchckpt / raw read (reused buffer)",
                 "ratio": ratio(methods, RESTORE_METHODS[0], RAW_REUSED, TARGETS["restore"])},
                {"name": f"restore 2 -> {world}: torchckpt less optimizer init / raw read (fresh memory)",
                 "ratio": ratio(methods, LESS_INIT, RAW_FRESH, TARGETS["restore"])},
                {"name": f"restore 2 -> {world}: dcp.load / raw read (fresh memory)",
                 "ratio": ratio(methods, RESTORE_METHODS[1], RAW_FRESH, TARGETS["restore"])}]
        ours, theirs = ("torchckpt save", SAVE_METHODS[1]) if phase["kind"] == "save" else RESTORE_METHODS[:2]
        phase["torchckpt_over_dcp_seconds"] = methods[ours]["seconds"]["median"] / methods[theirs]["seconds"]["median"]
    results.update(phases=phases, targets=targets, reference_ratios=references,
                   all_met=all(t["ratio"]["met"] for t in targets),
                   restored_equal=all(p.get("restored_equal", True) for p in phases))
    out = Path(args.out)
    path = write_results(results, out.parent, out.name)
    print(table(results))
    for phase in phases:
        print(f"{phase['name']}: torchckpt / dcp seconds (median) {phase['torchckpt_over_dcp_seconds']:.2f}")
    print(f"restored values equal the saved ones: {results['restored_equal']}; targets met: {results['all_met']}; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
