"""One replica group for tests/test_lightning_collectives.py (run as a script): a Trainer (`--rank-zero`) whose LightningModule, at every validation's end, broadcasts a per-group value
(its group id and a path under its own directory) and a tuple, and calls a barrier; the broadcast id is
logged as `tag`, which names the ModelCheckpoint file. What the test checks goes to --out as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl
import torchmetrics
from _lightning_callbacks_worker import dataset  # the same small regression set (this folder is on sys.path)
from torch.utils.data import DataLoader

from ft_lightning.strategy import FaultTolerantDDPStrategy

BASE = [5.0, 4.0, 3.0, 2.0]  # every epoch a new best: the checkpoint is replaced each time


class Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Linear(8, 1)
        self.seen = torchmetrics.SumMetric()  # training samples: across the live groups at the epoch's end
        self.val_seen = torchmetrics.SumMetric()  # validation samples: every group evaluates the whole set
        self.local = torchmetrics.SumMetric(dist_sync_fn=lambda t, group=None: [t])  # the user's own sync fn

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.seen.update(float(len(x)))
        self.local.update(float(len(x)))
        self.log("seen", self.seen, on_step=False, on_epoch=True)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_end(self) -> None:
        self._write({"kind": "epoch", "group": self.args.group, "epoch": self.current_epoch,
                     "seen": float(self.seen.compute()), "local": float(self.local.compute())})
        self.local.reset()

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("val_metric", torch.tensor(BASE[self.current_epoch]), sync_dist=True)
        self.val_seen.update(float(len(batch[0])))
        self.log("val_seen", self.val_seen, on_step=False, on_epoch=True)

    def _write(self, row: dict) -> None:
        with open(os.path.join(self.args.out, f"record_g{self.args.group}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_validation_epoch_end(self) -> None:
        strategy = self.trainer.strategy
        own = {"group": self.args.group, "path": os.path.join(self.trainer.default_root_dir, "artifact.txt")}
        value = strategy.broadcast(own)
        pair = strategy.broadcast((self.args.group, "own"))  # not JSON: stays in the group
        before, crossed = strategy._live.fallbacks, strategy._live.crossed
        strategy.barrier("user")
        crossed = strategy._live.crossed - crossed  # 1: the barrier was made across the groups
        self.log("tag", float(value["group"]))  # names the checkpoint file: the same on every group
        row = {"kind": "val", "group": self.args.group, "epoch": self.current_epoch, "broadcast": value,
               "tuple": list(pair), "barrier_fallbacks": strategy._live.fallbacks - before,
               "barrier_crossed": crossed, "val_seen": float(self.val_seen.compute())}
        self._write(row)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(24, 0), batch_size=4, shuffle=True)

    def val_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(4, 1), batch_size=4)


class Summary(pl.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_fit_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        row = {"kind": "summary", "group": self.args.group, "best_model_path": trainer.checkpoint_callback.best_model_path,
               "fallbacks": trainer.strategy._live.fallbacks}
        with open(os.path.join(self.args.out, f"record_g{self.args.group}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rank-zero", default=None, help="group|quorum (unset: the strategy's default)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    pl.seed_everything(0, verbose=False)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(args.out, "ckpts"), monitor="val_metric",
                                              mode="min", save_top_k=1, filename="{epoch}-{tag:.0f}")
    trainer = pl.Trainer(strategy=FaultTolerantDDPStrategy(rank_zero=args.rank_zero), accelerator="cpu", devices=1,
                         max_epochs=args.epochs, default_root_dir=args.out, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, logger=False,
                         callbacks=[checkpoint, Summary(args)])
    trainer.fit(Model(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
