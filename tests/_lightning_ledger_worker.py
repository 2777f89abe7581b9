"""One replica group under `Trainer(strategy=FaultTolerantDDPStrategy(exactly_once=True))` writing the
same ledger as tests/_data_ledger_worker.py (read by tests/test_data_ledger.py): per step attempt the
batch the exactly-once sampler checked, whether it counted, and whether the step committed."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl
from _ledger_common import Indexed, Ledger, fingerprint

from ft_lightning.strategy import FaultTolerantDDPStrategy


class Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, _ = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return torch.utils.data.DataLoader(Indexed(self.args.size), batch_size=self.args.batch_size, shuffle=True,
                                           num_workers=self.args.workers,
                                           multiprocessing_context="spawn" if self.args.workers else None,
                                           persistent_workers=bool(self.args.workers))


class LedgerCallback(pl.Callback):
    def __init__(self, path: str, strategy: FaultTolerantDDPStrategy, sleep: float, gate: str | None = None,
                 gate_epoch: int = 0) -> None:
        self.ledger = Ledger(path)
        self.strategy = strategy
        self.sleep = sleep
        self.gate, self.gate_epoch = gate, gate_epoch
        self.before = ""

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.ledger.write("start", step=self.strategy.manager.current_step(),
                          position=fingerprint(self.strategy.data_sampler))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.before = fingerprint(self.strategy.data_sampler)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.ledger.attempt(self.strategy.data_sampler.last_batch, batch[1].tolist(), self.before)
        self.ledger.write("outcome", committed=bool(self.strategy._commit), step=self.strategy.manager.current_step(),
                          after=fingerprint(self.strategy.data_sampler))
        if self.sleep:
            time.sleep(self.sleep)
        if self.gate and self.strategy.data_sampler.epoch >= self.gate_epoch and os.path.exists(self.gate):
            time.sleep(1.0)  # the test is still killing: stay in the epochs where kills are checked

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.ledger.write("done", step=self.strategy.manager.current_step(), epoch=self.strategy.data_sampler.epoch,
                          position=fingerprint(self.strategy.data_sampler))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ledger", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--gate", default=None, help="while this file exists, steps from --gate-epoch on are slow")
    p.add_argument("--gate-epoch", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    pl.seed_everything(0, verbose=False)
    strategy = FaultTolerantDDPStrategy(exactly_once=True, timeout=5.0, quorum_timeout=60.0,
                                        replica_id=f"group{os.environ['REPLICA_GROUP_ID']}")
    ledger = LedgerCallback(args.ledger.format(rank=0), strategy, args.step_sleep, args.gate, args.gate_epoch)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[ledger])
    trainer.fit(Model(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
