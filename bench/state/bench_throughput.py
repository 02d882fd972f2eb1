"""Save/restore throughput of torchckpt against raw I/O, torch.save/load and torch.distributed.checkpoint.

Usage: .venv/bin/python bench/state/bench_throughput.py [--mb 512] [--repeats 3] [--dir DIR] [--warm]
       [--methods raw,torch,dcp,torchckpt,hash] [--tiny 100000] [--tied-gpt2] [--out FILE]

One process, one state: a model of 4 square bias-free Linear layers + AdamW state after one step
(params + 2 moments ~= --mb MB, 1 MB = 10**6 bytes). Every repeat runs every method once, in
the same order (interleaved), so drift of the shared machine hits all methods alike: first every
write, then every read, the raw read both first and last (two samples per repeat); reported:
median and min-max of the seconds, MB/s of the median (state bytes over the time; none for the
training-step rows). Every write ends with fsync (raw write:
write + fsync; torch.save: + fsync of the file; dcp: FileSystemWriter(sync_files=True);
torchckpt: its commit protocol, default hash xxh3_128). Before every timed read the files are read once
untimed and then evicted from the page cache (posix_fadvise DONTNEED), so timed reads come from the
disk, unless --warm. The untimed read is there because on a virtual disk the first read of files
written just before waits for the host's writeback of the whole burst of writes (a plain read of a
fresh checkpoint's files measured 0.81 s median against 0.38 s for the raw file read before it): that
wait would land on whichever reader comes first, not on the reader's own cost. Every reader reads into
fresh memory; before each read the bench times a first touch of that much fresh memory on its own row:
on this VM it varies several-fold between reads (0.13-0.80 s for 512 MB seen in one run), which is most
of the spread of every read row.

The async Checkpointers live across repeats, as in a training run (they save every repeat; no retention,
so no deletion lands in their timing): the host staging buffer is allocated by the first save, reported
on its own row, and reused after. Two async modes: the default copies every tensor before save() returns;
async_staging=True copies parameters and optimizer state in the background thread while the training
step runs (here: one forward/backward of the same model on a 64-row batch) and makes the optimizer step
wait for the copy. Its blocking time is save() plus that wait. A training step runs while each async save
is in flight, and its time is reported next to a step without a save: on a small machine the background
copy, hash and write share the training step's cores and memory bandwidth.

The sync save is timed twice per repeat, first with the writeback hint off (as on a system without
sync_file_range, storage/kernel_hints.py's [writeback starts as pieces are written]), then as shipped.

Restores go into a freshly built model and optimizer, as a resumed run's do; one more row restores into
the live objects (a rollback inside one process), which first frees their old state. Where a restore's
time goes: torchckpt's read + verify + decode alone, then that decoded step applied alone to a fresh
model and optimizer; torch's peer of the whole job, torch.load + load_state_dict into a fresh model and
optimizer, with the load_state_dict part on its own row. The reads after the first raw read run in
reverse order every other repeat, so that no reader always comes first; the 1-minute load average as
each repeat's reads begin is recorded.

Against torch.save/load (issue 29, with --methods torch,torchckpt): the restore with verify="full" also
records its peak RSS over the restored state (VmHWM reset before it, minus the RSS before and the state's
bytes), against the largest tensor. ``--tiny N`` adds a state of N tiny tensors (4 fp32 each, one dict
item), saved and restored by torch.save/torch.load and torchckpt in the same interleaved repeats;
``--tied-gpt2`` saves a GPT-2 small with tied embeddings (transformers' GPT2Config, random weights, no
download) once and compares its tensor bytes on disk with the unique bytes of its storages.

Targets (ratios of median times; the zero-copy I/O targets): torchckpt sync save / raw write throughput >= 0.8;
async save blocking time / sync save time <= 0.10; torchckpt restore / raw read throughput >= 0.8,
for verify="full" and verify="fast". Against torch (issue 29): sync save / torch.save <= 0.6, async blocking /
torch.save <= 0.1, restore verify=full / torch.load <= 1.0, restore's peak RSS over the state <= the largest
tensor; tiny tensors: sync save / torch.save <= 1.0, restore / torch.load <= 0.5; tied GPT-2: tensor bytes on
disk == unique storage bytes.
Prints Markdown tables and writes bench/state/results/throughput.json (or --out), with the commit it ran on.
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench/: the harness package
from harness.provenance import run_record
from torchckpt.memory.rss import read_rss_bytes, reset_peak_rss
from torchckpt.state import Checkpointer
from torchckpt.state.format.hashing import DEFAULT_HASH_ALGORITHM, hash_bytes
from torchckpt.state.format.layout import parse_step_dir_name
from torchckpt.state.read.load import apply_snapshot
from torchckpt.state.read.newest import read_newest_valid
from torchckpt.state.storage import kernel_hints
from torchckpt.state.storage.backends import open_storage

MB = 10**6


def build_state(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """Model + AdamW after one step whose tensors total ~``mb`` MB; returns them and the exact bytes."""
    torch.manual_seed(0)
    width = int((mb * MB / 4 / 3 / 4) ** 0.5)  # 4 square fp32 layers, params + exp_avg + exp_avg_sq
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    tensors = list(model.state_dict().values()) + [
        value for state in optimizer.state_dict()["state"].values() for value in state.values()
    ]
    return model, optimizer, sum(t.numel() * t.element_size() for t in tensors)


def fresh_model_and_optimizer(like: torch.nn.Sequential) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A newly built model of the same shapes and an AdamW with no state yet: what a resumed run restores into."""
    model = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features, bias=False) for m in like])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def evict(path: str) -> None:
    """Drop the (clean, fsynced) pages of every file under ``path`` from the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_untimed(path: str) -> None:
    """Read every file under ``path`` once (the virtual disk's first read after a burst of writes is slow)."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in paths:
        with open(name, "rb", buffering=0) as handle:
            while handle.read(64 << 20):
                pass


def clear_steps(directory: str) -> None:
    """Untimed, after an async save committed: drop its files from the page cache and delete them.

    Left alone, gigabytes of committed steps fill the page cache and later fresh allocations (every
    read buffer) pay for reclaiming it, on whichever reader comes next.
    """
    for entry in os.listdir(directory):
        if parse_step_dir_name(entry) is not None:
            evict(os.path.join(directory, entry))
            shutil.rmtree(os.path.join(directory, entry))


@contextlib.contextmanager
def without_writeback_hint() -> Iterator[None]:
    """Saves inside it run as on a system without sync_file_range (storage/kernel_hints.py): the hint's own share."""
    libc, kernel_hints._LIBC = kernel_hints._LIBC, None
    try:
        yield
    finally:
        kernel_hints._LIBC = libc


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


class Bench:
    """Runs the methods of one repeat; collects seconds per method."""

    def __init__(self, root: str, model, optimizer, nbytes: int, warm: bool) -> None:
        self.root, self.model, self.optimizer, self.nbytes, self.warm = root, model, optimizer, nbytes, warm
        self.times: dict[str, list[float]] = {}
        self.tiny_state: dict[str, torch.Tensor] | None = None
        self.rss_over_state: list[int] = []  # peak RSS of each verify="full" restore over the restored state
        self.load_averages: list[float] = []  # the 1-minute load average as each repeat's reads began
        self.step = 0
        self.async_ckpt: Checkpointer | None = None  # lives across repeats, like a training run's
        self.staged_ckpt: Checkpointer | None = None  # async_staging=True, also across repeats
        self.batch = torch.randn(64, model[0].in_features)
        # the same bytes as the state, in one buffer, for the raw write
        self.blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in self._tensors()])

    def _tensors(self) -> list[torch.Tensor]:
        opt = self.optimizer.state_dict()["state"]
        return list(self.model.state_dict().values()) + [v for s in opt.values() for v in s.values()]

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def timed(self, name: str, action: Callable[[], object]) -> object:
        start = time.perf_counter()
        result = action()
        self.times.setdefault(name, []).append(time.perf_counter() - start)
        return result

    def before_read(self, path: str) -> None:
        if not self.warm:
            read_untimed(path)  # the host's writeback of the burst of writes lands here, not in the timing
            evict(path)

    def raw(self) -> list[Callable[[], None]]:
        path = os.path.join(self.root, "raw.bin")
        remove(path)

        def write() -> None:
            with open(path, "wb") as handle:
                handle.write(memoryview(self.blob.numpy()))
                handle.flush()
                os.fsync(handle.fileno())

        def read() -> torch.Tensor:
            out = torch.empty(self.nbytes, dtype=torch.uint8)
            with open(path, "rb", buffering=0) as handle:
                view, done = memoryview(out.numpy()), 0
                while done < self.nbytes:
                    done += handle.readinto(view[done:])
            return out

        def timed_read() -> None:
            self.before_read(path)
            out = self.timed("raw read", read)
            assert torch.equal(out, self.blob)

        self.timed("raw write (write+fsync)", write)
        return [timed_read]

    def torch_save(self) -> list[Callable[[], None]]:
        path = os.path.join(self.root, "state.pt")
        remove(path)

        def save() -> None:
            torch.save(self._state(), path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        def load() -> None:
            self.before_read(path)
            loaded = self.timed("torch.load", lambda: torch.load(path, weights_only=True))
            assert torch.equal(loaded["model"]["0.weight"], saved_weight)

        def load_into_fresh() -> None:
            model, optimizer = fresh
            self.before_read(path)

            def load_and_apply() -> None:
                loaded = torch.load(path, weights_only=True)
                start = time.perf_counter()
                model.load_state_dict(loaded["model"])
                optimizer.load_state_dict(loaded["optimizer"])
                self.times.setdefault("torch: load_state_dict alone (fresh model+optimizer)", []).append(
                    time.perf_counter() - start)

            self.timed("torch.load + load_state_dict (fresh model+optimizer)", load_and_apply)
            assert torch.equal(model[0].weight, saved_weight)

        self.timed("torch.save (+fsync)", save)
        saved_weight = self.model[0].weight.detach().clone()  # later rows train the model on
        fresh = fresh_model_and_optimizer(self.model)  # built untimed, well before the reads, as torchckpt's are
        return [load, load_into_fresh]

    def dcp(self) -> list[Callable[[], None]]:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.root, "dcp")
        remove(path)
        # a state dict of fresh tensors to load into (dcp.load loads in place)
        target = {"model": {k: torch.empty_like(v) for k, v in self.model.state_dict().items()},
                  "optimizer": {str(k): {n: torch.empty_like(t) for n, t in s.items()}
                                for k, s in self.optimizer.state_dict()["state"].items()}}
        source = {"model": self.model.state_dict(),
                  "optimizer": {str(k): dict(s) for k, s in self.optimizer.state_dict()["state"].items()}}
        def load() -> None:
            self.before_read(path)
            self.timed("dcp.load", lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(path)))
            assert torch.equal(target["model"]["0.weight"], saved_weight)

        self.timed("dcp.save", lambda: dcp.save(source, storage_writer=dcp.FileSystemWriter(path)))
        saved_weight = self.model[0].weight.detach().clone()
        return [load]

    def torchckpt(self) -> list[Callable[[], None]]:
        self.step += 1
        sync_dir, async_dir = os.path.join(self.root, "ckpt-sync"), os.path.join(self.root, "ckpt-async")
        remove(sync_dir)
        save = f"torchckpt save (sync, {DEFAULT_HASH_ALGORITHM})"
        plain_dir = os.path.join(self.root, "ckpt-sync-no-hint")
        remove(plain_dir)
        with Checkpointer(plain_dir, keep_last=1) as ckpt, without_writeback_hint():
            self.timed(f"{save}, without the writeback hint", lambda: ckpt.save(
                self.step, model=self.model, optimizer=self.optimizer))
        evict(plain_dir)
        remove(plain_dir)
        with Checkpointer(sync_dir, keep_last=1) as ckpt:
            self.timed(save, lambda: ckpt.save(self.step, model=self.model, optimizer=self.optimizer))
        saved_weight = self.model[0].weight.detach().clone()  # the async rows below train the model on
        self.torchckpt_async(async_dir)
        self.torchckpt_async_staging(os.path.join(self.root, "ckpt-staged"))

        def restore(verify: str, name: str, objects: list) -> None:
            model, optimizer = objects.pop()
            self.before_read(sync_dir)
            with Checkpointer(sync_dir, verify=verify) as ckpt:
                rss_before = read_rss_bytes()[0]
                measured = verify == "full" and objects is not live and reset_peak_rss()
                restored = self.timed(name, lambda: ckpt.restore(model=model, optimizer=optimizer, rng=False))
                if measured:
                    self.rss_over_state.append(read_rss_bytes()[1] - rss_before - self.nbytes)
            assert restored == step and torch.equal(model[0].weight, saved_weight)

        def read_only() -> None:
            self.before_read(sync_dir)
            snapshot = self.timed("torchckpt read+verify=full+decode only (no load_state_dict)",
                                  lambda: read_newest_valid(open_storage(sync_dir), step=None, verify="full",
                                                            fallback=False, wanted={"model", "optimizer"}))
            assert snapshot.step == step
            model, optimizer = fresh[2].pop()
            self.timed("torchckpt: apply alone (the decoded step into a fresh model+optimizer)",
                       lambda: apply_snapshot(snapshot, {"model": model, "optimizer": optimizer}, False, sync_dir))
            assert torch.equal(model[0].weight, saved_weight)

        step = self.step
        # as a resumed run does: a freshly built model and optimizer (no state yet), built now, untimed and
        # well before the reads (initialising them runs torch's thread pool, which spins a while after)
        fresh = [[fresh_model_and_optimizer(self.model)] for _ in range(3)]
        live = [(self.model, self.optimizer)]
        return [lambda: restore("full", "torchckpt restore (verify=full)", fresh[0]),
                lambda: restore("fast", "torchckpt restore (verify=fast, no hashing)", fresh[1]),
                lambda: restore("full", "torchckpt restore into the live model+optimizer (verify=full)", live),
                read_only]

    def torchckpt_async(self, async_dir: str) -> None:
        if self.async_ckpt is None:
            # no retention: deleting the previous 512 MB step would land inside "until committed"; each
            # repeat deletes its steps untimed instead (clear_steps)
            self.async_ckpt = Checkpointer(async_dir, async_save=True)
            self.timed("torchckpt save (async, first save: allocates the staging buffer)", lambda: self.async_ckpt.save(
                self.step, model=self.model, optimizer=self.optimizer))
            self.async_ckpt.wait()
        start = time.perf_counter()
        step = self.step + 10**6  # the async run has its own steps, after the first save's
        self.timed("torchckpt save (async, blocking part)", lambda: self.async_ckpt.save(
            step, model=self.model, optimizer=self.optimizer))
        self.timed("training step, async save (copied in save()) in flight", self.train_step)
        self.async_ckpt.wait()
        self.times.setdefault("torchckpt save (async, until committed)", []).append(time.perf_counter() - start)
        clear_steps(async_dir)

    def train_step(self) -> None:
        """One forward/backward and optimizer step of the bench model (what training does between saves)."""
        self.optimizer.zero_grad()
        self.model(self.batch).square().mean().backward()
        self.optimizer.step()

    def torchckpt_async_staging(self, staged_dir: str) -> None:
        if self.staged_ckpt is None:
            self.staged_ckpt = Checkpointer(staged_dir, async_save=True, async_staging=True)
            self.staged_ckpt.save(0, model=self.model, optimizer=self.optimizer)  # allocates the buffer
            self.staged_ckpt.wait()
        self.timed("training step, no save in flight", self.train_step)
        ckpt, step = self.staged_ckpt, self.step + 10**6
        waited_before = ckpt.optimizer_wait_s
        start = time.perf_counter()
        ckpt.save(step, model=self.model, optimizer=self.optimizer)
        called = time.perf_counter() - start
        self.timed("training step, async_staging save in flight", self.train_step)
        waited = ckpt.optimizer_wait_s - waited_before
        for name, seconds in (("torchckpt save (async_staging, save() call)", called),
                              ("torchckpt save (async_staging, optimizer step waited)", waited),
                              ("torchckpt save (async_staging, blocking part: call + wait)", called + waited)):
            self.times.setdefault(name, []).append(seconds)
        ckpt.wait()
        self.times.setdefault("torchckpt save (async_staging, until committed)", []).append(time.perf_counter() - start)
        clear_steps(staged_dir)

    def tiny(self, count: int) -> list[Callable[[], None]]:
        """``count`` tiny tensors (4 fp32 each, one dict item): torch.save/load against torchckpt's sync save and
        restore (verify="full")."""
        if self.tiny_state is None:
            self.tiny_state = {f"t{i}": torch.randn(4) for i in range(count)}
        state, step = self.tiny_state, self.step + 2 * 10**6
        path, directory = os.path.join(self.root, "tiny.pt"), os.path.join(self.root, "tiny-ckpt")
        remove(path)
        remove(directory)

        def save() -> None:
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        self.timed("tiny tensors: torch.save (+fsync)", save)
        with Checkpointer(directory) as ckpt:
            self.timed("tiny tensors: torchckpt save (sync)", lambda: ckpt.save(step, extras=state))

        def load() -> None:
            self.before_read(path)
            loaded = self.timed("tiny tensors: torch.load", lambda: torch.load(path, weights_only=True))
            assert torch.equal(loaded["t7"], state["t7"])

        def restore() -> None:
            self.before_read(directory)
            restored: dict = {}
            with Checkpointer(directory) as ckpt:
                self.timed("tiny tensors: torchckpt restore (verify=full)",
                           lambda: ckpt.restore(extras=restored, rng=False))
            assert torch.equal(restored["t7"], state["t7"]) and len(restored) == len(state)

        return [load, restore]

    def touch(self) -> None:
        """First touch of fresh memory, as every reader's buffer gets: on a VM its cost varies widely."""
        fresh = torch.empty(self.nbytes, dtype=torch.uint8)
        fresh.fill_(0)

    def hash_only(self) -> list[Callable[[], None]]:
        """The hash of the same bytes, in memory: the hashing share of a save or a full-verify restore."""
        data = memoryview(self.blob.numpy())
        for algorithm in (DEFAULT_HASH_ALGORITHM, "sha256"):
            self.timed(f"{algorithm} of the same bytes (in memory, for reference)",
                       lambda algorithm=algorithm: hash_bytes(data, algorithm))
        return []


def tied_gpt2(root: str) -> dict:
    """Save a GPT-2 small with tied embeddings once; its tensor bytes on disk against its unique storage bytes,
    and what a restore gives back (the tie, each tensor's own storage, what torch.save of one tensor writes)."""
    import transformers

    config = transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(config)
    state = model.state_dict()
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
    directory = os.path.join(root, "tied-gpt2")
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, model=model)
    step_dir = os.path.join(directory, "step-000000001")
    files = {name: os.path.getsize(os.path.join(step_dir, name)) for name in sorted(os.listdir(step_dir))}
    with open(os.path.join(step_dir, "model.safetensors"), "rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
    restored = transformers.GPT2LMHeadModel(config)
    with Checkpointer(directory) as ckpt:
        ckpt.restore(model=restored, rng=False)
    one = os.path.join(root, "one-tensor.pt")
    torch.save(restored.lm_head.weight.detach(), one)
    weight = restored.lm_head.weight
    result = {
        "state_dict_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "unique_storage_bytes": sum(unique.values()),
        "tensor_bytes_on_disk": files["model.safetensors"] - 8 - header_bytes,
        "step_bytes_on_disk": sum(files.values()), "files": files,
        "restored_tie_is_one_tensor": restored.lm_head.weight is restored.transformer.wte.weight,
        "restored_tensors_own_their_storage": all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                                                  for t in restored.state_dict().values()),
        "torch_save_of_one_restored_tensor_bytes": os.path.getsize(one),
        "that_tensor_bytes": weight.numel() * weight.element_size(),
        "bitwise": all(torch.equal(a, b) for a, b in zip(state.values(), restored.state_dict().values())),
    }
    shutil.rmtree(directory)
    os.remove(one)
    return result


def torch_targets(med: dict[str, float], bench: Bench, largest: int, tied: dict | None) -> list[tuple]:
    """The issue-29 ratios against torch.save/torch.load that the run measured: (name, value, wanted, met)."""
    found = []
    save = f"torchckpt save (sync, {DEFAULT_HASH_ALGORITHM})"
    if "torch.save (+fsync)" in med and save in med:
        torch_save, torch_load = med["torch.save (+fsync)"], med["torch.load"]
        found += [("sync save / torch.save (time)", med[save] / torch_save, "<= 0.6", 0.6),
                  ("async blocking / torch.save (time)", med["torchckpt save (async, blocking part)"] / torch_save,
                   "<= 0.1", 0.1),
                  ("restore verify=full / torch.load (time)", med["torchckpt restore (verify=full)"] / torch_load,
                   "<= 1.0", 1.0)]
    if bench.rss_over_state:
        over = statistics.median(bench.rss_over_state)
        found.append(("restore's peak RSS over the restored state / largest tensor (median)", over / largest,
                      "<= 1.0", 1.0))
    if "tiny tensors: torch.save (+fsync)" in med:
        tiny_save = med["tiny tensors: torchckpt save (sync)"] / med["tiny tensors: torch.save (+fsync)"]
        found += [("tiny tensors: sync save / torch.save (time)", tiny_save, "<= 1.0", 1.0),
                  ("tiny tensors: restore / torch.load (time)",
                   med["tiny tensors: torchckpt restore (verify=full)"] / med["tiny tensors: torch.load"], "<= 0.5",
                   0.5)]
    if tied is not None:
        found.append(("tied GPT-2 small: tensor bytes on disk / unique storage bytes",
                      tied["tensor_bytes_on_disk"] / tied["unique_storage_bytes"], "<= 1.0", 1.0))
    return [(name, value, wanted, value <= limit) for name, value, wanted, limit in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="state size in MB (10**6 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="parent of the temp data dir (default: the system temp dir)")
    parser.add_argument("--warm", action="store_true", help="read from the page cache (no eviction)")
    parser.add_argument("--methods", default="raw,torch,dcp,torchckpt,hash",
                        help="comma-separated subset of raw,torch,dcp,torchckpt,hash (targets need raw,torchckpt)")
    parser.add_argument("--tiny", type=int, default=0, help="also N tiny tensors against torch.save/load")
    parser.add_argument("--tied-gpt2", action="store_true", help="also a tied GPT-2 small's bytes on disk")
    parser.add_argument("--out", default=None, help="results file (default: bench/state/results/throughput.json)")
    args = parser.parse_args()
    record = run_record(os.path.dirname(os.path.abspath(__file__)), command=" ".join([os.path.basename(
        sys.executable), *sys.argv]))
    warnings.filterwarnings("ignore")  # dcp without a process group warns on every call
    model, optimizer, nbytes = build_state(args.mb)
    root = tempfile.mkdtemp(prefix="torchckpt-throughput-", dir=args.dir)
    bench = None
    try:
        bench = Bench(root, model, optimizer, nbytes, args.warm)
        methods = {"raw": bench.raw, "torch": bench.torch_save, "dcp": bench.dcp, "torchckpt": bench.torchckpt,
                   "hash": bench.hash_only}
        chosen_names = args.methods.split(",")
        chosen = [methods[name] for name in sorted(chosen_names, key=list(methods).index)]  # raw first
        if args.tiny:
            chosen.append(lambda: bench.tiny(args.tiny))
        for repeat in range(args.repeats):
            # every write of the repeat first, then every read, the raw read first and last: reads right
            # after gigabytes of writes are slower on a virtual disk, and all reads should see the same disk
            reads = [read for method in chosen for read in method()]
            raw_reads = reads[:1] if "raw" in chosen_names else []
            others = reads[len(raw_reads):]
            if repeat % 2:  # every other repeat in reverse order: no reader always comes first
                others.reverse()
            bench.load_averages.append(os.getloadavg()[0])
            for read in raw_reads + others + raw_reads:
                bench.timed("touch fresh memory of the state's size (page faults, for reference)", bench.touch)
                read()
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        tied = tied_gpt2(root) if args.tied_gpt2 else None
    finally:
        for ckpt in (bench.async_ckpt, bench.staged_ckpt) if bench is not None else ():
            if ckpt is not None:
                ckpt.close()
        shutil.rmtree(root, ignore_errors=True)

    rows = {}
    for name, seconds in bench.times.items():
        median = statistics.median(seconds)
        rows[name] = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds),
                      "mb_per_s": (nbytes / MB / median if median > 0 and not name.startswith(("training step", "tiny"))
                                   else None),
                      "seconds": seconds}
    med = {name: row["median_s"] for name, row in rows.items()}
    save = f"torchckpt save (sync, {DEFAULT_HASH_ALGORITHM})"
    targets = [
        ("torchckpt sync save / raw write (throughput)", med["raw write (write+fsync)"] / med[save], ">= 0.8"),
        ("torchckpt async blocking / sync save (time)",
         med["torchckpt save (async, blocking part)"] / med[save], "<= 0.10"),
        ("torchckpt async_staging blocking (call + step wait) / sync save (time)",
         med["torchckpt save (async_staging, blocking part: call + wait)"] / med[save], "<= 0.10"),
        ("torchckpt restore verify=full / raw read (throughput)",
         med["raw read"] / med["torchckpt restore (verify=full)"], ">= 0.8"),
        ("torchckpt restore verify=fast / raw read (throughput)",
         med["raw read"] / med["torchckpt restore (verify=fast, no hashing)"], ">= 0.8"),
    ] if "raw read" in med and save in med else []
    plain_step = "training step, no save in flight"
    slowdowns = {name: med[name] / med[plain_step] for name in med if name.startswith("training step, a")}
    largest = max(t.numel() * t.element_size() for t in bench._tensors())
    against_torch = torch_targets(med, bench, largest, tied)
    restore_full, peer = "torchckpt restore (verify=full)", "torch.load + load_state_dict (fresh model+optimizer)"
    hint = f"{save}, without the writeback hint"
    context = {  # not targets: where a restore's time goes, against torch doing the same whole job
        **({"sync save / the same save without the writeback hint": med[save] / med[hint]} if hint in med else {}),
        "restore verify=full / (torch.load + load_state_dict into a fresh model+optimizer)":
            med[restore_full] / med[peer],
        "torchckpt read+verify=full+decode only / torch.load":
            med["torchckpt read+verify=full+decode only (no load_state_dict)"] / med["torch.load"],
    } if restore_full in med and peer in med else {}
    results = {
        **record, "tiny_tensors": args.tiny, "tied_gpt2": tied, "largest_tensor_bytes": largest,
        "restore_peak_rss_over_state_bytes": bench.rss_over_state,
        "against_torch": [{"ratio": name, "value": value, "target": wanted, "met": met}
                          for name, value, wanted, met in against_torch],
        "restore_context_ratios": context,
        "load_average_1min_at_each_repeat": bench.load_averages,
        "state_bytes": nbytes, "repeats": args.repeats, "cold_reads": not args.warm, "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "rows": rows,
        "targets": [{"ratio": name, "value": value, "target": target,
                     "met": value >= 0.8 if target.startswith(">=") else value <= 0.10}
                    for name, value, target in targets],
        "training_step_over_step_without_save": slowdowns,
    }
    print(f"state: {nbytes / MB:.0f} MB, {args.repeats} interleaved repeats, "
          f"reads {'warm (page cache)' if args.warm else 'cold (evicted from page cache)'}\n")
    print("| method | MB/s (median) | median s | min-max s |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        mb_per_s = "-" if row["mb_per_s"] is None else f"{row['mb_per_s']:.0f}"
        print(f"| {name} | {mb_per_s} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} |")
    print("\n| target | value | wanted | met |")
    print("|---|---|---|---|")
    for target in results["targets"]:
        met = "yes" if target["met"] else "no"
        print(f"| {target['ratio']} | {target['value']:.2f} | {target['target']} | {met} |")
    for name, value, wanted, met in against_torch:
        print(f"| {name} | {value:.2f} | {wanted} | {'yes' if met else 'no'} |")
    for name, ratio in context.items():
        print(f"| {name} (not a target) | {ratio:.2f} | | |")
    for name, ratio in slowdowns.items():
        print(f"\n{name} / no save in flight: {ratio:.2f} (median {med[name]:.3f} s vs {med[plain_step]:.3f} s)")
    if tied is not None:
        print(f"\ntied GPT-2 small: {tied}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "throughput.json")
    results["load_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
