"""DiLoCo vs per-step fault-tolerant DDP: bytes sent across replica groups per 1,000 inner steps and
step time, for sync_every H in {1, 10, 100}, for ft_core and, in the same run, Meta's torchft.
Two replica groups x 1 process (Gloo, loopback), each with its implementation's Manager; per-step
mode is the implementation's DDP wrapper (one cross-group allreduce of the gradients per step),
DiLoCo mode is its `local_sgd.DiLoCo` (bucketized pseudo-gradients every H steps, Nesterov outer SGD).
Both implementations run the same loop, model, data and optimizers, through their public API
(torchft: `torchft.Manager`, `torchft.ddp.DistributedDataParallel`, `torchft.local_sgd.DiLoCo`, its
lighthouse from `torchft.coordination`). Bytes are the payload a group hands to `Manager.allreduce`
(a 2-member ring sends about as much again as it receives); step time is the median loop iteration;
each implementation's ratio is against its own per-step DDP. Cases alternate between the two.

    python -m benchmarks.diloco [--quick] [--steps 300] [--model mlp3.7m] [--impl ft_core,torchft]

torchft rows need torchft importable (here: /work/tfvenv/bin/python -m benchmarks.diloco); without it
they are left out and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
from torch import nn

from benchmarks import _harness, _models

MODELS = ("mlp3.7m", "mlp0.3m")  # of benchmarks/_models.py


def _manager(args: argparse.Namespace, timeout: timedelta, state: dict) -> tuple[object, object, type]:
    """(counting Manager, its process group, the implementation's DDP wrapper and DiLoCo) for args.impl."""
    if args.impl == "torchft":
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.ddp import DistributedDataParallel
        from torchft.local_sgd import DiLoCo

        class TorchftCounting(Manager):
            sent = 0
            calls = 0

            def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                          reduce_op: object = torch.distributed.ReduceOp.AVG) -> object:
                TorchftCounting.sent += tensor.numel() * tensor.element_size()
                TorchftCounting.calls += 1
                return super().allreduce(tensor, should_quantize=should_quantize, reduce_op=reduce_op)

        state["store"] = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupGloo(timeout=timeout)
        manager = TorchftCounting(pg=pg, load_state_dict=state["load"], state_dict=state["save"], min_replica_size=1,
                                  use_async_quorum=args.mode == "ddp", timeout=timeout, quorum_timeout=timeout,
                                  connect_timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1",
                                  store_port=state["store"].port, lighthouse_addr=args.lighthouse,
                                  replica_id=f"g{args.group}", hostname="127.0.0.1", init_sync=False)
        return manager, pg, (TorchftCounting, DistributedDataParallel, DiLoCo)

    from ft_core.ddp import DistributedDataParallel
    from ft_core.local_sgd import DiLoCo
    from ft_core.manager import Manager
    from ft_core.process_groups import ProcessGroupGloo

    class CountingManager(Manager):
        sent = 0
        calls = 0

        def allreduce(self, tensor: torch.Tensor, reduce_op: object = torch.distributed.ReduceOp.AVG,
                      should_quantize: bool = False) -> object:
            CountingManager.sent += tensor.numel() * tensor.element_size()
            CountingManager.calls += 1
            return super().allreduce(tensor, reduce_op)

    pg = ProcessGroupGloo(timeout=timeout)
    manager = CountingManager(pg, lighthouse_addr=args.lighthouse, replica_id=f"g{args.group}", timeout=timeout,
                              quorum_timeout=timeout, connect_timeout=timeout, use_async_quorum=args.mode == "ddp",
                              init_sync=False)
    manager.register_state_dict_fn("train", state["load"], state["save"])
    return manager, pg, (CountingManager, DistributedDataParallel, DiLoCo)


def worker(args: argparse.Namespace) -> None:
    """One replica group: run `args.steps` inner steps in mode args.mode with args.impl; write step times and bytes."""
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    model = _models.build(args.model, seed=0)
    # the same optimizer in both modes (DiLoCo's inner one)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    state: dict = {"load": load, "save": lambda: {"model": model.state_dict(), "optim": inner.state_dict()}}
    manager, pg, (counting, ddp_cls, diloco_cls) = _manager(args, timeout, state)
    x = torch.randn(32, _models.MODELS[args.model][0], generator=torch.Generator().manual_seed(args.group))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(args.group))
    times: list[float] = []
    try:
        if args.mode == "ddp":
            ddp = ddp_cls(manager, model)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                manager.start_quorum()
                inner.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                if manager.should_commit():
                    inner.step()
                times.append(time.perf_counter() - t0)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            with diloco_cls(manager, [model], inner, outer, sync_every=args.sync_every, pin_memory=False,
                            use_bucketization=True, bucket_cap_mb=32):
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    inner.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    inner.step()  # a sync every sync_every steps, inside this call
                    times.append(time.perf_counter() - t0)
        with open(args.out, "w") as f:
            json.dump({"times": times, "bytes": counting.sent, "allreduces": counting.calls,
                       "commits": manager.current_step()}, f)
    finally:
        manager.shutdown()
        if args.impl != "torchft":
            pg.shutdown()


def _lighthouse(impl: str) -> tuple[object, str]:
    """A 2-replica lighthouse of `impl` and the address its workers use (an IP: no name lookups)."""
    if impl == "torchft":
        from torchft.coordination import LighthouseServer as TorchftLighthouse

        lighthouse = TorchftLighthouse(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
        return lighthouse, f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    from ft_core.control.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000, http_bind=None)
    return lighthouse, lighthouse.address()


def run_case(impl: str, mode: str, sync_every: int, steps: int, model: str, tmp: str) -> dict[str, float]:
    outs = [os.path.join(tmp, f"{impl}_{mode}_{sync_every}_{g}.json") for g in range(2)]
    lighthouse, address = _lighthouse(impl)
    try:
        _harness.run_workers([["-m", "benchmarks.diloco", "--worker", "--impl", impl, "--mode", mode,
                               "--group", str(g), "--sync-every", str(sync_every), "--steps", str(steps),
                               "--model", model, "--lighthouse", address, "--out", outs[g]] for g in range(2)],
                             timeout_s=900)
    finally:
        lighthouse.shutdown()
    rows = []
    for path in outs:
        with open(path) as f:
            rows.append(json.load(f))
    warm = min(10, steps // 5)
    step_s = statistics.median(t for r in rows for t in r["times"][warm:])
    mean_s = statistics.mean(t for r in rows for t in r["times"][warm:])
    return {"step_ms": step_s * 1e3, "mean_step_ms": mean_s * 1e3,
            "bytes_per_1000_steps": rows[0]["bytes"] / steps * 1000, "allreduces": rows[0]["allreduces"],
            "commits": rows[0]["commits"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--model", default="mlp3.7m", choices=sorted(MODELS))
    p.add_argument("--impl", default="ft_core,torchft", help="comma-separated: ft_core, torchft")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ddp")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--lighthouse", default="")
    args = p.parse_args()
    if args.worker:
        args.steps = args.steps or 100
        worker(args)
        return
    steps = args.steps or (200 if args.quick else 1000)
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = set(impls) - {"ft_core", "torchft"}
    if unknown:
        p.error(f"--impl: unknown {sorted(unknown)}; use ft_core and/or torchft")
    note = ""
    if "torchft" in impls and not _harness.torchft_available():
        impls.remove("torchft")
        note = " (torchft not importable by this interpreter: its rows are left out)"
    cases = [("ddp", 1)] + [("diloco", h) for h in (1, 10, 100)]
    results: dict[str, dict[str, dict[str, float]]] = {impl: {} for impl in impls}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, h in cases:  # alternate the implementations case by case (the machine's load drifts)
            for impl in impls:
                results[impl]["ddp" if mode == "ddp" else f"diloco_H{h}"] = run_case(impl, mode, h, steps,
                                                                                     args.model, tmp)
    lines = [f"DiLoCo vs per-step DDP, {args.model}, 2 replica groups x 1 process, {steps} inner steps, "
             f"{time.strftime('%Y-%m-%d')}{note}",
             "| impl | mode | bytes across groups / 1,000 inner steps (per group) | cross-group allreduces | "
             "commits | median step (ms) | mean step (ms) | step-time ratio vs its DDP (median / mean) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, h in cases:
        name = "ddp" if mode == "ddp" else f"diloco_H{h}"
        for impl in impls:
            r, base = results[impl][name], results[impl]["ddp"]
            lines.append(f"| {impl} | {name} | {r['bytes_per_1000_steps'] / 1e6:.1f} MB | {r['allreduces']} | "
                         f"{r['commits']} | {r['step_ms']:.2f} | {r['mean_step_ms']:.2f} | "
                         f"{r['step_ms'] / base['step_ms']:.3f} / {r['mean_step_ms'] / base['mean_step_ms']:.3f} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
