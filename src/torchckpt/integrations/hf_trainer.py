"""Hugging Face ``transformers.Trainer``: crash-safe, pickle-free checkpoints and a bit-exact resume.

    from torchckpt.integrations.hf_trainer import TorchckptCallback, train
    trainer = transformers.Trainer(..., callbacks=[TorchckptCallback("runs/exp1/torchckpt", save_steps=500)])
    train(trainer)        # resumes from the newest valid step in runs/exp1/torchckpt, or starts fresh

Rules kept here (named in ``docs/design.md``'s style; the state package's notes they rely on in parentheses):

1. **[a step is saved where Trainer's resume restores it]** Trainer's own resume sets the RNG streams at
   two places: mid-epoch, after it fetched the batches of the first step it runs again; at an epoch
   boundary, before the epoch's DataLoader iterator draws its seed from torch's RNG. So the save of step N
   (due at ``on_step_end``) is made at the next ``on_step_begin`` (the next step's batches are fetched),
   ``on_epoch_begin`` (the next epoch's iterator is not built yet) or ``on_train_end``, whichever comes
   first. Step N's logging, evaluation (its DataLoader iterator draws from torch's RNG too) and epoch end
   are then inside the saved RNG streams and ``TrainerState.log_history``, as they are in the run that
   never stopped. The state saved is that of step N: nothing changes it between those events.
2. **[resume goes through Trainer's own resume]** ``train`` calls ``trainer.train(resume_from_checkpoint=D)``
   where D is a temporary directory holding only ``trainer_state.json`` (JSON written from the
   checkpoint's item ``trainer_state``), so Trainer itself computes the epochs and batches to skip
   (``skip_first_batches``) and when to set the RNG streams. For the duration of the call, the four loaders
   that would ``torch.load`` HF's pickles are replaced on this Trainer instance (never on the class) by
   readers of the torchckpt checkpoint: ``_load_from_checkpoint`` (the model), ``_load_optimizer_and_scheduler``
   (optimizer, scheduler, and a GradScaler when there is one), ``_load_scaler`` (nothing more) and
   ``_load_rng_state`` (the RNG streams; Note: [restore is bit-exact]). Nothing is ever unpickled.
3. **[one step per resume]** The step is chosen once (the newest valid one, falling back past corrupt ones
   as ``Checkpointer.restore`` does); every later read asks for that very step.
4. **[one process]** One writer per directory (checkpointer.py's [one writer per directory]): ``train`` refuses
   distributed training, DeepSpeed and FSDP, whose state is sharded across processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from typing import Any

from torchckpt._optional import install_hint

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState
except ImportError as error:  # the message names the pip command
    raise ImportError(f"torchckpt.integrations.hf_trainer needs transformers (and accelerate), which did not "
                      f"import ({error}): {install_hint('transformers')}") from error

from torchckpt.state import Checkpointer, CheckpointerConfig, CheckpointNotFoundError

__all__ = ["TorchckptCallback", "train"]

_TRAINER_STATE_ITEM = "trainer_state"
_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
_VERIFY_MODES = ("full", "fast")


class TorchckptCallback(TrainerCallback):
    """Saves a ``transformers.Trainer`` run every ``save_steps`` optimizer steps with torchckpt.

    Each save holds the model (``trainer.model``'s state_dict), the optimizer, the LR scheduler, the
    GradScaler when mixed precision uses one, every ``TrainerState`` field (``global_step``, ``epoch``,
    ``log_history``, best metric, callback states) and the RNG streams (Python, NumPy, torch CPU and
    CUDA); it is hashed while written and committed by a rename, never pickled. Start (and resume)
    training with :func:`train`, not ``trainer.train()``.

    Args:
        directory: the checkpoint directory (a local path or an fsspec URL); one training run per directory.
        save_steps: save after every ``save_steps``-th optimizer step (``TrainerState.global_step``).
        keep_last: how many of the newest steps to keep (None keeps all).
        async_save: write in a background thread after copying the tensors (see ``docs/state.md``).
        verify: ``"full"`` hashes every file read on resume; ``"fast"`` checks sizes only.

    Example:
        >>> callback = TorchckptCallback("runs/exp1/torchckpt", save_steps=500, keep_last=2)
        >>> callback.directory, callback.save_steps
        ('runs/exp1/torchckpt', 500)
    """

    def __init__(self, directory: str | os.PathLike[str], *, save_steps: int, keep_last: int | None = 2,
                 async_save: bool = False, verify: str = "full") -> None:
        if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"TorchckptCallback(directory={directory!r}): expected a str or os.PathLike path (or "
                            f"an fsspec URL string), got {type(directory).__qualname__}. Fix: pass e.g. "
                            "'runs/exp1/torchckpt'.")
        location = os.fspath(directory)
        if not isinstance(location, str) or not location:
            raise ValueError(f"TorchckptCallback(directory={directory!r}): expected a non-empty text path")
        if type(save_steps) is not int or save_steps < 1:
            raise ValueError(f"TorchckptCallback(save_steps={save_steps!r}): expected an int >= 1 (save after every "
                             "that many optimizer steps), e.g. save_steps=500")
        if not isinstance(verify, str) or verify not in _VERIFY_MODES:
            raise ValueError(f"TorchckptCallback(verify={verify!r}): expected 'full' (hash every file read on "
                             "resume) or 'fast' (sizes only)")
        self.directory = location
        self.save_steps = save_steps
        self.verify = verify
        self._options: dict[str, Any] = {"keep_last": keep_last, "async_save": async_save, "verify": verify}
        CheckpointerConfig(**self._options)  # a bad keep_last/async_save fails here (no lock is taken yet)
        self._trainer: transformers.Trainer | None = None  # set by train() for the duration of one call
        self._ckpt: Checkpointer | None = None
        self._pending: int | None = None  # a step due at on_step_end, saved at the next safe event (rule 1)

    # ----- Trainer events -----------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Refuse a run started with ``trainer.train()``: only :func:`train` can resume it."""
        if self._trainer is None:
            raise RuntimeError(
                f"TorchckptCallback({self.directory!r}): training was started with trainer.train(), which "
                "cannot resume from torchckpt checkpoints (a restart after a crash would silently start over). "
                "Fix: call torchckpt.integrations.hf_trainer.train(trainer) instead; it resumes from the newest "
                "valid step, or starts fresh when there is none."
            )
        self._pending = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Mark step ``global_step`` for saving when it is due (saved at the next safe event, rule 1)."""
        if state.global_step % self.save_steps == 0:
            self._pending = state.global_step

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """Save the pending step: the next step's batches are fetched, its forward has not run."""
        self._flush(state)

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Save the pending step: the new epoch's DataLoader iterator has not drawn its seed yet."""
        self._flush(state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Save the pending step (the run's last step was due)."""
        self._flush(state)

    # ----- saving -------------------------------------------------------------------------

    def _flush(self, state: TrainerState) -> None:
        step, self._pending = self._pending, None
        if step is None or self._trainer is None or self._ckpt is None:
            return
        trainer = self._trainer
        self._ckpt.save(step, metrics=_metrics(state, step), **_items(trainer, _state_dict(trainer, state)))


def train(trainer: transformers.Trainer, *, resume: bool | None = None, **train_kwargs: Any) -> Any:
    """Run ``trainer.train()``, resuming bit-exactly from the newest valid torchckpt step.

    ``trainer`` must hold exactly one :class:`TorchckptCallback`. With ``resume=None`` (default) training
    resumes from the newest valid step in the callback's directory, or starts fresh when there is none
    (a missing directory is created); ``resume=True`` requires a step (else ``CheckpointNotFoundError``);
    ``resume=False`` requires that there is none (else ``ValueError``). The model, optimizer, scheduler,
    ``TrainerState`` and RNG streams are restored, and Trainer skips the epochs and batches already
    trained, so the losses after the resume are bitwise those of a run that never stopped.
    ``train_kwargs`` (``trial``, ``ignore_keys_for_eval``) go to ``trainer.train``. Returns its
    ``TrainOutput``.

    Example:
        >>> import tempfile, torch, transformers
        >>> tmp = tempfile.TemporaryDirectory()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=1,
        ...                                                               n_head=2, n_positions=8))
        >>> rows = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
        >>> args = transformers.TrainingArguments(output_dir=tmp.name, max_steps=2, per_device_train_batch_size=4,
        ...                                       report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
        >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r}
        ...                                for r in rows], callbacks=[TorchckptCallback(tmp.name, save_steps=1)])
        >>> trainer.remove_callback(transformers.PrinterCallback)  # keeps this example's output short
        >>> train(trainer).global_step
        2
        >>> train(trainer).global_step        # resumes from step 2: nothing left to do
        2
        >>> tmp.cleanup()
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"train(trainer=...): expected a transformers.Trainer, got {type(trainer).__qualname__}")
    if resume is not None and not isinstance(resume, bool):
        raise TypeError(f"train(resume={resume!r}): expected None (resume when there is a step), True (a step "
                        "must exist) or False (none may exist)")
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("train(resume_from_checkpoint=...): torchckpt chooses the step to resume from itself. Fix: "
                        "drop the argument (resume=True requires a checkpoint; resume=False a fresh start).")
    callback = _the_callback(trainer)
    _check_single_process(trainer)
    missing = [name for name in _LOADERS if not callable(getattr(trainer, name, None))]
    if missing:
        raise RuntimeError(f"transformers {transformers.__version__}: Trainer has no {missing}; torchckpt's resume "
                           "replaces these loaders of Trainer's own resume (written against transformers 5.25). Fix: "
                           "use a transformers version whose Trainer has them.")
    ckpt = Checkpointer(callback.directory, **callback._options)
    shim: str | None = None
    try:
        trainer_state: dict[str, Any] = {}
        step = ckpt.restore(rng=False, trainer_state=trainer_state)  # item _TRAINER_STATE_ITEM
        _check_resume(resume, step, ckpt)
        if step is not None:
            shim = tempfile.mkdtemp(prefix="torchckpt-hf-resume-")
            with open(os.path.join(shim, _STATE_FILE), "w", encoding="utf-8") as handle:
                json.dump(trainer_state, handle, indent=2, sort_keys=True)
            _install_loaders(trainer, ckpt, step)
        callback._trainer, callback._ckpt = trainer, ckpt
        output = trainer.train(resume_from_checkpoint=shim, **train_kwargs)
        ckpt.close()  # waits for an async save and re-raises its error
        return output
    finally:
        callback._trainer, callback._ckpt, callback._pending = None, None, None
        for name in _LOADERS:
            vars(trainer).pop(name, None)  # the class's methods are visible again
        if shim is not None:
            shutil.rmtree(shim, ignore_errors=True)
        ckpt.close()


def _the_callback(trainer: transformers.Trainer) -> TorchckptCallback:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, TorchckptCallback)]
    if len(found) != 1:
        what = "no TorchckptCallback" if not found else f"{len(found)} TorchckptCallbacks"
        raise ValueError(f"train(trainer): the Trainer holds {what}; exactly one is needed (it names the directory "
                         "and when to save). Fix: transformers.Trainer(..., callbacks=[TorchckptCallback("
                         "'runs/exp1/torchckpt', save_steps=500)]), or trainer.add_callback(...) / "
                         "trainer.remove_callback(...).")
    return found[0]


def _check_single_process(trainer: transformers.Trainer) -> None:
    if trainer.args.world_size > 1 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise NotImplementedError(
            "train(trainer): distributed training, DeepSpeed and FSDP are not supported: their model and optimizer "
            "state is sharded across processes, and a torchckpt directory has one writer. Fix: train in one "
            "process, or use Trainer's own checkpoints (save_strategy) for these setups."
        )


def _check_resume(resume: bool | None, step: int | None, ckpt: Checkpointer) -> None:
    if resume is True and step is None:
        raise CheckpointNotFoundError(f"train(resume=True): {ckpt.directory} holds no checkpoint. Fix: pass the "
                                      "directory an earlier run saved to, or resume=None to start fresh when empty.")
    if resume is False and step is not None:
        raise ValueError(f"train(resume=False): {ckpt.directory} already holds step {step}. Fix: pass resume=None "
                         "to continue that run, or a new directory to start another.")


def _install_loaders(trainer: transformers.Trainer, ckpt: Checkpointer, step: int) -> None:
    """Replace Trainer's pickle loaders on this instance with readers of ``step`` (rule 2)."""

    def load_model(resume_from_checkpoint: str, model: Any = None) -> None:
        ckpt.restore(step=step, rng=False, model=trainer.model)

    def load_optimizer_and_scheduler(checkpoint: str | None) -> None:
        if checkpoint is not None:
            items = _items(trainer, None)
            items.pop("model")
            ckpt.restore(step=step, rng=False, **items)

    def load_scaler(checkpoint: str | None) -> None:
        return None  # restored with the optimizer

    def load_rng_state(checkpoint: str | None) -> None:
        if checkpoint is not None:
            ckpt.restore(step=step, rng=True)

    for name, loader in zip(_LOADERS, (load_model, load_optimizer_and_scheduler, load_scaler, load_rng_state)):
        setattr(trainer, name, loader)


def _items(trainer: transformers.Trainer, trainer_state: dict[str, Any] | None) -> dict[str, Any]:
    items: dict[str, Any] = {"model": trainer.model, "optimizer": trainer.optimizer, "scheduler": trainer.lr_scheduler}
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        items["scaler"] = scaler
    if trainer_state is not None:
        items[_TRAINER_STATE_ITEM] = trainer_state
    return items


def _state_dict(trainer: transformers.Trainer, state: TrainerState) -> dict[str, Any]:
    """Every TrainerState field, with the states of stateful callbacks as of now (as Trainer's own save)."""
    stateful: list[Any] = [cb for cb in [*trainer.callback_handler.callbacks, trainer.control]
                           if isinstance(cb, ExportableState)]
    fields = dataclasses.asdict(state)
    fields["stateful_callbacks"] = TrainerState(stateful_callbacks=stateful).stateful_callbacks
    return fields


def _metrics(state: TrainerState, step: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if isinstance(state.epoch, (int, float)):
        metrics["epoch"] = float(state.epoch)
    for entry in reversed(state.log_history):
        if entry.get("step") == step and isinstance(entry.get("loss"), float) and math.isfinite(entry["loss"]):
            metrics["loss"] = entry["loss"]
            break
    return metrics
