"""One replica group for tests/test_lightning_callbacks.py (run as a script): a Trainer with the
strategy's default `rank_zero="quorum"` (or --rank-zero), `ModelCheckpoint(save_top_k=2,
monitor="val_metric")` in a directory shared by the groups (--ckpt-dir, or the strategy's default folder
with --no-dirpath), `EarlyStopping`, `LearningRateMonitor` and a CSVLogger.

--go MARKER: a restart started ahead of time (its imports done while the others train) waits for that
file before it builds its Trainer, so the test's restart costs no import time under load. --resume-last:
`fit(ckpt_path="last")`.

`val_metric` is logged with `sync_dist=True`: each group logs `base(epoch) + offset(group)` (the
offsets are small, so the order of the epochs' values does not depend on who is alive), the reduction
over the live groups makes it the same everywhere. What the test checks goes to --out as JSON lines:
every checkpoint file written or removed (by whom, at which step), every committed step with this
group's participating rank, the reduced metric per validation, and a summary at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from ft_lightning.strategy import FaultTolerantDDPStrategy

BASE = [5.0, 4.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]  # best at epoch 2; patience 1 stops after epoch 3


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Model(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.args.sleep:
            time.sleep(self.args.sleep)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # inside the step: the Manager's allreduce
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        value = BASE[self.current_epoch] + 0.01 * (self.args.group - 1)
        self.log("val_metric", torch.tensor(value), sync_dist=True)  # between steps: the live groups

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9), "interval": "step"}}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(self.args.samples, 0), batch_size=4, shuffle=True)

    def val_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(8, 1), batch_size=4)


class Recorder(pl.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.path = os.path.join(args.out, f"record_g{args.group}.jsonl")

    def write(self, row: dict) -> None:
        row.update(group=self.args.group, pid=os.getpid())
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def setup(self, trainer, pl_module, stage):  # type: ignore[no-untyped-def]
        io = trainer.strategy.checkpoint_io
        save, remove = io.save_checkpoint, io.remove_checkpoint

        def saving(checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
            self.write({"kind": "save", "path": os.fspath(path), "step": trainer.global_step,
                        "rank": trainer.global_rank})
            return save(checkpoint, path, storage_options)

        def removing(path):  # type: ignore[no-untyped-def]
            self.write({"kind": "remove", "path": os.fspath(path), "step": trainer.global_step})
            return remove(path)

        io.save_checkpoint, io.remove_checkpoint = saving, removing  # the real writes, recorded

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.write({"kind": "start", "step": trainer.strategy.manager.current_step(),
                    "restart": int(os.environ.get("FT_RESTART_COUNT", "0"))})
        self.first_batch = True
        restart = os.environ.get("FT_RESTART_COUNT", "0")
        open(os.path.join(self.args.out, f"ready_g{self.args.group}_r{restart}"), "w").close()  # its Manager is up
        for group in filter(None, (self.args.wait_ready or "").split(",")):  # the others are heartbeating
            self._wait(f"ready_g{group}_r0", settle=0.0)
        if self.args.wait_start:  # the test's ordering: the first quorum includes that group
            self._wait(self.args.wait_start)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.first_batch:  # just before this incarnation's first quorum (the strategy's hook runs next)
            self.first_batch = False
            restart = os.environ.get("FT_RESTART_COUNT", "0")
            open(os.path.join(self.args.out, f"started_g{self.args.group}_r{restart}"), "w").close()

    def _wait(self, marker: str, settle: float = 1.0) -> None:
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(self.args.out, marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(settle)  # that group is asking the lighthouse for its quorum by now

    def on_train_epoch_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        if self.args.wait_for and trainer.current_epoch == self.args.wait_epoch:  # the test's ordering
            self._wait(self.args.wait_for)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        strategy = trainer.strategy
        if strategy._commit:
            self.write({"kind": "commit", "step": trainer.global_step,
                        "participating_rank": strategy.manager.participating_rank(),
                        "leader": trainer.is_global_zero})
        if self.args.kill_at_step is not None and trainer.global_step >= self.args.kill_at_step:
            os.kill(os.getpid(), 9)

    def on_validation_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        if trainer.sanity_checking:
            return
        self.write({"kind": "val", "epoch": trainer.current_epoch, "step": trainer.global_step,
                    "val_metric": float(trainer.callback_metrics["val_metric"])})

    def on_fit_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        ckpt = trainer.checkpoint_callback
        stop = trainer.early_stopping_callback
        self.write({"kind": "summary", "step": trainer.global_step, "epoch": trainer.current_epoch,
                    "best_model_score": float(ckpt.best_model_score), "best_model_path": ckpt.best_model_path,
                    "best_k_models": {k: float(v) for k, v in ckpt.best_k_models.items()},
                    "stop": {"wait_count": stop.wait_count, "best_score": float(stop.best_score),
                             "stopped_epoch": stop.stopped_epoch},
                    "should_stop": trainer.should_stop, "fallbacks": trainer.strategy._live.fallbacks,
                    "log_dir": trainer.logger.log_dir})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--wait-start", default=None, help="at train start, wait for this marker file")
    p.add_argument("--wait-ready", default=None, help="at train start, wait until these groups (0,1,..) are too")
    p.add_argument("--wait-for", default=None, help="at --wait-epoch's start, wait for this marker file")
    p.add_argument("--wait-epoch", type=int, default=2)
    p.add_argument("--rank-zero", default=None, help="group|quorum (unset: the strategy's default)")
    p.add_argument("--no-dirpath", action="store_true", help="ModelCheckpoint without a dirpath (the default folder)")
    p.add_argument("--save-last", action="store_true")
    p.add_argument("--resume-last", action="store_true", help='fit(ckpt_path="last")')
    p.add_argument("--patience", type=int, default=1)
    p.add_argument("--go", default=None, help="wait for this marker file before building the Trainer")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.go:
        deadline = time.monotonic() + 100
        while not os.path.exists(os.path.join(args.out, args.go)) and time.monotonic() < deadline:
            time.sleep(0.05)
    pl.seed_everything(0, verbose=False)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=None if args.no_dirpath else os.path.join(args.out, "ckpts"),
                                              monitor="val_metric", mode="min", save_top_k=2,
                                              save_last=args.save_last or None)
    stop = pl.callbacks.EarlyStopping(monitor="val_metric", mode="min", patience=args.patience)
    trainer = pl.Trainer(strategy=FaultTolerantDDPStrategy(rank_zero=args.rank_zero), accelerator="cpu", devices=1,
                         max_epochs=args.epochs, default_root_dir=args.out, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                         logger=CSVLogger(args.out, flush_logs_every_n_steps=1),
                         callbacks=[Recorder(args), checkpoint, stop,
                                    pl.callbacks.LearningRateMonitor(logging_interval="step")])
    trainer.fit(Model(args), ckpt_path="last" if args.resume_last else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
