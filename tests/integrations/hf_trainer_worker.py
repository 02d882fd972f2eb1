"""A tiny real transformers.Trainer run for test_hf_trainer.py, as a script (for kill -9 trials) or in-process.

    python hf_trainer_worker.py RUN_DIR LOSSES_PATH KILL_AT [MODE]

trains a 2-layer GPT-2 (dropout 0.1 everywhere) for 30 optimizer steps: 24 random token rows, batch 4 (6
steps per epoch, 5 epochs, shuffled), AdamW with a linear warmup/decay schedule, gradient clipping, logging
every step and evaluating on 8 rows every 4 steps. It appends ``kind global_step value.hex()`` lines to
LOSSES_PATH (``loss`` per step, ``eval`` per evaluation, ``start`` once with the global_step training
starts from) and SIGKILLs itself in step KILL_AT after its backward pass, before its optimizer step (-1:
never). MODE:

- ``torchckpt`` (default): ``hf_trainer.train(trainer)`` with ``TorchckptCallback(RUN_DIR, save_steps=4)``;
- ``plain``: ``trainer.train()`` without torchckpt (the reference run);
- ``no-rng``: as ``torchckpt``, but every restore leaves the RNG streams alone (a control);
- ``no-skip``: as ``torchckpt`` with ``ignore_data_skip=True`` (a control: the data position is lost);
- ``eager``: as ``torchckpt``, but a due step is saved at ``on_step_end``, before that step's evaluation
  draws from torch's RNG (a control for the module's rule [a step is saved where Trainer's resume restores it]).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import transformers

from torchckpt.integrations import hf_trainer
from torchckpt.state import Checkpointer

STEPS, SAVE_STEPS, EVAL_STEPS = 30, 4, 4
MODES = ("torchckpt", "plain", "no-rng", "no-skip", "eager")


class EagerCallback(hf_trainer.TorchckptCallback):
    """Saves a due step at on_step_end itself, before the step's evaluation (a control for rule 1)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_step_end(args, state, control, **kwargs)
        self._flush(state)


class LossLog(transformers.TrainerCallback):
    """Appends every logged loss (bitwise, as hex) and the step training starts from; kills at KILL_AT."""

    def __init__(self, path: str, kill_at: int) -> None:
        self.path, self.kill_at = path, kill_at

    def _write(self, line: str) -> None:
        with open(self.path, "a") as log:
            log.write(line + "\n")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write(f"start {state.global_step} -")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.kill_at:  # mid-step: forward and backward done, no optimizer step yet
            os.kill(os.getpid(), signal.SIGKILL)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        for key, kind in (("loss", "loss"), ("eval_loss", "eval")):
            if logs and key in logs:
                self._write(f"{kind} {state.global_step} {float(logs[key]).hex()}")


def build(run_dir: str, losses_path: str, kill_at: int = -1, mode: str = "torchckpt", *, max_steps: int = STEPS,
          grad_accum: int = 1, async_save: bool = False) -> transformers.Trainer:
    """The Trainer of every run (same seed, data and arguments); ``mode`` as in the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    torch.set_num_threads(1)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    rows = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(run_dir, "hf-output"), max_steps=max_steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, gradient_accumulation_steps=grad_accum, learning_rate=3e-3, warmup_steps=3,
        weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=1, eval_strategy="steps", eval_steps=EVAL_STEPS, save_strategy="no", report_to=[],
        use_cpu=True, seed=7, disable_tqdm=True, dataloader_num_workers=0, ignore_data_skip=mode == "no-skip",
    )
    callbacks: list[Any] = [LossLog(losses_path, kill_at)]
    if mode != "plain":
        kind = EagerCallback if mode == "eager" else hf_trainer.TorchckptCallback
        callbacks.insert(0, kind(os.path.join(run_dir, "torchckpt"), save_steps=SAVE_STEPS, async_save=async_save))
    return transformers.Trainer(model=model, args=args, train_dataset=data[:24], eval_dataset=data[24:],
                                callbacks=callbacks)


def run(run_dir: str, losses_path: str, kill_at: int = -1, mode: str = "torchckpt") -> transformers.Trainer:
    trainer = build(run_dir, losses_path, kill_at, mode)
    if mode == "plain":
        trainer.train()
        return trainer
    if mode == "no-rng":
        restore = Checkpointer.restore

        def restore_without_rng(self: Checkpointer, **kwargs: Any) -> int | None:
            return restore(self, **{**kwargs, "rng": False})

        Checkpointer.restore = restore_without_rng  # type: ignore[method-assign]
    hf_trainer.train(trainer)
    return trainer


def read_losses(path: str) -> list[tuple[str, int, str]]:
    """The lines LossLog wrote: (kind, global_step, value as hex or '-')."""
    with open(path) as log:
        return [(kind, int(step), value) for kind, step, value in (line.split() for line in log if line.strip())]


if __name__ == "__main__":
    run_dir_arg, losses_arg, kill_arg = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run(run_dir_arg, losses_arg, kill_arg, sys.argv[4] if len(sys.argv) > 4 else "torchckpt")
