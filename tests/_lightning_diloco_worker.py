"""One replica group of `Trainer(strategy=FaultTolerantDiLoCoStrategy(...))`, for
tests/test_lightning_diloco.py (run as a script; settings from FT_* / REPLICA_GROUP_ID as a user's).

Writes per rank a JSON summary at the end: global step, Manager step, the count of cross-group
allreduces and of votes (one each per sync), and DiLoCo's global copies and outer optimizer state.
--kill-at-step SIGKILLs the process after that optimizer step.
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
from torch.utils.data import DataLoader, TensorDataset

from ft_core.manager import Manager
from ft_lightning.strategy import FaultTolerantDiLoCoStrategy

ALLREDUCES = [0]
_original = Manager._allreduce_future


def _counted(self, tensor, reduce_op=torch.distributed.ReduceOp.AVG):  # type: ignore[no-untyped-def]
    ALLREDUCES[0] += 1
    return _original(self, tensor, reduce_op)


Manager._allreduce_future = _counted  # every cross-group reduction goes through here (real calls)


class Votes(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.commits = 0
        self.heals = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, dict) and event.get("type") == "commit":
            self.commits += 1
        if isinstance(event, dict) and event.get("type") == "heal":
            self.heals += 1


class Regression(pl.LightningModule):
    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=0.02)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 8, generator=g)
        y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


class Killer(pl.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.step is not None and trainer.global_step >= self.step:
            print(f"SIGKILL at global step {trainer.global_step}", flush=True)
            os.kill(os.getpid(), 9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    votes = Votes()
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.INFO)
    events.addHandler(votes)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    pl.seed_everything(0, verbose=False)
    strategy = FaultTolerantDiLoCoStrategy(sync_every=4, fragments=2, fragment_sync_delay=1,
                                           fragment_update_alpha=0.5)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs,
                         default_root_dir=args.out, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         callbacks=[Killer(args.kill_at_step)])
    trainer.fit(Regression(args.samples))
    state = strategy.manager.healing_state()["user"]
    fragments = {key: {"original_parameters": {n: t.tolist() for n, t in value["original_parameters"].items()},
                       "outer_optimizer": {str(i): {k: v.tolist() for k, v in s.items()}
                                           for i, s in value["outer_optimizer"]["state"].items()}}
                 for key, value in state.items() if key.startswith("StreamingDiLoCoFragment_")}
    summary = {"group": args.group, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
               "manager_step": strategy.manager.current_step(), "allreduces": ALLREDUCES[0],
               "votes": votes.commits, "heals": votes.heals, "fragments": fragments}
    with open(os.path.join(args.out, f"summary_g{args.group}_i{args.incarnation}.json"), "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
