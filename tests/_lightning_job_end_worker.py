"""One Lightning replica group for tests/test_job_finished.py: `Trainer(strategy=FaultTolerantDDPStrategy)`
with `ModelCheckpoint(save_last=True)` (unless --no-checkpointing), as a typical script would.

After fit, group rank 0 writes --result (torch.save): the model's and optimizer's state, global_step,
current_epoch, the Manager's step and how many batches this process trained; and prints
`done global_step=G manager_step=M trained=K`. A JobFinishedError is not caught: the process ends
with its traceback and exit 1, as a user's script would.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl

from ft_lightning.strategy import FaultTolerantDDPStrategy


class Model(pl.LightningModule):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.size = size

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # momentum: optimizer state to resume

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(self.size, 4, generator=g)),
                                           batch_size=4)


class Count(pl.Callback):
    def __init__(self, sleep: float) -> None:
        self.trained, self.sleep = 0, sleep

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.trained += 1
        time.sleep(self.sleep)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="default_root_dir, shared by the groups")
    p.add_argument("--result", required=True)
    p.add_argument("--ckpt-dir", default=None, help="an explicit ModelCheckpoint dirpath")
    p.add_argument("--rank-zero", default=None, help="group|quorum (unset: the strategy's default)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--size", type=int, default=48)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--devices", type=int, default=1, help="ranks in the group")
    p.add_argument("--no-checkpointing", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    pl.seed_everything(0, verbose=False)
    strategy = FaultTolerantDDPStrategy(timeout=5.0, quorum_timeout=60.0, rank_zero=args.rank_zero)
    count = Count(args.sleep)
    callbacks: list[pl.Callback] = [count]
    if not args.no_checkpointing:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
                         default_root_dir=args.out, enable_checkpointing=not args.no_checkpointing,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=callbacks)
    model = Model(args.size)
    trainer.fit(model)
    manager_step = strategy.manager.current_step()
    if trainer.global_rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                    "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                    "manager_step": manager_step, "trained": count.trained}, args.result)
    print(f"done global_step={trainer.global_step} manager_step={manager_step} trained={count.trained}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
