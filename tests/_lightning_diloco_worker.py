"""One replica group of fault-tolerant DiLoCo in a Lightning framework, for tests/test_lightning_diloco.py
and tests/test_fabric_diloco.py (run as a script; settings from FT_* / REPLICA_GROUP_ID as a user's).

--framework: "trainer" (`lightning.pytorch.Trainer` + `FaultTolerantDiLoCoStrategy`), "pytorch_lightning"
(the standalone package's Trainer + its strategy) or "fabric" (a plain Fabric loop +
`FaultTolerantFabricDiLoCoStrategy`). All three run Streaming DiLoCo with 2 fragments, delay 1, alpha 0.5,
sync_every 4 over the same model and data (16 inner steps per group).

Writes per rank a JSON summary at the end: inner (global) step, Manager step, the count of cross-group
allreduces and of votes (one each per sync), and DiLoCo's global copies and outer optimizer state.
--kill-at-step SIGKILLs the process after that optimizer step.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import torch

torch.set_num_threads(1)

from _diloco_common import count_votes, kill_self, write_summary
from torch.utils.data import DataLoader, TensorDataset

from ft_core.manager import Manager

DILOCO = dict(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
ALLREDUCES = [0]
_original = Manager._allreduce_future


def _counted(self, tensor, reduce_op=torch.distributed.ReduceOp.AVG, **kw):  # type: ignore[no-untyped-def]
    ALLREDUCES[0] += 1
    return _original(self, tensor, reduce_op, **kw)


Manager._allreduce_future = _counted  # every cross-group reduction goes through here (real calls)


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8).unsqueeze(1)


def run_trainer(args: argparse.Namespace, namespace: str) -> tuple[object, int]:
    """Trainer: 2 epochs over this group's half of the samples; returns (strategy, inner steps)."""
    pl = importlib.import_module(namespace)
    strategies = importlib.import_module("ft_lightning.strategy" if namespace == "lightning.pytorch"
                                         else "ft_lightning.pytorch_lightning")

    class Regression(pl.LightningModule):
        def __init__(self, samples: int) -> None:
            super().__init__()
            self.samples = samples
            self.net = make_net()

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=0.02)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return DataLoader(TensorDataset(*make_data(self.samples)), batch_size=4, shuffle=True)

    class Killer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if args.kill_at_step is not None and trainer.global_step >= args.kill_at_step:
                kill_self(trainer.global_step)

    pl.seed_everything(0, verbose=False)
    strategy = strategies.FaultTolerantDiLoCoStrategy(**DILOCO)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=args.epochs,
                         default_root_dir=args.out, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         callbacks=[Killer()])
    trainer.fit(Regression(args.samples))
    return strategy, trainer.global_step


class Position:
    """The Fabric loop's position, registered with the strategy so a healed group goes on from its peers'."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def run_fabric(args: argparse.Namespace) -> tuple[object, int]:
    """A plain Fabric loop over this group's half of the same samples (batch 4, in order, 2 epochs)."""
    from lightning.fabric import Fabric

    from ft_lightning.fabric import FaultTolerantFabricDiLoCoStrategy

    torch.manual_seed(0)
    strategy = FaultTolerantFabricDiLoCoStrategy(**DILOCO)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
    position = Position()
    strategy.register_state("position", position)
    x, y = make_data(args.samples)
    x, y = x[args.group::2], y[args.group::2]
    per_epoch = len(x) // 4
    total = per_epoch * args.epochs
    while position.step < total:
        batch = (position.step % per_epoch) * 4
        loss = torch.nn.functional.mse_loss(model(x[batch:batch + 4]), y[batch:batch + 4])
        fabric.backward(loss)
        optimizer.step()  # the inner step; DiLoCo syncs (and may heal `position`) inside it when due
        optimizer.zero_grad()
        position.step += 1
        if args.kill_at_step is not None and position.step >= args.kill_at_step:
            kill_self(position.step)
    strategy.shutdown()
    return strategy, position.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--framework", choices=("trainer", "pytorch_lightning", "fabric"), default="trainer")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--kill-at-step", type=int, default=None)
    args = p.parse_args()
    votes = count_votes()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    if args.framework == "fabric":
        strategy, inner_steps = run_fabric(args)
    else:
        strategy, inner_steps = run_trainer(args, "lightning.pytorch" if args.framework == "trainer"
                                            else "pytorch_lightning")
    write_summary(args.out, args.group, args.incarnation, strategy.manager, votes, framework=args.framework,
                  global_step=inner_steps, allreduces=ALLREDUCES[0])


if __name__ == "__main__":
    main()
