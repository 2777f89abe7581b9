"""One training process of the healthy-path overhead benchmark.

Modes (each job is 2 processes; the ft/torchft modes are 2 replica groups x 1 process):
- `ddp`: plain torch DDP over Gloo (the baseline); `ft`: ft_core Manager + DDP + OptimizerWrapper;
  `torchft`: Meta's torchft Manager + DDP + Optimizer (when installed);
- `lightning_ddp`: plain Lightning `strategy="ddp"` (gloo, CPU); `lightning_ft`: our
  `FaultTolerantDDPStrategy`; step time = callback's on_train_batch_start -> on_train_batch_end;
- `accelerate_ddp`: plain Accelerate DDP (multi-CPU, gloo); `accelerate_ft`: our
  `FaultTolerantAccelerator`; step time = the training loop's iteration.
Writes {"mode", "rank", "step_times_s", "phases_s"} as JSON to --out; phases_s (core API, torch DDP and
torchft): per timed step, the wall time of zero_grad / forward / backward / step and the process CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import _models

PHASES = ("zero_grad", "forward", "backward", "step")
_PHASE_TIMES: dict[str, list[float]] = {}  # filled by the core-API, torch DDP and torchft modes
_EXTRA: dict[str, Any] = {}  # thread_cpu_ms (with phases); core API: bucket_copies


def _thread_kind(name: str) -> str:
    """A thread's name without the per-run parts: `ft-quorum[bench_0:9f2c/0]_0` -> `ft-quorum`."""
    name = name.split("[")[0].split("-bench_")[0]
    return re.sub(r"[-_ ]?\(?\d+\)?$", "", name) or name


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's live threads, summed by kind (Linux /proc; {} elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:  # the thread just ended
            continue
        kind = _thread_kind(names.get(int(tid)) or stat[stat.index("(") + 1:stat.rindex(")")])
        fields = stat[stat.rindex(")") + 2:].split()
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class _ThreadCPU:
    """CPU per timed step of each kind of thread, from the first timed step to the last (into _EXTRA)."""

    def __init__(self, args) -> None:
        self._steps = args.steps
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = thread_cpu()

    def stop(self) -> None:
        after = thread_cpu()
        _EXTRA["thread_cpu_ms"] = {k: round((v - self._before.get(k, 0.0)) * 1000 / self._steps, 3)
                                   for k, v in sorted(after.items(), key=lambda kv: -kv[1])}


def _train(model, optimizer, args, phases: dict[str, list[float]] | None = None, backward=None) -> list[float]:
    """The timed loop; `phases` (when given) gets each timed step's wall time per phase and the
    process CPU time of the step ("cpu": every thread of this process, ours and torch's), and
    _EXTRA["thread_cpu_ms"] the CPU per timed step of each kind of thread (10 ms clock ticks)."""
    times = []
    before: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        x, y = _models.batch(args.model, args.batch_size, step)
        if step == args.warmup and phases is not None:
            before = thread_cpu()
        cpu0 = time.process_time()
        start = time.perf_counter()
        optimizer.zero_grad()
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t2 = time.perf_counter()
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        t3 = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        if step >= args.warmup:
            times.append(end - start)
            if phases is not None:
                for name, value in zip(PHASES + ("cpu",), (t1 - start, t2 - t1, t3 - t2, end - t3,
                                                           time.process_time() - cpu0)):
                    phases.setdefault(name, []).append(value)
    if phases is not None:
        after = thread_cpu()
        _EXTRA["thread_cpu_ms"] = {k: round((v - before.get(k, 0.0)) * 1000 / args.steps, 3)
                                   for k, v in sorted(after.items(), key=lambda kv: -kv[1])}
    return times


def run_ddp(args) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=60))
    try:
        model = torch.nn.parallel.DistributedDataParallel(_models.build(args.model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return _train(model, optimizer, args, _PHASE_TIMES)
    finally:
        dist.destroy_process_group()


def run_ft(args) -> list[float]:
    from ft_core.ddp import DistributedDataParallel
    from ft_core.manager import Manager
    from ft_core.optim import OptimizerWrapper
    from ft_core.process_groups import ProcessGroupGloo

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=args.world_size,
                      lighthouse_addr=args.lighthouse, replica_id=f"bench_{args.rank}", rank=0, world_size=1,
                      hostname="127.0.0.1", timeout=timedelta(seconds=30))
    try:
        model = DistributedDataParallel(manager, _models.build(args.model))
        optimizer = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        # the core API's backward divides by the loss (ft_core.ddp.backward_scale); ft_plain: loss.backward()
        times = _train(model, optimizer, args, _PHASE_TIMES, None if args.mode == "ft_plain" else model.backward)
        _EXTRA["bucket_copies"] = model._ft_hook_state.reducer.copies  # DDP buckets that missed the no-copy path
        return times
    finally:
        manager.shutdown()


def run_torchft(args) -> list[float]:
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    model = _models.build(args.model)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load_state(state) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def save_state():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), load_state_dict=load_state,
                      state_dict=save_state, min_replica_size=args.world_size, lighthouse_addr=args.lighthouse,
                      replica_id=f"bench_{args.rank}", rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, hostname="127.0.0.1", timeout=timedelta(seconds=30))
    try:
        ddp_model = DistributedDataParallel(manager, model)
        return _train(ddp_model, Optimizer(manager, inner), args, _PHASE_TIMES)
    finally:
        manager.shutdown()


def _dataset(args):
    """Every rank's (warmup + steps) batches, as one TensorDataset sharded by the sampler."""
    from torch.utils.data import TensorDataset

    xs, ys = zip(*(_models.batch(args.model, args.batch_size, step)
                   for step in range((args.warmup + args.steps) * args.world_size)))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def _torchrun_env(args) -> None:
    """The variables torchrun / Lightning's launcher would set for rank `args.rank` of 2."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.master_port), "RANK": str(args.rank),
                       "LOCAL_RANK": str(args.rank), "WORLD_SIZE": str(args.world_size), "NODE_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(args.world_size)})


def _run_lightning(args, ft: bool) -> list[float]:
    import logging

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _models.build(args.model)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return DataLoader(_dataset(args), batch_size=args.batch_size, shuffle=False)

    cpu = _ThreadCPU(args)

    class StepTimer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == args.warmup:
                cpu.start()
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx >= args.warmup:
                times.append(time.perf_counter() - self.started)
            if batch_idx == args.warmup + args.steps - 1:
                cpu.stop()
                if ft:  # the DDP wrapper, while fit runs (teardown unwraps it)
                    _EXTRA["bucket_copies"] = trainer.strategy.model._ft_hook_state.reducer.copies

    if ft:
        from ft_lightning import FaultTolerantDDPStrategy

        strategy = FaultTolerantDDPStrategy(lighthouse_addr=args.lighthouse, replica_group_id=args.rank,
                                            num_replica_groups=args.world_size, min_replica_size=args.world_size,
                                            timeout=30.0, process_group_backend="gloo")
        devices = 1
    else:
        from lightning.pytorch.strategies import DDPStrategy

        _torchrun_env(args)
        strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
        devices = args.world_size
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=1,
                         max_steps=args.warmup + args.steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         default_root_dir=args.workdir, callbacks=[StepTimer()])
    trainer.fit(Module())
    if trainer.world_size != devices or len(times) != args.steps:
        raise RuntimeError(f"Lightning ran {len(times)} timed steps on {trainer.world_size} process(es), expected "
                           f"{args.steps} on {devices}")
    if ft:
        trainer.strategy.manager.shutdown()
    return times


def _run_accelerate(args, ft: bool) -> list[float]:
    if ft:
        from ft_lightning.accelerate import (
            FaultTolerancePlugin,
            FaultTolerantAccelerator,
        )

        plugin = FaultTolerancePlugin(lighthouse=args.lighthouse, replica_id=args.rank,
                                      num_replica_groups=args.world_size, min_replica_size=args.world_size,
                                      timeout=30.0, backend="gloo")
        accelerator = FaultTolerantAccelerator(ft=plugin, cpu=True)
    else:
        from accelerate import Accelerator

        _torchrun_env(args)
        accelerator = Accelerator(cpu=True)
    if accelerator.num_processes != (1 if ft else args.world_size):
        raise RuntimeError(f"Accelerate started {accelerator.num_processes} process(es) per job, expected DDP of 2")
    model = _models.build(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    if not ft and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(f"plain Accelerate did not wrap the model in DDP ({type(model).__name__})")
    times = []
    cpu = _ThreadCPU(args)
    try:
        for step in range(args.warmup + args.steps):
            x, y = _models.batch(args.model, args.batch_size, step)
            if step == args.warmup:
                cpu.start()
            start = time.perf_counter()
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        cpu.stop()
        if ft:
            _EXTRA["bucket_copies"] = model._ft_hook_state.reducer.copies
    finally:
        accelerator.end_training()
    return times


MODES = {"ddp": run_ddp, "ft": run_ft, "ft_plain": run_ft, "torchft": run_torchft,
         "lightning_ddp": lambda args: _run_lightning(args, ft=False),
         "lightning_ft": lambda args: _run_lightning(args, ft=True),
         "accelerate_ddp": lambda args: _run_accelerate(args, ft=False),
         "accelerate_ft": lambda args: _run_accelerate(args, ft=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--master-port", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--model", default="mlp3.7m", choices=sorted(_models.MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default=None, help="Lightning's default_root_dir")
    args = parser.parse_args()
    torch.set_num_threads(1)
    times = MODES[args.mode](args)
    with open(args.out, "w") as fh:
        json.dump({"mode": args.mode, "rank": args.rank, "step_times_s": times, "phases_s": _PHASE_TIMES,
                   **_EXTRA}, fh)
    os._exit(0)  # skip slow interpreter teardown of gRPC/torch threads; results are on disk


if __name__ == "__main__":
    main()
