"""One replica group training a two-optimizer (GAN-style) LightningModule with manual optimization
under `FaultTolerantDDPStrategy(find_unused_parameters=True)`; writes the final weights and step counts as JSON."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from ft_lightning.strategy import FaultTolerantDDPStrategy


class TwoOptimizers(pl.LightningModule):
    """A discriminator and a generator step per batch, each with its own backward and optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.d = torch.nn.Linear(4, 1)
        self.g = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        (x,) = batch
        opt_d, opt_g = self.optimizers()
        d_loss = self.d(x).pow(2).mean() + self.d(self.g(x).detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = -self.d(self.g(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)  # after opt_d's vote: a step of its own
        opt_g.step()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.d.parameters(), lr=0.05), torch.optim.SGD(self.g.parameters(), lr=0.05)


def main() -> int:
    out, group, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pl.seed_everything(0, workers=True)
    gen = torch.Generator().manual_seed(7)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=gen)), batch_size=8)
    model = TwoOptimizers()
    # each backward uses only some parameters, so DDP must look for unused ones (as with plain DDP)
    strategy = FaultTolerantDDPStrategy(find_unused_parameters=True)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2 * batches,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out + f".g{group}")
    trainer.fit(model, data)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    manager = trainer.strategy._manager
    with open(out, "a") as f:
        f.write(json.dumps({"group": group, "digest": digest, "global_step": trainer.global_step,
                            "ft_step": manager.current_step() if manager is not None else None}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
