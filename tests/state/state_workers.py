"""Real-process workers for the state tests (kill -9 trials, interrupted training runs).

Run as a script: ``python state_workers.py MODE ...``. Also imported by the tests
(and by bench/state/kill9_soak.py) for the reference computations, so the
reference and the workers run the very same code.

Modes:
  train RUN_DIR LOSSES_PATH VARIANT TOTAL_STEPS   train with checkpoints; resume if any
  zygote                                          fork kill-9 writers on request (stdin)
  verify-trials JSON_LIST                         fresh process: restore each trial dir, compare
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

# ----- interrupted training runs ------------------------------------------------------------

VARIANTS: dict[str, dict[str, Any]] = {
    "adamw-onecycle-sync": {"optimizer": "adamw", "scheduler": "onecycle", "async_save": False, "preempt": False},
    "sgd-step-async": {"optimizer": "sgd", "scheduler": "step", "async_save": True, "preempt": False},
    "adamw-step-preempt": {"optimizer": "adamw", "scheduler": "step", "async_save": True, "preempt": True},
    # The same with two DataLoader workers, preempted by a SIGTERM to the whole process group.
    "adamw-step-preempt-workers": {"optimizer": "adamw", "scheduler": "step", "async_save": True, "preempt": True,
                                   "workers": 2},
    "adamw-onecycle-staged": {"optimizer": "adamw", "scheduler": "onecycle", "async_save": True,
                              "async_staging": True, "preempt": False},
    # The built-in GPT (tiny, dropout 0.1) on a fixed random token dataset, saved every 2 steps.
    "gpt-adamw-warmcosine-sync": {"model": "gpt", "optimizer": "adamw", "scheduler": "warmcosine",
                                  "async_save": False, "preempt": False, "every": 2},
}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_training(variant: str, total_steps: int):
    """Tiny MLP with dropout, optimizer, LR scheduler, shuffling StatefulDataLoader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    spec = VARIANTS[variant]
    seed_everything(1234)
    if spec.get("model") == "gpt":
        return build_gpt_training(total_steps)
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3)
    )
    if spec["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    if spec["scheduler"] == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total_steps)
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    generator = torch.Generator().manual_seed(99)
    inputs = torch.randn(60, 12, generator=generator)
    targets = torch.randint(0, 3, (60,), generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    loader = StatefulDataLoader(dataset, batch_size=8, shuffle=True,  # 8 batches/epoch, last one short
                                num_workers=spec.get("workers", 0))
    return model, optimizer, scheduler, loader


def build_gpt_training(total_steps: int):
    """``torchckpt.models.gpt("tiny", dropout=0.1)``, AdamW, linear warm-up then cosine decay
    (SequentialLR: nested scheduler state), a shuffling StatefulDataLoader over 22 fixed random
    sequences of 32 tokens, batch 4 (6 batches per epoch, the last one short)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchckpt.models import gpt

    model = gpt("tiny", dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=4)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - 4)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[4])
    tokens = torch.randint(0, model.config.vocab_size, (22, 33), generator=torch.Generator().manual_seed(99))
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    loader = StatefulDataLoader(dataset, batch_size=4, shuffle=True)
    return model, optimizer, scheduler, loader


def train_step(model, optimizer, scheduler, batch) -> torch.Tensor:
    inputs, targets = batch
    if inputs.is_floating_point():  # MLP features
        # Draw from every RNG stream, so a wrong restore of any of them changes the losses.
        noise = torch.from_numpy(np.random.standard_normal(inputs.shape).astype(np.float32))
        inputs = inputs + 0.01 * noise * random.random()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    else:  # GPT token ids; its dropout masks draw from torch's RNG
        loss = model(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


def run_training(run_dir: str, losses_path: str, variant: str, total_steps: int) -> None:
    from torchckpt.state import Checkpointer

    spec = VARIANTS[variant]
    model, optimizer, scheduler, loader = build_training(variant, total_steps)
    train_state = {"epoch": 0}
    options = {"keep_last": 2, "async_save": spec["async_save"], "async_staging": spec.get("async_staging", False)}
    options.update({"save_on_preemption": True} if spec["preempt"] else {"save_every_steps": spec.get("every", 1)})
    items = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader,
             "train_state": train_state}
    ckpt = Checkpointer(run_dir, **options) if run_dir != "-" else None  # "-": the uninterrupted reference
    step = (ckpt.restore(**items) or 0) if ckpt is not None else 0
    log = open(losses_path, "a", buffering=1)  # noqa: SIM115 (kept open until the process is killed)
    log.write(f"restored {step}\n")
    model.train()
    while step < total_steps:
        for batch in loader:
            step += 1
            loss = train_step(model, optimizer, scheduler, batch)
            log.write(f"{step} {loss.item().hex()}\n")
            if ckpt is not None:
                ckpt.maybe_save(step, metrics={"loss": loss}, **items)
            if step >= total_steps:
                break
        else:
            train_state["epoch"] += 1
    if ckpt is not None:
        ckpt.close()
    log.write("finished\n")


# ----- kill -9 trials -----------------------------------------------------------------------

KILL_HIDDEN = 768


def build_big(seed: int = 7):
    seed_everything(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, KILL_HIDDEN), torch.nn.GELU(), torch.nn.Linear(KILL_HIDDEN, KILL_HIDDEN),
        torch.nn.GELU(), torch.nn.Linear(KILL_HIDDEN, 16),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def big_step(model, optimizer) -> None:
    inputs = torch.randn(16, 128)
    loss = model(inputs).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def kill_writer(run_dir: str, mode: str) -> None:
    """Train and save every step until killed (runs in a forked child); ``mode``: sync, async or staged."""
    from torchckpt.state import Checkpointer

    model, optimizer = build_big()
    ckpt = Checkpointer(run_dir, keep_last=2, async_save=mode != "sync", async_staging=mode == "staged")
    for step in range(1, 10_000):
        big_step(model, optimizer)
        ckpt.save(step, model=model, optimizer=optimizer, metrics={"step": step})


def reference_state(step: int) -> tuple[dict, dict, torch.Tensor]:
    """Model/optimizer state_dicts and torch RNG state after ``step`` training steps."""
    model, optimizer = build_big()
    for _ in range(step):
        big_step(model, optimizer)
    return model.state_dict(), optimizer.state_dict(), torch.get_rng_state()


def bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def zygote() -> None:
    """Read run dirs on stdin; fork a writer for each; print its pid; report when it dies."""
    import shutil
    import tempfile

    from torchckpt.state import Checkpointer

    torch.set_num_threads(1)
    warm_dir = tempfile.mkdtemp(prefix="torchckpt-zygote-")
    model, optimizer = build_big()  # warm up: lazy imports of the first optimizer step and save
    big_step(model, optimizer)
    with Checkpointer(warm_dir) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
    shutil.rmtree(warm_dir)
    print("zygote-ready", flush=True)
    for line in sys.stdin:
        run_dir, mode = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                kill_writer(run_dir, mode)
            finally:
                os._exit(3)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"dead {pid} {status}", flush=True)


def verify_trials(run_dirs: list[str]) -> list[dict[str, Any]]:
    """For each trial directory: every committed step is valid; restore gets the newest, bit-exact."""
    from torchckpt.state import Checkpointer, verify_checkpoint

    reports = []
    for run_dir in run_dirs:
        leftovers = sorted(n for n in os.listdir(run_dir) if n.startswith(".tmp-")) if os.path.isdir(run_dir) else []
        infos = verify_checkpoint(run_dir, verify="full")
        model, optimizer = build_big(seed=0)  # different init: restore must overwrite it
        with Checkpointer(run_dir) as ckpt:
            restored = ckpt.restore(model=model, optimizer=optimizer, rng=False)
            cleaned = not any(n.startswith(".tmp-") for n in os.listdir(run_dir))
        report = {
            "run_dir": run_dir,
            "leftover_tmp": len(leftovers),
            "steps": [info.step for info in infos],
            "invalid": [info.problem for info in infos if not info.valid],
            "restored": restored,
            "cleaned": cleaned,
            "equal": None,
        }
        if restored is not None:
            ref_model, ref_opt, _ = reference_state(restored)
            report["equal"] = bitwise_equal(model.state_dict(), ref_model) and bitwise_equal(
                optimizer.state_dict(), ref_opt
            )
        reports.append(report)
    return reports


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


def run_kill_trials(base_dir: str, trials: int, seed: int, max_delay_s: float = 0.5) -> list[dict[str, Any]]:
    """Kill -9 ``trials`` writers (by trial number: sync, async, async_staging saves in turn) at random moments,
    then verify every run dir in a fresh process.

    Writers are forked from one zygote process that imported torch once, so a trial
    costs its random delay, not an interpreter start-up. Each writer is a real
    process, killed with SIGKILL by this one.
    """
    import signal
    import subprocess
    import time

    rng = random.Random(seed)
    zygote_proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "zygote"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_worker_env(),
    )
    run_dirs, statuses = [], []
    try:
        assert zygote_proc.stdout.readline().strip() == "zygote-ready"
        for trial in range(trials):
            run_dir = os.path.join(base_dir, f"trial-{trial:04d}")
            run_dirs.append(run_dir)
            mode = ("sync", "async", "staged")[trial % 3]  # two thirds of the writers save in the background
            zygote_proc.stdin.write(f"{run_dir} {mode}\n")
            zygote_proc.stdin.flush()
            pid = int(zygote_proc.stdout.readline().split()[1])
            time.sleep(rng.uniform(0.02, max_delay_s))
            os.kill(pid, signal.SIGKILL)
            statuses.append(int(zygote_proc.stdout.readline().split()[2]))
    finally:
        zygote_proc.stdin.close()
        zygote_proc.wait(timeout=30)
    verifier = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "verify-trials", json.dumps(run_dirs)],
        check=False, capture_output=True, text=True, env=_worker_env(), timeout=600,
    )
    if verifier.returncode != 0:
        raise RuntimeError(f"verifier failed:\n{verifier.stderr[-4000:]}")
    reports = json.loads(verifier.stdout.strip().splitlines()[-1])
    for report, status in zip(reports, statuses):
        report["killed_by_sigkill"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return reports


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    mode = argv[0]
    if mode == "train":
        run_training(argv[1], argv[2], argv[3], int(argv[4]))
    elif mode == "zygote":
        zygote()
    elif mode == "verify-trials":
        print(json.dumps(verify_trials(json.loads(argv[1]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
