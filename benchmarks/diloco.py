"""DiLoCo vs per-step fault-tolerant DDP: bytes sent across replica groups per 1,000 inner steps and
step time, for sync_every H in {1, 10, 100}. Two replica groups x 1 process (Gloo, loopback), each
with the ft_core Manager; per-step mode is ft_core's DDP wrapper (one cross-group allreduce of the
gradients per step), DiLoCo mode is `ft_core.local_sgd.DiLoCo` (bucketized pseudo-gradients every
H steps, Nesterov outer SGD). Bytes are the payload this group hands to `Manager.allreduce` (a
2-member ring sends about as much again as it receives); step time is the median loop iteration.

    python -m benchmarks.diloco [--quick] [--steps 300] [--model mlp3.7m]

torchft is not run side by side here: torchft 0.2.0 needs opentelemetry and its Rust servers, which
this environment does not carry; see docs/coming_from_torchft.md.
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

from benchmarks import _harness

MODELS = {"mlp3.7m": (1024, 2048, 768, 10), "mlp0.3m": (256, 512, 256, 10)}


def _model(name: str) -> nn.Module:
    dims = MODELS[name]
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def worker(args: argparse.Namespace) -> None:
    """One replica group: run `args.steps` inner steps in mode args.mode; write step times and bytes."""
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

    torch.set_num_threads(1)
    torch.manual_seed(0)
    timeout = timedelta(seconds=60)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = CountingManager(pg, lighthouse_addr=args.lighthouse, replica_id=f"g{args.group}", timeout=timeout,
                              quorum_timeout=timeout, connect_timeout=timeout, use_async_quorum=args.mode == "ddp",
                              init_sync=False)
    model = _model(args.model)
    x = torch.randn(32, MODELS[args.model][0], generator=torch.Generator().manual_seed(args.group))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(args.group))
    times: list[float] = []
    try:
        if args.mode == "ddp":
            ddp = DistributedDataParallel(manager, model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                manager.start_quorum()
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                if manager.should_commit():
                    opt.step()
                times.append(time.perf_counter() - t0)
        else:
            inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # the same optimizer as per-step mode
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every, use_bucketization=True,
                        bucket_cap_mb=32):
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    inner.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    inner.step()  # a sync every sync_every steps, inside this call
                    times.append(time.perf_counter() - t0)
        with open(args.out, "w") as f:
            json.dump({"times": times, "bytes": CountingManager.sent, "allreduces": CountingManager.calls,
                       "commits": manager.current_step()}, f)
    finally:
        manager.shutdown()
        pg.shutdown()


def run_case(mode: str, sync_every: int, steps: int, model: str, tmp: str) -> dict[str, float]:
    from ft_core.control.lighthouse import LighthouseServer

    outs = [os.path.join(tmp, f"{mode}_{sync_every}_{g}.json") for g in range(2)]
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000, http_bind=None) as lh:
        _harness.run_workers([["-m", "benchmarks.diloco", "--worker", "--mode", mode, "--group", str(g),
                               "--sync-every", str(sync_every), "--steps", str(steps), "--model", model,
                               "--lighthouse", lh.address(), "--out", outs[g]] for g in range(2)], timeout_s=900)
    rows = [json.load(open(o)) for o in outs]
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
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["ddp"] = run_case("ddp", 1, steps, args.model, tmp)
        for h in (1, 10, 100):
            results[f"diloco_H{h}"] = run_case("diloco", h, steps, args.model, tmp)
    base = results["ddp"]
    lines = [f"DiLoCo vs per-step DDP, {args.model}, 2 replica groups x 1 process, {steps} inner steps, "
             f"{time.strftime('%Y-%m-%d')}",
             "| mode | bytes across groups / 1,000 inner steps (per group) | cross-group allreduces | "
             "median step (ms) | mean step (ms) | step-time ratio vs DDP (median / mean) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['bytes_per_1000_steps'] / 1e6:.1f} MB | {r['allreduces']} | {r['step_ms']:.2f} | "
                     f"{r['mean_step_ms']:.2f} | {r['step_ms'] / base['step_ms']:.3f} / "
                     f"{r['mean_step_ms'] / base['mean_step_ms']:.3f} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
