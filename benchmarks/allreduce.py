"""Allreduce latency: ft_core's ProcessGroupGloo and ProcessGroupBabyGloo vs plain torch.distributed Gloo.

Two worker processes on loopback; for each size every implementation runs the same allreduce (SUM,
float32) and rank 0 reports median times. Target (reported, not asserted): ProcessGroupGloo within
1.05x of torch for sizes >= 1 MB.

    python -m benchmarks.allreduce [--sizes 1KB 1MB 100MB] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

DEFAULT_SIZES = ["1KB", "10KB", "100KB", "1MB", "10MB", "100MB"]
QUICK_SIZES = ["1KB", "1MB", "10MB"]
IMPLS = ("torch", "ft_gloo", "ft_baby_gloo")
UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}


def parse_size(text: str) -> int:
    """'1KB' -> 1024 bytes ('100MB', '512B', or a plain number of bytes)."""
    upper = text.strip().upper()
    for unit in ("KB", "MB", "GB", "B"):
        if upper.endswith(unit) and upper[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * UNITS[unit])
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"size {text!r} must look like 1KB, 10MB or a number of bytes")


def iterations(nbytes: int, quick: bool) -> int:
    budget = 2e8 if quick else 1e9  # bytes moved per implementation and size
    return max(3 if quick else 5, min(50 if quick else 200, int(budget / max(nbytes, 1))))


def _worker(store_addr: str, rank: int, sizes: list[int], quick: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, ReduceOp, TCPStore

    from ft_core.process_groups import ProcessGroupBabyGloo, ProcessGroupGloo

    torch.set_num_threads(1)
    host, port = store_addr.rsplit(":", 1)
    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=PrefixStore("torch", client), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    ours = ProcessGroupGloo(timeout=timedelta(seconds=60))
    ours.configure(f"{store_addr}/ours", "bench", rank, 2)
    baby = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    baby.configure(f"{store_addr}/baby", "bench", rank, 2)
    runners = {
        "torch": lambda t: dist.all_reduce(t),
        "ft_gloo": lambda t: ours.allreduce([t], ReduceOp.SUM).wait(),
        "ft_baby_gloo": lambda t: baby.allreduce([t], ReduceOp.SUM).wait(),
    }
    results: dict[str, dict[str, float]] = {}
    for nbytes in sizes:
        n = iterations(nbytes, quick)
        tensors = {impl: torch.ones(max(1, nbytes // 4)) for impl in IMPLS}
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for impl in IMPLS:
            for _ in range(2):  # warm-up (the Baby one moves its tensor to shared memory here)
                runners[impl](tensors[impl])
        for _ in range(n):  # interleaved, so drift in machine load hits every implementation alike
            for impl in IMPLS:
                dist.barrier()
                start = time.perf_counter()
                runners[impl](tensors[impl])
                times[impl].append(time.perf_counter() - start)
        results[str(nbytes)] = {impl: statistics.median(times[impl]) * 1e3 for impl in IMPLS}
    baby.shutdown()
    ours.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(results))


def run(quick: bool = False, sizes: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns {size_label: {impl_ms..., ft_gloo_ratio, ft_baby_gloo_ratio}} plus meta."""
    from torch._C._distributed_c10d import TCPStore

    labels = sizes or (QUICK_SIZES if quick else DEFAULT_SIZES)
    byte_sizes = [parse_size(s) for s in labels]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store_addr = f"127.0.0.1:{store.port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RES_OPTIONS="timeout:1 attempts:1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = [sys.executable, "-m", "benchmarks.allreduce", "--worker", store_addr, "--sizes", *labels]
    if quick:
        args.append("--quick")
    procs = [subprocess.Popen([*args, "--rank", str(r)], env=env, cwd=root, stdout=subprocess.PIPE)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"benchmark workers failed: exit codes {[p.returncode for p in procs]}")
    raw = json.loads(outs[0].decode().strip().splitlines()[-1])
    table: dict[str, Any] = {}
    for label, nbytes in zip(labels, byte_sizes):
        row = dict(raw[str(nbytes)])
        for impl in ("ft_gloo", "ft_baby_gloo"):
            row[f"{impl}_ratio"] = row[impl] / row["torch"] if row["torch"] > 0 else float("nan")
        table[label] = row
    big = [row["ft_gloo_ratio"] for label, row in table.items() if parse_size(label) >= 1 << 20]
    return {"sizes": table, "target": "ft_gloo <= 1.05x torch for sizes >= 1MB",
            "target_met": bool(big) and max(big) <= 1.05, "quick": quick}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", help="sizes like 1KB 1MB 100MB (default 1KB..100MB)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        labels = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
        _worker(args.worker, args.rank, [parse_size(s) for s in labels], args.quick)
        return 0
    result = run(quick=args.quick, sizes=args.sizes)
    from rich.console import Console
    from rich.table import Table

    table = Table(title="allreduce (2 processes, loopback, float32 SUM): median ms")
    for column in ("size", "torch gloo", "ft gloo", "ft baby gloo", "ft gloo / torch", "baby / torch"):
        table.add_column(column, justify="right")
    for label, row in result["sizes"].items():
        table.add_row(label, f"{row['torch']:.3f}", f"{row['ft_gloo']:.3f}", f"{row['ft_baby_gloo']:.3f}",
                      f"{row['ft_gloo_ratio']:.3f}x", f"{row['ft_baby_gloo_ratio']:.3f}x")
    console = Console()
    console.print(table)
    console.print(f"target: {result['target']}: {'met' if result['target_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
