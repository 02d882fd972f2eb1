"""A tiny real Lightning run for test_lightning_io.py, in-process (``build``) or as a script (kill -9 trials).

    python lightning_worker.py RUN_DIR LOSSES_PATH [--kill-at N] [--ckpt-path last] [--drop KEY]
                               [--dropout P] [--rng]

trains 30 optimizer steps (6 batches per epoch, 5 epochs; AdamW + per-step StepLR; a shuffling
StatefulDataLoader over torchdata's StatefulDistributedSampler, whose order is a function of (seed, epoch)),
appends ``global_step loss.hex()`` per step to LOSSES_PATH, saves with ``TorchckptIO`` every 5 steps
(``save_last=True``, top-2 by ``train_loss``), and SIGKILLs itself at the start of step ``--kill-at``.
``--ckpt-path`` is passed to ``fit``. ``--drop`` names a key of ``checkpoint["loops"]["fit_loop"]["state_dict"]``
to delete when loading (a control run that loses the data position). ``--dropout`` adds a dropout layer;
Lightning's checkpoint holds no RNG state, so such a run resumes bitwise only with ``--rng``
(``RestoreGlobalRNG``, below).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from torchckpt.integrations.lightning import TorchckptIO

TOTAL_STEPS = 30
EVERY = 5


class TinyModule(lightning.LightningModule):
    def __init__(self, losses_path: str, kill_at: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(6, 16), torch.nn.Tanh()]
        if dropout:
            layers.append(torch.nn.Dropout(dropout))
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))
        self.losses_path, self.kill_at = losses_path, kill_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        with open(self.losses_path, "a") as log:
            log.write(f"{self.global_step} {loss.item().hex()}\n")
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RestoreGlobalRNG(lightning.Callback):
    """Saves torch's and Python's global RNG streams with each checkpoint; a resumed run sets them when training
    starts (``on_train_start``: after Lightning created the resumed loader's iterator, which draws a seed from
    torch's stream, as the interrupted run did before the save; before the first resumed step)."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint["global_rng"] = {"torch": torch.get_rng_state(), "python": random.getstate()}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.pending = checkpoint["global_rng"]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.pending is not None:
            torch.set_rng_state(self.pending["torch"])
            random.setstate(self.pending["python"])
            self.pending = None


class DroppingIO(TorchckptIO):
    """Loads like TorchckptIO, then forgets one fit-loop entry (the control run)."""

    def __init__(self, drop: str) -> None:
        super().__init__()
        self.drop = drop

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, map_location, weights_only)
        del checkpoint["loops"]["fit_loop"]["state_dict"][self.drop]
        return checkpoint


def build(run_dir: str, losses_path: str, kill_at: int = -1, drop: str | None = None,
          checkpointing: bool = True, io: TorchckptIO | None = None, dropout: float = 0.0,
          rng: bool = False) -> tuple[lightning.Trainer, TinyModule, Any]:
    torch.manual_seed(1234)
    random.seed(1234)
    torch.set_num_threads(1)
    module = TinyModule(losses_path, kill_at, dropout)
    data = torch.Generator().manual_seed(99)
    inputs = torch.randn(24, 6, generator=data)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    # Each epoch's order is a function of (seed, epoch). A resumed Lightning run creates the loader's
    # iterator before it calls set_epoch; StatefulDistributedSampler draws its order lazily (at the first
    # batch, after set_epoch) and skips the samples already seen. torch's DistributedSampler draws it when
    # the iterator is created, so a run resumed in epoch 1 or later would replay epoch 0's order.
    sampler = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler)
    callbacks: list[lightning.Callback] = [ModelCheckpoint(
        dirpath=os.path.join(run_dir, "ckpts"), every_n_train_steps=EVERY, save_last=True, save_top_k=2,
        monitor="train_loss", mode="min")] if checkpointing else []
    if rng:
        callbacks.append(RestoreGlobalRNG())
    plugin = io if io is not None else (DroppingIO(drop) if drop else TorchckptIO())
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=TOTAL_STEPS, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=checkpointing, callbacks=callbacks,
        plugins=[plugin], default_root_dir=run_dir, num_sanity_val_steps=0, deterministic=True,
    )
    return trainer, module, loader


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("losses_path")
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--drop", default=None)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--rng", action="store_true")
    args = parser.parse_args(argv)
    trainer, module, loader = build(args.run_dir, args.losses_path, args.kill_at, args.drop,
                                    dropout=args.dropout, rng=args.rng)
    trainer.fit(module, loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main(sys.argv[1:])
