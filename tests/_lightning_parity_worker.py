"""One replica group for tests/test_lightning_parity.py: a Trainer with ModelCheckpoint(save_top_k=2,
save_last=True), a CSVLogger and `fit(ckpt_path="last")`, as a typical Lightning script. Writes one
JSON line per event to --events: epoch starts, trained batches (epoch, global step)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from ft_lightning.strategy import FaultTolerantDDPStrategy


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g)),
                                           batch_size=4)


class Events(pl.Callback):
    def __init__(self, path: str, kill_at: int | None, sleep: float, gate: str | None = None,
                 gate_epoch: int = 0) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open until exit)
        self.kill_at, self.sleep = kill_at, sleep
        self.gate, self.gate_epoch = gate, gate_epoch

    def write(self, **row: object) -> None:
        self.file.write(json.dumps(row) + "\n")

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.write(kind="train_start", step=trainer.global_step, manager_step=trainer.strategy.manager.current_step())

    def on_train_epoch_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.write(kind="epoch_start", epoch=trainer.current_epoch, step=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.write(kind="batch", epoch=trainer.current_epoch, step=trainer.global_step)
        if self.kill_at is not None and trainer.global_step >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.sleep)
        if self.gate and trainer.current_epoch >= self.gate_epoch:  # held here while the test's gate file exists
            deadline = time.monotonic() + 120
            while os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--gate", default=None, help="from epoch --gate-epoch on, each batch waits while this file exists")
    p.add_argument("--gate-epoch", type=int, default=0)
    p.add_argument("--no-resume", action="store_true", help="fit without ckpt_path=\"last\"")
    args = p.parse_args()
    pl.seed_everything(0, verbose=False)
    strategy = FaultTolerantDDPStrategy(timeout=5.0, quorum_timeout=60.0)
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="train_loss", save_top_k=2, save_last=True,
                                              every_n_train_steps=2)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs,
                         default_root_dir=args.out, logger=CSVLogger(args.out), enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[checkpoint, Events(args.events, args.kill_at_step, args.sleep, args.gate,
                                                                      args.gate_epoch)])
    trainer.fit(Model(), ckpt_path=None if args.no_resume else "last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
