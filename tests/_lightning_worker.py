"""One replica group's training process for tests/test_lightning_strategy.py (run as a script).

A tiny regression model, Adam and a step-interval StepLR, trained with
`Trainer(strategy="fault_tolerant_ddp")`, the settings coming from the environment
(FT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS) as a user script would. It records what
the tests check into --out: per-step progress lines, and per rank a JSON summary plus the final
weights.
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
from _worker_faults import hold, kill_in_reduction
from torch.utils.data import DataLoader, TensorDataset

import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp", as a user script would)
from ft_core.manager import Manager

ALLREDUCES = [0]
_original_allreduce = Manager._allreduce_future


def _counted_allreduce(self, tensor, reduce_op=torch.distributed.ReduceOp.AVG, **kw):  # type: ignore[no-untyped-def]
    ALLREDUCES[0] += 1
    return _original_allreduce(self, tensor, reduce_op, **kw)


Manager._allreduce_future = _counted_allreduce  # count the Manager's cross-group allreduces (real calls)


class EventCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)  # routine events (a quorum that changed nothing, a commit) are DEBUG
        self.counts: dict[str, int] = {}
        self.heals = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, dict):
            kind = str(event.get("type"))
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind == "redo" and event.get("replayed"):
                self.counts["redo_replayed"] = self.counts.get("redo_replayed", 0) + 1


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        if self.args.sleep:
            time.sleep(self.args.sleep)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.args.log_sync:
            self.log("train_loss", loss, sync_dist=True)  # a cross-group reduction in the step, before backward
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(self.args.samples, 0), batch_size=4, shuffle=True)

    def val_dataloader(self):  # type: ignore[no-untyped-def]
        return DataLoader(dataset(8, 1), batch_size=4)


def _optimizer_fingerprint(trainer: pl.Trainer) -> list[float]:
    state = trainer.optimizers[0].state
    return [float(t.sum()) for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]


class Recorder(pl.Callback):
    """Progress lines per optimizer step, the failed-step check, and the final summary."""

    def __init__(self, args: argparse.Namespace, events: EventCounter) -> None:
        self.args = args
        self.events = events
        self.before: dict | None = None
        self.failed_step: dict | None = None
        self.resumed_manager_step: int | None = None
        self.samplers: dict = {}

    def _progress_path(self, trainer: pl.Trainer) -> str:
        return os.path.join(self.args.out, f"progress_g{self.args.group}_r{trainer.global_rank}.jsonl")

    def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.resumed_manager_step = trainer.strategy.manager.current_step()
        with open(os.path.join(self.args.out, f"train_started_g{self.args.group}_{os.getpid()}"), "w"):
            pass
        train_sampler = trainer.train_dataloader.sampler
        val_sampler = trainer.val_dataloaders.sampler
        self.samplers = {"train": [train_sampler.num_replicas, train_sampler.rank],
                         "val": [val_sampler.num_replicas, val_sampler.rank]}

    def _state(self, trainer: pl.Trainer) -> dict:
        return {"global_step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "scheduler_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
                "optimizer": _optimizer_fingerprint(trainer),
                "weights": [float(p.detach().sum()) for p in trainer.lightning_module.parameters()],
                "batches_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        hold(self.args.hold, trainer.global_step)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.before = self._state(trainer)
            if self.failed_step is not None and "before" in self.failed_step and self.failed_step["after"] is None:
                self.failed_step["after"] = self.before  # everything Lightning does after a step is done
                with open(os.path.join(self.args.out, f"failed_step_g{self.args.group}.json"), "w") as f:
                    json.dump(self.failed_step, f)

    def on_after_backward(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        accumulate = trainer.accumulate_grad_batches
        last_micro = (trainer.fit_loop.batch_idx + 1) % accumulate == 0
        if last_micro and self.args.fail_at_step is not None and trainer.global_step == self.args.fail_at_step \
                and self.failed_step is None:
            trainer.strategy.manager.report_error(RuntimeError("injected by the test"))
            self.failed_step = {"pending": True}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if self.failed_step is not None and self.failed_step.get("pending"):
            self.failed_step = {"before": self.before, "after": None}
        with open(self._progress_path(trainer), "a") as f:
            f.write(json.dumps({"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                                "batch_idx": trainer.fit_loop.batch_idx, "batch_sum": float(batch[0].sum()),
                                "manager_step": trainer.strategy.manager.current_step(),
                                "pid": os.getpid()}) + "\n")
        if self.args.kill_at_step is not None and trainer.global_step >= self.args.kill_at_step:
            os.kill(os.getpid(), 9)  # a real SIGKILL mid-epoch

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        rank = trainer.global_rank
        torch.save(pl_module.state_dict(), os.path.join(self.args.out, f"weights_g{self.args.group}_r{rank}.pt"))
        torch.save(trainer.optimizers[0].state_dict(),
                   os.path.join(self.args.out, f"optimizer_g{self.args.group}_r{rank}.pt"))
        summary = {"group": self.args.group, "rank": rank, "global_step": trainer.global_step,
                   "epoch": trainer.current_epoch, "manager_step": trainer.strategy.manager.current_step(),
                   "lr": trainer.optimizers[0].param_groups[0]["lr"], "allreduces": ALLREDUCES[0],
                   "events": self.events.counts,
                   "resumed_manager_step": self.resumed_manager_step, "samplers": self.samplers,
                   "root_dir": trainer.default_root_dir, "world_size": trainer.world_size}
        with open(os.path.join(self.args.out, f"summary_g{self.args.group}_r{rank}.json"), "w") as f:
            json.dump(summary, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines the group spans (under torchrun)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--fail-at-step", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--log-sync", action="store_true", help="self.log(train_loss, sync_dist=True) every step")
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE",
                        help="before optimizer step STEP, wait (at most 90 s) until FILE exists")
    parser.add_argument("--kill-in-reduction-at-step", type=int, default=None,
                        help="SIGKILL self instead of issuing the cross-group reduction of this Manager step (or the "
                             "first after it that 3 groups take part in)")
    parser.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--machine-dir", default=None, help="this group's own checkpoint root (another machine's disk)")
    args = parser.parse_args()
    if args.kill_in_reduction_at_step is not None:
        kill_in_reduction(args.kill_in_reduction_at_step, groups=3)  # a step every group takes part in

    events = EventCounter()
    events_logger = logging.getLogger("ft_core.events")
    events_logger.setLevel(logging.DEBUG)
    events_logger.addHandler(events)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("ft_lightning").setLevel(logging.INFO)

    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = [Recorder(args, events)]
    # shared by the groups (rank_zero="quorum", the default), unless this group is on "another machine"
    ckpt_dir = os.path.join(args.machine_dir or args.out, "ckpts")
    if args.checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2,
                                                      save_top_k=1))
    trainer = pl.Trainer(strategy="fault_tolerant_ddp", accelerator=args.accelerator, devices=args.devices,
                         num_nodes=args.num_nodes, max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
                         default_root_dir=args.out, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=args.checkpoint,
                         num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(Regression(args), ckpt_path="last" if args.checkpoint else None)


if __name__ == "__main__":
    main()
