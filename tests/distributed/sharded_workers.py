"""Workers of the sharded-checkpoint tests: spawned gloo ranks that train a small model under FSDP2, DDP or
neither, save or restore it with torchckpt, and write what they saw to ``out_dir/<rank>.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from torchckpt import Checkpointer
from torchckpt._testing import spawn_processes
from torchckpt.state.format.codec import split_tensors

WIDTH = 33  # odd: FSDP2 shards it unevenly on 2 and 4 ranks


def build(mode: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small MLP wrapped for ``mode`` ("fsdp2", "ddp" or "single") and its AdamW."""
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(nn.Linear(12, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                     nn.Linear(WIDTH, 5))
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, first: int, count: int, rank: int) -> list[float]:
    """``count`` steps on batches that depend on the step number and rank only."""
    losses = []
    for step in range(first, first + count):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 12, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, gathered whole (rank 0 gets them; flat keys)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    _, model_tensors = split_tensors(model_state, "model")
    _, optim_tensors = split_tensors(optim_state, "optimizer")
    flat = {**{f"model.{k}": v for k, v in model_tensors.items()},
            **{f"optimizer.{k}": v for k, v in optim_tensors.items()}}
    return {key: tensor.clone() for key, tensor in flat.items()}  # a CPU step count is the live tensor otherwise


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's own part of the parameters and optimizer state (a DTensor's local shard)."""
    from torchckpt._host import local_part

    tensors = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values()
                                       if isinstance(t, torch.Tensor))]
    return sum(local_part(t).numel() * t.element_size() for t in tensors)


def join(rank: int, world: int, port: int) -> None:
    if world > 1 or os.environ.get("TORCHCKPT_TEST_GROUP_OF_ONE"):
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def save_worker(rank: int, port: int, out_dir: str, world: int, mode: str, directory: str,
                options: dict[str, Any]) -> None:
    """Train 3 steps, save step 3 (model, optimizer, extras), write the full state to ``ref.safetensors``."""
    join(rank, world, port)
    model, optimizer = build(mode, seed=0)
    losses = train_steps(model, optimizer, 1, 3, rank)
    extras = {"epoch": 2, "rank_note": rank if options.get("per_rank_extras") else 0}
    staging = {}
    with Checkpointer(directory, **options.get("checkpointer", {})) as ckpt:
        ckpt.save(3, model=model, optimizer=optimizer, extras=extras, metrics={"loss": losses[-1]})
        staging["staging_bytes"] = ckpt._staging.capacity_bytes  # async saves: this rank's host copy
    staging["local_bytes"] = local_bytes(model, optimizer)
    reference = full_state(model, optimizer)
    after = train_steps(model, optimizer, 4, 2, rank)
    if rank == 0:
        safetensors.torch.save_file(reference, os.path.join(directory, "..", "ref.safetensors"))
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"losses_after": after, **staging}))
    if dist.is_initialized():
        dist.destroy_process_group()


def restore_worker(rank: int, port: int, out_dir: str, world: int, mode: str, directory: str,
                   options: dict[str, Any]) -> None:
    """Build a differently initialised model, restore, compare the full state with ``ref.safetensors``."""
    import warnings

    join(rank, world, port)
    model, optimizer = build(mode, seed=1)
    extras: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(directory, **options.get("checkpointer", {})) as ckpt:
            step = ckpt.restore(model=model, optimizer=optimizer, extras=extras)
    restored = full_state(model, optimizer)
    result: dict[str, Any] = {"step": step, "extras": extras,
                              "warnings": [str(w.message) for w in caught if "restored on" in str(w.message)]}
    if rank == 0:
        reference = safetensors.torch.load_file(os.path.join(directory, "..", "ref.safetensors"))
        result["keys_equal"] = sorted(reference) == sorted(restored)
        result["unequal"] = [k for k in reference if k in restored and not torch.equal(reference[k], restored[k])]
        result["compared"] = len(reference)
    result["losses_after"] = train_steps(model, optimizer, 4, 2, rank)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


KILL_POINTS = ("before-write", "after-write", "vote", "commit")


def _arm(point: str) -> None:
    """Make this process SIGKILL itself at ``point`` of the next sharded save."""
    import signal

    from torchckpt.state.sharded import save as sharded
    from torchckpt.state.sharded import shard_storage

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point in ("before-write", "after-write"):
        original = shard_storage.ShardWriter.write_data

        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            if point == "before-write":
                die()
            result = original(self, plan, planner)
            die()
            return result

        shard_storage.ShardWriter.write_data = write_data  # type: ignore[method-assign]
    elif point == "vote":
        publish = sharded.RankGroup.publish

        def publish_or_die(self, key, value):  # type: ignore[no-untyped-def]
            if "/files/" in key:
                die()
            publish(self, key, value)

        sharded.RankGroup.publish = publish_or_die  # type: ignore[method-assign]
    else:
        commit = sharded._commit

        def commit_or_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            die()
            commit(*args, **kwargs)

        sharded._commit = commit_or_die


def kill_worker(rank: int, port: int, out_dir: str, world: int, directory: str, victim: int, point: str,
                timeout_s: float) -> None:
    """Save step 1, then step 2 while rank ``victim`` SIGKILLs itself at ``point``; survivors record the error."""
    import time

    join(rank, world, port)
    model, optimizer = build("fsdp2", seed=0)
    train_steps(model, optimizer, 1, 1, rank)
    ckpt = Checkpointer(directory, rank_timeout_s=timeout_s)
    ckpt.save(1, model=model, optimizer=optimizer)
    train_steps(model, optimizer, 2, 1, rank)
    if rank == victim:
        _arm(point)
    start = time.monotonic()
    result: dict[str, Any] = {}
    try:
        ckpt.save(2, model=model, optimizer=optimizer)
        result["error"] = None
    except BaseException as error:  # noqa: BLE001 (recorded for the test to judge)
        result.update(error=type(error).__name__, message=str(error)[:3000],
                      missing=getattr(error, "missing_ranks", None))
    result["seconds"] = time.monotonic() - start
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a gloo group with a dead member may hang at teardown: leave at once


def resume_worker(rank: int, port: int, out_dir: str, world: int, directory: str) -> None:
    """Restore the newest committed step after a save was killed."""
    join(rank, world, port)
    model, optimizer = build("fsdp2", seed=1)
    with Checkpointer(directory) as ckpt:
        step = ckpt.restore(model=model, optimizer=optimizer)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"step": step}))
    dist.destroy_process_group()


def dead_rank_trial(root: str, victim: int, point: str, timeout_s: float, world: int = 3) -> list[str]:
    """One trial: ``world`` ranks save step 1, rank ``victim`` is SIGKILLed at ``point`` of saving step 2, then a
    restarted job resumes. Returns the violations found (empty: the trial passed)."""
    directory = os.path.join(root, "ckpt")
    out, resumed = os.path.join(root, "kill"), os.path.join(root, "resume")
    os.makedirs(out)
    os.makedirs(resumed)
    problems = []
    codes = spawn_processes(kill_worker, world, directory, victim, point, timeout_s, out_dir=out,
                          deadline_s=3 * timeout_s + 60)
    if codes[victim] != -9:
        problems.append(f"rank {victim} exited with {codes[victim]}, not SIGKILL")
    hung = [rank for rank, code in enumerate(codes) if rank != victim and code != 0]
    if hung:
        problems.append(f"survivor(s) {hung} did not exit cleanly (codes {codes}): hung or crashed")
    for rank in range(world):
        path = Path(out, f"{rank}.json")
        if rank == victim or not path.exists():
            continue
        result = json.loads(path.read_text())
        if result["error"] is None:
            problems.append(f"rank {rank}: the save did not fail")
        elif f"[{victim}]" not in result["message"] and f"rank {victim} " not in result["message"]:
            problems.append(f"rank {rank}: the error does not name rank {victim}: {result['message'][:300]}")
        if result["seconds"] > 2 * timeout_s + 15:
            problems.append(f"rank {rank}: took {result['seconds']:.1f} s (timeout {timeout_s} s)")
    committed = sorted(p.name for p in Path(directory).glob("step-*"))
    if committed != ["step-000000001"]:
        problems.append(f"committed steps {committed}; expected only step-000000001")
    codes = spawn_processes(resume_worker, world, directory, out_dir=resumed, deadline_s=120)
    steps = [json.loads(Path(resumed, f"{r}.json").read_text())["step"] if Path(resumed, f"{r}.json").exists()
             else None for r in range(world)]
    if codes != [0] * world or steps != [1] * world:
        problems.append(f"resume: exit codes {codes}, restored steps {steps}; expected step 1 on every rank")
    if list(Path(directory).glob(".tmp-*")):
        problems.append("the killed save's temp directory was not cleaned at the restart")
    return problems


def failing_worker(rank: int, port: int, out_dir: str, world: int, directory: str, failing: int) -> None:
    """Save step 1; then rank ``failing`` cannot write its rank-local file of step 2 (an OSError, as a full
    disk gives); every rank records what it raised and how long it took."""
    import errno
    import time

    from torchckpt.state.sharded import save as sharded

    join(rank, world, port)
    model, optimizer = build("fsdp2", seed=0)
    train_steps(model, optimizer, 1, 1, rank)
    result: dict[str, Any] = {}
    with Checkpointer(directory, rank_timeout_s=60.0) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer, extras={"rank": rank})
        if rank == failing:
            def write_files_hashed(writer, files, algorithm):  # type: ignore[no-untyped-def]  # its rank-local files
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            sharded.write_files_hashed = write_files_hashed
        start = time.monotonic()
        try:
            ckpt.save(2, model=model, optimizer=optimizer, extras={"rank": rank})
            result["error"] = None
        except Exception as error:  # noqa: BLE001 (recorded for the test to judge)
            result.update(error=type(error).__name__, message=str(error)[:2000])
        result["seconds"] = time.monotonic() - start
        result["steps"] = [info.step for info in ckpt.list() if info.valid]
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def policy_worker(rank: int, port: int, out_dir: str, world: int, directory: str, scenario: str) -> None:
    """Ranks that must stay in step: ``"nan"``: rank 1 passes a NaN metric at step 1 only (its save fails before
    writing), then both save steps 2 and 3; ``"async"``: async saves every step with ``save_on_preemption``
    (``maybe_save`` agrees with the other ranks while the previous save is still writing). Records each step's
    outcome."""
    import time

    join(rank, world, port)
    model, optimizer = build("fsdp2", seed=0)
    log: list[list[Any]] = []
    options: dict[str, Any] = {"rank_timeout_s": 20.0, "capture_rng": False}
    if scenario == "async":
        options.update(async_save=True, save_every_steps=1, save_on_preemption=True, keep_last=2)
    with Checkpointer(directory, **options) as ckpt:
        for step in range(1, 13 if scenario == "async" else 4):
            train_steps(model, optimizer, step, 1, rank)
            time.sleep(0.003 * (step % 5) * rank)  # the ranks drift a little, as they do
            start = time.monotonic()
            try:
                if scenario == "async":
                    ckpt.maybe_save(step, model=model, optimizer=optimizer)
                else:
                    loss = float("nan") if (rank == 1 and step == 1) else 1.0
                    ckpt.save(step, model=model, optimizer=optimizer, metrics={"loss": loss})
                log.append([step, "ok", time.monotonic() - start])
            except Exception as error:  # noqa: BLE001 (recorded for the test to judge)
                log.append([step, f"{type(error).__name__}: {error}"[:300], time.monotonic() - start])
        ckpt.wait()
        steps = [info.step for info in ckpt.list() if info.valid]
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"log": log, "steps": steps}))
    dist.destroy_process_group()


def build_outside(kind: str, mode: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model nobody here wrote, from a config: ``"peft-gpt2"`` (LoRA on GPT-2: frozen base, tied embeddings)
    or ``"bert"`` (masked LM, decoder tied to the embeddings); FSDP2 per layer then root, DDP, or neither."""
    import transformers

    torch.manual_seed(seed)
    model: nn.Module
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4)
        model = transformers.BertForMaskedLM(config)
        layers = list(model.bert.encoder.layer)
    else:
        import peft

        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                    peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
        layers = list(model.base_model.model.transformer.h)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def outside_worker(rank: int, port: int, out_dir: str, world: int, kind: str, mode: str, directory: str,
                   phase: str) -> None:
    """``phase`` "save": train 2 steps, save step 2, write the full state; "restore": restore into a differently
    initialised model and compare its full state with the saved one (rank 0)."""
    import safetensors.torch

    join(rank, world, port)
    model, optimizer = build_outside(kind, mode, seed=0 if phase == "save" else 1)
    reference_path = os.path.join(directory, "..", "ref.safetensors")
    result: dict[str, Any] = {}
    if phase == "save":
        for step in range(2):
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with Checkpointer(directory) as ckpt:
            ckpt.save(2, model=model, optimizer=optimizer)
        reference = full_state(model, optimizer)
        if rank == 0:
            safetensors.torch.save_file(reference, reference_path)
    else:
        with Checkpointer(directory) as ckpt:
            result["step"] = ckpt.restore(model=model, optimizer=optimizer)
        restored = full_state(model, optimizer)
        if rank == 0:
            reference = safetensors.torch.load_file(reference_path)
            unequal = [key for key in reference if key in restored and not torch.equal(reference[key], restored[key])]
            result.update(keys_equal=sorted(reference) == sorted(restored), compared=len(reference), unequal=unequal)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
