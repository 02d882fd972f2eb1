"""``torchckpt train``: a character-level GPT on the Python standard library, planned under a budget, resumable.

Rules kept here (named in ``docs/design.md``):

1. **[planning never changes the run]** Planning never changes the training run: it works on the real
   model but puts parameters, buffers and the torch RNG back (``planning.preserved_state``), so a run
   that plans and one that reuses a saved plan are bitwise alike, and so is a run with any plan
   (Note: [planning changes nothing], Note: [checkpointing is exact]).
2. **[everything the next step needs is saved]** Everything the next step depends on is in the
   checkpoint: model, AdamW, LR schedule, data loader position (seeded sampler), RNG streams; the loss
   log is cut back to the restored step on resume, so it always reads as one uninterrupted run.
3. **[a run directory belongs to one run]** A run directory belongs to one run: ``run.json`` records
   the options that define it; a command with different ones is refused, naming the option
   (``--steps``, ``--save-every``, ``--budget`` may change: more steps continue the run, a new budget
   makes a new plan).
4. **[preemption saves and exits cleanly]** Ctrl-C / SIGTERM only set a flag; the step in progress
   finishes, the state is saved, the process exits with code 0
   (``Checkpointer(save_on_preemption=True)``).
"""

from __future__ import annotations

import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchckpt._progress import phase, reporting
from torchckpt._units import format_bytes
from torchckpt.executor import CheckpointHandle, wrap_forward
from torchckpt.executor.optimizer_offload import state_offload_of
from torchckpt.memory import MemoryMeter
from torchckpt.models import BatchShape, ModelSpecError, gpt, load_model
from torchckpt.planner import Plan, apply_plan, default_loss, preserved_state
from torchckpt.planner.blocks import resolve_blocks
from torchckpt.state import Checkpointer
from torchckpt.train.config import TrainConfig
from torchckpt.train.data import ByteChunks, load_stdlib_corpus, make_loader
from torchckpt.train.distributed import Ranks, join_process_group, shard_model
from torchckpt.train.plan_record import RECORD_ITEM
from torchckpt.train.planning import plan_job
from torchckpt.train.progress import Display, QuietDisplay, StepReport, make_display
from torchckpt.train.records import LossLog, NotSaved
from torchckpt.train.resumed import restore_and_say
from torchckpt.train.status import reported

__all__ = ["WARMUP_STEPS", "TrainError", "build_model", "format_summary", "train"]

WARMUP_STEPS = 20  # linear LR warm-up; independent of --steps, so a longer run continues a shorter one
VALIDATION_BATCHES = 8
SAMPLE_PROMPT = b"def "
SAMPLE_BYTES = 240


class TrainError(ValueError):
    """A training run cannot start as asked; the message names the option and the fix."""


def build_model(config: TrainConfig) -> tuple[nn.Module, str]:
    """The built-in GPT of ``config.size`` or the user's ``--model path.py:factory``, and a description.

    Example:
        >>> model, text = build_model(TrainConfig(size="tiny"))
        >>> text
        "gpt('tiny'): 2 layers x 64, 0.13M parameters, dropout 0.1"
    """
    model: nn.Module
    if config.model is None:
        model = gpt(config.size, dropout=config.dropout)
        text = f"gpt({config.size!r}): {model.config.n_layer} layers x {model.config.d_model}"
    else:
        try:
            model, _ = load_model(config.model, BatchShape(batch_size=config.batch_size, seq_len=config.seq_len))
        except ModelSpecError as error:
            raise TrainError(str(error)) from None
        except Exception as error:  # noqa: BLE001 - the user's file or factory may raise anything: one line
            raise TrainError(f"--model {config.model}: building the model failed with "
                             f"{type(error).__name__}: {error}") from None
        if not isinstance(model, nn.Module):
            raise TrainError(f"--model {config.model}: the factory returned a {type(model).__name__}, not an "
                             "nn.Module (return the model, or (model, example_inputs))")
        text = f"{config.model} ({type(model).__name__})"
    params = sum(p.numel() for p in model.parameters())
    dropout = f", dropout {config.dropout}" if config.model is None else ""
    return model, f"{text}, {params / 1e6:.2f}M parameters{dropout}"


def _check_identity(run_dir: Path, config: TrainConfig) -> dict[str, Any]:
    """[a run directory belongs to one run]: read (or write) run.json; refuse options that differ from the
    run in this directory."""
    path = run_dir / "run.json"
    wanted = config.identity()
    if not path.is_file():  # written once planning succeeds (_plan), so a failed start leaves no claim
        return {"identity": wanted, "plan_budget": None}
    record = json.loads(path.read_text())
    for name, value in record["identity"].items():
        if wanted.get(name) != value:
            option = "--" + name.replace("_", "-")
            raise TrainError(f"{run_dir} holds a run with {option} {value!r}; this command has {option} "
                             f"{wanted.get(name)!r}. Fix: repeat the run's options to resume it, or pass a new "
                             f"--dir to start another run")
    return record


def _loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = default_loss(model(ids, targets))
    if loss.dim() != 0:
        raise TrainError("the model's loss is not a scalar; model(ids, targets) must return the mean loss")
    return loss


def _measure_baselines(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                       every_block: list[nn.Module] | None) -> dict[str, float]:
    """Peak and time of one uncheckpointed step with AdamW state alive, and (``every_block``: the plan's blocks)
    of one step with each of those blocks under ``torch.utils.checkpoint`` (torch's own one-liner, the peer a
    budget below it is measured against) ([planning never changes the run])."""
    baselines: dict[str, float] = {}
    phase("measuring the peers: no checkpointing" + (", every block under torch's checkpoint" if every_block else ""))
    with preserved_state(model):
        model.train()
        throwaway = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
        for name, blocks in (("", []), ("every_block_", every_block)):
            if blocks is None:
                continue
            wrapped: list[nn.Module] = []  # torch's own checkpoint, wrapped as the executor wraps (and undone)
            for block in blocks:
                wrap_forward(block, functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                                      use_reentrant=False), wrapped)
            try:
                for _ in range(2):  # the first step creates AdamW's state (and warms up); the second is measured
                    start = time.perf_counter()
                    with MemoryMeter() as meter:
                        _loss_of(model, *batch).backward()
                        throwaway.step()
                        throwaway.zero_grad(set_to_none=True)
                    step_s = time.perf_counter() - start
            finally:
                CheckpointHandle(wrapped).remove()
            baselines.update({f"{name}peak_bytes": meter.peak_bytes, f"{name}step_s": step_s})
        del throwaway
    return baselines


@torch.no_grad()
def _validation_loss(model: nn.Module, dataset: ByteChunks, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    count = min(VALIDATION_BATCHES, len(dataset) // batch_size)
    losses = [_loss_of(model, *dataset.batch(range(i * batch_size, (i + 1) * batch_size))).item()
              for i in range(max(count, 1))]
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def _sample(model: nn.Module, seq_len: int, seed: int) -> str:
    """Generate text from SAMPLE_PROMPT with a private generator (the training RNG is untouched)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(SAMPLE_PROMPT)], dtype=torch.long)
    try:
        for _ in range(SAMPLE_BYTES):
            try:
                logits = model(ids[:, -seq_len:])
            except TypeError as error:  # e.g. a user model whose forward requires targets
                return f"(no sample: model(ids) failed: {error})"
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                return "(no sample: model(ids) does not return logits of shape [batch, seq, vocab])"
            probs = torch.softmax(logits[0, -1].float() / 0.8, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator).view(1, 1)], dim=1)
    finally:
        model.train(was_training)
    text = bytes(ids[0].tolist()).decode("utf-8", errors="replace")
    return "".join(c if (c.isprintable() and c != "\ufffd") or c == "\n" else "?" for c in text.replace("\t", "    "))


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run report as text.

    Example:
        >>> text = format_summary({"step": 2, "train_loss": 3.0, "validation_loss": 3.1, "sample": "def x",
        ...     "peak_bytes": 80, "budget_bytes": 100, "predicted_peak_bytes": 90, "plain_peak_bytes": 200,
        ...     "predicted_extra_s": 0.1, "plain_step_s": 1.0, "mean_step_s": 1.2, "checkpoints": "runs/x",
        ...     "checkpoint_steps": [2]})
        >>> "60% less" in text, "recomputation per step" in text
        (True, True)
        >>> summary = {"step": 2, "train_loss": 3.0, "validation_loss": 3.1, "sample": "", "peak_bytes": 80,
        ...     "budget_bytes": 100, "predicted_peak_bytes": 90, "plain_peak_bytes": 200, "predicted_extra_s": 0.1,
        ...     "plain_step_s": 1.0, "mean_step_s": None, "every_block_peak_bytes": 120,
        ...     "every_block_step_s": 1.3, "checkpoints": "runs/x", "checkpoint_steps": []}
        >>> format_summary(summary).splitlines()[1].split("; ")[-1]
        'checkpointing every block (torch.utils.checkpoint) 120 B: does not fit this budget'
        >>> "recomputation and host copies per step" in format_summary({**summary, "offloaded_blocks": 2})
        True
    """
    s = summary
    saving = 1 - s["peak_bytes"] / max(s["plain_peak_bytes"], 1)
    within = "within" if s["peak_bytes"] <= s["budget_bytes"] else "OVER"
    overhead = s["predicted_extra_s"] / max(s["plain_step_s"], 1e-9)
    measured = s["mean_step_s"] / max(s["plain_step_s"], 1e-9) - 1 if s.get("mean_step_s") else float("nan")
    sample = "\n".join("    " + line for line in s["sample"].splitlines())
    every_block_peak = every_block_time = ""
    if s.get("every_block_peak_bytes"):  # torch.utils.checkpoint on every block of the plan, measured once
        fits = "fits" if s["every_block_peak_bytes"] <= s["budget_bytes"] else "does not fit"
        every_block_peak = (f"; checkpointing every block (torch.utils.checkpoint) "
                            f"{format_bytes(s['every_block_peak_bytes'])}: {fits} this budget")
        every_block_time = f"; every block checkpointed {s['every_block_step_s']:.2f} s"
    return "\n".join([
        (f"step {s['step']}: train loss {s['train_loss']:.4f}, validation loss {s['validation_loss']:.4f} "
         f"(uniform guess over bytes: {math.log(256):.2f})"),
        (f"memory: measured peak {format_bytes(s['peak_bytes'])} ({within} budget {format_bytes(s['budget_bytes'])}; "
         f"predicted {format_bytes(s['predicted_peak_bytes'])}); without checkpointing "
         f"{format_bytes(s['plain_peak_bytes'])}: {saving:.0%} less" + every_block_peak),
        (f"time: the plan predicts +{s['predicted_extra_s'] * 1e3:.0f} ms of recomputation"
         f"{' and host copies' if s.get('offloaded_blocks') else ''} per step = "
         f"{overhead:+.0%} of an uncheckpointed step ({s['plain_step_s']:.2f} s, measured once"
         f"{every_block_time}); "
         + (f"measured mean step {s['mean_step_s']:.2f} s ({measured:+.0%})" if s.get("mean_step_s")
            else "mean step not measured (the first step of a process is not timed)")),
        "sample (temperature 0.8):",
        sample,
        (f"checkpoints: {s['checkpoints']} (steps {', '.join(map(str, s['checkpoint_steps']))})"
         if s["checkpoint_steps"] else f"checkpoints: none ({s['checkpoints']})"),
    ])


def train(config: TrainConfig, *, say: Callable[[str], None] = print, display: Display | None = None,
          live: bool | None = None) -> dict[str, Any]:
    """Run (or resume, or report) the training run ``config`` describes; returns the summary.

    The measured peak covers the whole step: forward, backward, gradient clipping and the AdamW update.
    The plan's budget covers forward and backward with AdamW state alive; when parameters dominate
    (tiny models, tiny batches), the AdamW update's own temporaries can peak above it.

    Example:
        >>> import tempfile, torch
        >>> tmp, threads = tempfile.TemporaryDirectory(), torch.get_num_threads()
        >>> config = TrainConfig(size="tiny", batch_size=4, seq_len=64, steps=2, save_every=2, budget="90%",
        ...                      dir=tmp.name, threads=1)
        >>> summary = train(config, say=lambda text: None, live=False)  # doctest: +ELLIPSIS
        step 1/2 ...
        step 2/2 ...
        saved step 2 to ...
        >>> summary["step"], summary["peak_bytes"] <= summary["budget_bytes"]
        (2, True)
        >>> tmp.cleanup(); torch.set_num_threads(threads)
    """
    run_dir = config.run_dir
    record = _check_identity(run_dir, config)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    # train/distributed.py's [the main job runs on torchrun]
    ranks = join_process_group(timeout_s=config.rendezvous_timeout)
    if ranks is not None and not ranks.leader:  # train/distributed.py's [rank 0 speaks for the run]
        say, display, live = (lambda text: None), QuietDisplay(), False
    checkpointer: Checkpointer | NotSaved = (
        Checkpointer(run_dir / "checkpoints", keep_last=3, save_every_steps=config.save_every,
                     save_on_preemption=True) if config.save else NotSaved())
    try:
        finished = _finished_summary(config, checkpointer)
        if finished is not None:
            say(f"{run_dir} holds a finished run (step {finished['step']} of --steps {config.steps}); not training "
                f"again. To train further, give more steps with the same options (e.g. `torchckpt train --steps "
                f"{finished['step'] * 2}`): the run continues from step {finished['step']}.")
            say(format_summary(finished))
            return finished
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        model, description = build_model(config)
        if ranks is not None:
            shard_model(model, resolve_blocks(model, "auto"))
            description += f"; FSDP2 over {ranks.world} processes (fully_shard per block), budget per process"
        corpus = load_stdlib_corpus()
        train_set = ByteChunks(corpus.train, config.seq_len)
        validation_set = ByteChunks(corpus.validation, config.seq_len)
        if len(validation_set) < config.batch_size:
            raise TrainError(f"the validation text holds {len(validation_set)} sequences of --seq-len "
                             f"{config.seq_len}, fewer than --batch-size {config.batch_size}; lower either")
        loader = make_loader(train_set, config.batch_size, config.seed, *((ranks.rank, ranks.world) if ranks else ()))
        say(f"model: {description}")
        say(f"text: {corpus.describe()}")
        return _run(config, record, model, train_set, validation_set, loader, checkpointer, say, display, live,
                    ranks)
    finally:
        checkpointer.close()
        if ranks is not None:  # train/distributed.py's [the job exits in bounded time]
            ranks.leave(failed=sys.exc_info()[0] is not None)


def _finished_summary(config: TrainConfig, checkpointer: Checkpointer | NotSaved) -> dict[str, Any] | None:
    """The saved summary when the newest checkpoint is at or past --steps and the summary describes it."""
    latest = checkpointer.latest_step()
    path = config.run_dir / "summary.json"
    if latest is None or latest < config.steps or not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("step") == latest else None


def _loader_resident(loader: Any) -> torch.Tensor | None:
    """A stand-in for what the loader holds through each epoch beside its batches: torchdata's ``RandomSampler``
    keeps its generator's state (a 5,056-byte tensor) from an epoch's first batch on, to resume mid-epoch. A plan
    the profiler measured keeps no margin, so without it a run at the no-checkpointing budget measured that much
    over its budget."""
    generator = getattr(getattr(loader, "sampler", None), "generator", None)
    return generator.get_state() if isinstance(generator, torch.Generator) else None


def _run(config: TrainConfig, record: dict[str, Any], model: nn.Module, train_set: ByteChunks,
         validation_set: ByteChunks, loader: Any, checkpointer: Checkpointer | NotSaved,
         say: Callable[[str], None], display: Display | None, live: bool | None, ranks: Ranks | None) -> dict[str, Any]:
    run_dir = config.run_dir
    example = train_set.batch(range(config.batch_size))
    resident = _loader_resident(loader)  # alive while planning, so the plan counts what the loader will hold
    with reported("torchckpt train", live=live, quiet=ranks is not None and not ranks.leader):  # on stderr
        plan, stored = plan_job(config, record, model, example, checkpointer, ranks, _measure_baselines, say)
    baseline = stored.baseline
    del example, resident  # profiled as the step's batch; kept alive beside the loader's batches it would count twice
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.01)
    handle = apply_plan(model, plan, optimizer)  # with plan.optimizer_offload, AdamW's state in host memory
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / WARMUP_STEPS, total_iters=WARMUP_STEPS)
    progress = {"peak_bytes": 0, "timed_steps": 0, "timed_s": 0.0, "last_loss": float("nan"),
                "plan_budget_bytes": plan.budget_bytes}
    items = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "progress": progress}
    with reported("torchckpt train", live=live, quiet=ranks is not None and not ranks.leader):  # a restore's bytes
        step = restore_and_say(checkpointer, items, say)
    items[RECORD_ITEM] = stored.record()  # plan_record.py's [a plan follows the job]: saved with every step
    if step and progress.get("plan_budget_bytes") != plan.budget_bytes:  # a new plan: its peak and times afresh
        progress.update(peak_bytes=0, timed_steps=0, timed_s=0.0, plan_budget_bytes=plan.budget_bytes)
    if step < config.steps:
        step = _train_steps(config, plan, step, items, checkpointer, display, live, ranks)
    elif step > config.steps:
        say(f"{run_dir} is already at step {step}, beyond --steps {config.steps}; reporting it")
    if checkpointer.latest_step() != step:
        checkpointer.save(step, **items, metrics={"loss": progress["last_loss"]})
    checkpointer.wait()
    checkpoint_steps = [info.step for info in checkpointer.list() if info.valid]
    summary = {
        "step": step, "train_loss": progress["last_loss"],
        "validation_loss": _validation_loss(model, validation_set, config.batch_size),
        "sample": _sample(model, config.seq_len, config.seed),
        "peak_bytes": ranks.largest(int(progress["peak_bytes"])) if ranks else progress["peak_bytes"],
        "budget_bytes": plan.budget_bytes, "predicted_peak_bytes": plan.predicted_peak_bytes,
        "plain_peak_bytes": baseline["peak_bytes"], "predicted_extra_s": plan.predicted_extra_time_s,
        "plain_step_s": baseline["step_s"],
        "mean_step_s": progress["timed_s"] / progress["timed_steps"] if progress["timed_steps"] else None,
        "checkpoints": str(checkpointer.directory), "checkpoint_steps": checkpoint_steps,
    }
    summary.update({key: baseline[key] for key in ("every_block_peak_bytes", "every_block_step_s") if key in baseline})
    offloaded = sum(1 for piece in plan.schedule if getattr(piece, "offload", False))
    if offloaded:  # the predicted extra time is then the copies' too
        summary["offloaded_blocks"] = offloaded
    if ranks is not None:
        summary["processes"] = ranks.world
    moved = state_offload_of(optimizer)
    if moved is not None:  # the run is over: AdamW's state is not copied next to the parameters at the end
        moved.remove(to_device=False)
    handle.remove()
    if ranks is None or ranks.leader:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    say(format_summary(summary))
    return summary


def _train_steps(config: TrainConfig, plan: Plan, step: int, items: dict[str, Any],
                 checkpointer: Checkpointer | NotSaved, display: Display | None, live: bool | None,
                 ranks: Ranks | None) -> int:
    model, optimizer, scheduler, loader, progress = (items[k] for k in ("model", "optimizer", "scheduler", "loader",
                                                                          "progress"))
    log = LossLog(config.run_dir / "losses.jsonl", keep_through_step=step) if ranks is None or ranks.leader else None
    display = display or make_display(config.steps, live)
    tokens = config.batch_size * config.seq_len * (ranks.world if ranks else 1)  # every process's batch
    recent_s: list[float] = []
    first_of_session = True
    epoch = 0
    try:
        while step < config.steps:
            if hasattr(loader.sampler, "set_epoch"):  # the distributed sampler: a new shuffle each epoch
                loader.sampler.set_epoch(epoch)
            epoch += 1
            for ids, targets in loader:
                step += 1
                start = time.perf_counter()
                with MemoryMeter() as meter:
                    loss = _loss_of(model, ids, targets)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    value = loss.item()
                    del loss
                step_s = time.perf_counter() - start
                # train/distributed.py's [rank 0 speaks for the run]: the mean of the ranks' losses
                if ranks is not None:
                    value = ranks.mean(value)
                if not first_of_session:  # the first step of a process pays for allocation and warm-up
                    progress["timed_steps"] += 1
                    progress["timed_s"] += step_s
                first_of_session = False
                recent_s = (recent_s + [step_s])[-10:]
                progress["peak_bytes"] = max(progress["peak_bytes"], meter.peak_bytes)
                progress["last_loss"] = value
                if log is not None:
                    log.write(step, value)
                next_save = min(config.steps, (step // config.save_every + 1) * config.save_every)
                mean_s = sum(recent_s) / len(recent_s)
                display.step(StepReport(step=step, total_steps=config.steps, loss=value, tokens_per_s=tokens / step_s,
                                        peak_bytes=meter.peak_bytes, budget_bytes=plan.budget_bytes,
                                        next_checkpoint_step=next_save if config.save else None,
                                        next_checkpoint_s=(next_save - step) * mean_s))
                if not math.isfinite(value):
                    raise TrainError(f"the loss is {value} at step {step}; lower --lr (now {config.lr})")
                with reporting(display):  # a save's bytes, on the display
                    if checkpointer.maybe_save(step, metrics={"loss": value}, **items):
                        display.message(f"saved step {step} to {checkpointer.directory}")
                if step >= config.steps:
                    break
    except SystemExit:  # [preemption saves and exits cleanly]: the Checkpointer saved and asks to exit
        display.close()
        print(f"stopped at step {step}; run the same command again to resume from there", flush=True)
        raise
    finally:
        display.close()
        if log is not None:
            log.close()
    return step
