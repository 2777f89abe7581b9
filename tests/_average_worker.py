"""One process of one replica group for tests/test_backward_scale.py: trains a small MLP for a few steps
through one integration and records, every step, this rank's own gradient and the reduced gradient the
optimizer gets, as four fixed random projections (the reduction is linear: the reduced projections are
the mean of the taking-part ranks' own).

--api core: the core API, `ddp.backward(loss)` (or `loss.backward()` with --plain-backward), one rank
or several under torchrun (DDP inside the group); --torchft-wrapper: `manager.allreduce` wrapped with
torchft's signature (no `divided_by`: the hook falls back to AVG, divided after the sum); fabric: `fabric.backward`; accelerate:
`accelerator.backward` with 2 micro-batches per step (`accelerator.accumulate`); lightning:
`Trainer(strategy="fault_tolerant_ddp")`, `--devices` ranks per group. The own gradient comes from a
copy of the model run on the same batches. Settings come from the environment (FT_LIGHTHOUSE,
REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, FT_MIN_REPLICA_SIZE). Writes one JSON line per rank and step to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

torch.set_num_threads(1)

STEPS = 4
MICRO = 2  # accelerate: micro-batches per step


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(group: int, rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + 100 * rank + 10 * step + micro)
    return torch.randn(6, 8, generator=g) * (1 + group), torch.randint(0, 3, (6,), generator=g)


_DIRECTIONS = torch.randn(4, 8 * 16 + 16 + 16 * 3 + 3, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)


def projections(grads: list[torch.Tensor]) -> list[float]:
    return (_DIRECTIONS @ torch.cat([g.detach().reshape(-1).cpu() for g in grads]).double()).tolist()


def own_gradient(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """This rank's gradient of the mean loss over `batches`, from a copy of the model (no reduction)."""
    shadow = copy.deepcopy(model)
    shadow.zero_grad(set_to_none=True)
    for x, y in batches:
        (F.cross_entropy(shadow(x), y) / len(batches)).backward()
    return projections([p.grad for p in shadow.parameters()])


class Rows:
    def __init__(self, path: str, group: int, rank: int) -> None:
        self.path, self.group, self.rank = path, group, rank

    def write(self, manager, step: int, local: list[float], reduced: list[float]) -> None:  # type: ignore[no-untyped-def]
        row = {"group": self.group, "rank": self.rank, "step": step, "local": local, "reduced": reduced,
               "participating": manager.is_participating(), "participants": manager.num_participants()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def run_core(args: argparse.Namespace, group: int) -> None:
    from ft_core.ddp import DistributedDataParallel
    from ft_core.manager import Manager
    from ft_core.optim import OptimizerWrapper
    from ft_core.process_groups import ProcessGroupGloo

    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model = build()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    manager = Manager(pg, load_state_dict=model.load_state_dict, state_dict=model.state_dict, replica_id=str(group),
                      rank=rank, world_size=world_size, timeout=timedelta(seconds=20),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30),
                      use_async_quorum=not args.sync_quorum)
    if args.torchft_wrapper:
        issue = manager.allreduce

        def allreduce(tensor: torch.Tensor, reduce_op: dist.ReduceOp = dist.ReduceOp.AVG,
                      should_quantize: bool = False):  # type: ignore[no-untyped-def]
            return issue(tensor, reduce_op, should_quantize)

        manager.allreduce = allreduce  # type: ignore[method-assign]
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    rows = Rows(args.out, group, rank)
    try:
        while manager.current_step() < STEPS:
            step = manager.current_step()
            optimizer.zero_grad()
            x, y = batch(group, rank, step)
            local = own_gradient(model, [(x, y)])
            loss = F.cross_entropy(ddp(x), y)
            if args.plain_backward or (args.mix_backward and (step + group) % 2):
                loss.backward()
            else:
                ddp.backward(loss)
            rows.write(manager, step, local, projections([p.grad for p in model.parameters()]))
            optimizer.step()
    finally:
        manager.shutdown()
        pg.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_fabric(args: argparse.Namespace, group: int) -> None:
    from lightning.fabric import Fabric

    import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp")

    fabric = Fabric(strategy="fault_tolerant_ddp", accelerator="cpu", devices=1)
    fabric.launch()
    model = build()
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    manager = fabric.strategy.manager
    rows = Rows(args.out, group, 0)
    try:
        while manager.current_step() < STEPS:
            step = manager.current_step()
            x, y = batch(group, 0, step)
            local = own_gradient(model, [(x, y)])
            fabric.backward(F.cross_entropy(module(x), y))
            rows.write(manager, step, local, projections([p.grad for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        fabric.strategy.shutdown()


def run_accelerate(args: argparse.Namespace, group: int) -> None:
    from ft_lightning.accelerate import FaultTolerantAccelerator, FaultTolerancePlugin

    accelerator = FaultTolerantAccelerator(ft=FaultTolerancePlugin(), cpu=True,
                                           gradient_accumulation_steps=MICRO)
    model = build()
    prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    net = accelerator.unwrap_model(prepared)
    manager = accelerator.ft_manager
    rows = Rows(args.out, group, 0)
    try:
        while manager.current_step() < STEPS:
            step = manager.current_step()
            batches = [batch(group, 0, step, m) for m in range(MICRO)]
            local = own_gradient(net, batches)
            for x, y in batches:
                with accelerator.accumulate(prepared):
                    accelerator.backward(F.cross_entropy(prepared(x), y))
                    if accelerator.sync_gradients:
                        rows.write(manager, step, local, projections([p.grad for p in net.parameters()]))
                    optimizer.step()
                    optimizer.zero_grad()
    finally:
        accelerator.ft_shutdown()


def run_lightning(args: argparse.Namespace, group: int) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import ft_lightning  # noqa: F401  (registers "fault_tolerant_ddp")

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> int:
            return i

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build()
            self.local: list[float] = []
            self.step_at: int = 0

        def training_step(self, index, _batch_idx):  # type: ignore[no-untyped-def]
            manager = self.trainer.strategy.manager
            self.step_at = manager.current_step()
            x, y = batch(group, self.global_rank, self.step_at)
            self.local = own_gradient(self.net, [(x, y)])
            return F.cross_entropy(self.net(x), y)

        def on_after_backward(self) -> None:
            manager = self.trainer.strategy.manager
            Rows(args.out, group, self.global_rank).write(manager, self.step_at, self.local,
                                                          projections([p.grad for p in self.net.parameters()]))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(strategy="fault_tolerant_ddp", accelerator="cpu", devices=args.devices, max_steps=STEPS,
                         default_root_dir=os.path.dirname(args.out), logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(Module(), DataLoader(Batches(), batch_size=None, shuffle=False))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--api", required=True, choices=("core", "fabric", "accelerate", "lightning"))
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--plain-backward", action="store_true")
    p.add_argument("--torchft-wrapper", action="store_true")
    p.add_argument("--sync-quorum", action="store_true", help="core: the quorum (and any heal) before the forward")
    p.add_argument("--mix-backward", action="store_true",
                   help="core: a plain loss.backward() on the steps where step + group is odd, ddp.backward else")
    args = p.parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    {"core": run_core, "fabric": run_fabric, "accelerate": run_accelerate, "lightning": run_lightning}[args.api](
        args, group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
