"""Fault-tolerant Lightning training on CPU: a small MLP learns to tell two interleaved spirals apart.

The only fault-tolerance line is `strategy="fault_tolerant_ddp"` (after `import ft_lightning`). Each
run of this script is one replica group; the lighthouse address and the group's place come from
the environment, which `ftl launch` sets:

    ftl launch --groups 2 --kill-every 20 --max-kills 2 -- examples/lightning_train.py --epochs 20

or by hand, one terminal per group (plus `ftl lighthouse --min-replicas 1`):

    FT_LIGHTHOUSE=127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 python examples/lightning_train.py
    FT_LIGHTHOUSE=127.0.0.1:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 python examples/lightning_train.py

`--devices 2` runs two ranks inside each group (DDP over gloo inside the group). Killed groups
that restart heal from a live one and continue at the same step, epoch and batch; logs go to
<root>/replica_group_<id>/, checkpoints to <root>/checkpoints/ (one folder for the job: rank zero of
the live groups writes each file).
"""

from __future__ import annotations

import argparse
import math
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ft_lightning  # noqa: F401  (registers the "fault_tolerant_ddp" strategy name)


def spirals(n: int, seed: int, noise: float = 0.15) -> TensorDataset:
    """Two interleaved 2-D spirals, labels 0 and 1 (a task a linear model cannot solve)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 3 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=g)
    angle = t + label * math.pi
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
    x = x + noise * torch.randn(n, 2, generator=g) / (3 * math.pi)
    return TensorDataset(x, label)


class SpiralClassifier(pl.LightningModule):
    def __init__(self, lr: float, batch_size: int, samples: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        # The strategy shards this across every rank of every replica group.
        return DataLoader(spirals(self.hparams.samples, seed=0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):  # type: ignore[no-untyped-def]
        # Validation stays inside the group: each group scores the whole validation set.
        return DataLoader(spirals(512, seed=1), batch_size=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--devices", type=int, default=1, help="ranks inside this replica group")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--root", default=os.environ.get("FT_EXAMPLE_ROOT", "runs/lightning_train"))
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)  # same seed in every group: the shards partition one permutation
    model = SpiralClassifier(args.lr, args.batch_size, args.samples)
    checkpoints = pl.callbacks.ModelCheckpoint(save_last=True, every_n_train_steps=50)
    trainer = pl.Trainer(strategy="fault_tolerant_ddp", accelerator="cpu", devices=args.devices,
                         max_epochs=args.epochs, default_root_dir=args.root, callbacks=[checkpoints],
                         enable_progress_bar=False, log_every_n_steps=10)
    trainer.fit(model)
    result = trainer.validate(model, verbose=False)[0]
    if trainer.is_global_zero:  # rank zero of this replica group
        group = os.environ.get("REPLICA_GROUP_ID", "0")
        print(f"replica group {group}: {trainer.global_step} committed steps "
              f"(manager step {trainer.strategy.manager.current_step()}), epoch {trainer.current_epoch}, "
              f"val_acc {result['val_acc']:.3f}, logs in {trainer.default_root_dir}, checkpoints in "
              f"{checkpoints.dirpath}")


if __name__ == "__main__":
    main()
