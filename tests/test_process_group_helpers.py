"""Helpers for the process-group tests: ranks as named threads, torch's own Gloo as the reference,
the collective table, and resource counting for leak checks."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceOp,
    ReduceScatterOptions,
    TCPStore,
)
from torch._C._distributed_c10d import (
    ProcessGroup as C10dGroup,
)
from torch._C._distributed_c10d import (
    ProcessGroupGloo as TorchGloo,
)


def run_ranks(fn: Callable[[int], Any], ranks: list[int], timeout: float = 60.0) -> list[Any]:
    """Run fn(rank) for each rank in its own named thread; returns results, re-raises the first error."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # re-raised below in the test thread
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), name=f"test-rank-{r}", daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"{thread.name} still running after {timeout}s"
    if errors:
        raise next(iter(errors.values()))
    return [results[r] for r in ranks]


def torch_gloo_group(store_port: int, prefix: str, rank: int, world: int) -> C10dGroup:
    """torch's own Gloo group (the reference the tests compare against)."""
    store = PrefixStore(prefix, TCPStore("127.0.0.1", store_port, is_master=False,
                                         timeout=timedelta(seconds=20)))
    opts = TorchGloo._Options()
    opts._timeout = timedelta(seconds=20)
    opts._devices = [TorchGloo.create_device(hostname="127.0.0.1")]
    backend = TorchGloo(store, rank, world, opts)
    group = C10dGroup(store, rank, world)
    group._set_default_backend(C10dGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), C10dGroup.BackendType.GLOO, backend)
    return group


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 9, shape, generator=gen)
    return values.to(dtype) if dtype in (torch.int64, torch.int32) else (values.float() * 0.25).to(dtype)


def _opts(cls: Any, reduce_op: Any = None) -> Any:
    opts = cls()
    if reduce_op is not None:
        opts.reduceOp = reduce_op
    return opts


def collective_call(name: str, dtype: torch.dtype, rank: int, world: int, seed: int) -> tuple[tuple, Any, list]:
    """(args, opts, outputs) for one table case; inputs depend on (rank, seed) only."""
    n = 6
    x = _data((n,), dtype, seed * 31 + rank)
    if name == "allreduce_sum":
        return ([x],), _opts(AllreduceOptions, ReduceOp.SUM), [x]
    if name == "allreduce_avg":
        return ([x],), _opts(AllreduceOptions, ReduceOp.AVG), [x]
    if name == "allreduce_max":
        return ([x],), _opts(AllreduceOptions, ReduceOp.MAX), [x]
    if name == "allreduce_coalesced":
        y = _data((3, 2), dtype, seed * 37 + rank)
        return ([x, y],), _opts(AllreduceCoalescedOptions, ReduceOp.SUM), [x, y]
    if name == "allgather":
        outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
        return ([outs], [x]), AllgatherOptions(), outs
    if name == "allgather_into_tensor_coalesced":
        out = torch.zeros(n * world, dtype=dtype)
        return ([out], [x]), AllgatherOptions(), [out]
    if name == "alltoall_base":
        inp = _data((2 * world,), dtype, seed * 41 + rank)
        out = torch.zeros(2 * world, dtype=dtype)
        return (out, inp, [], []), AllToAllOptions(), [out]
    if name == "broadcast":
        opts = BroadcastOptions()
        opts.rootRank = world - 1
        opts.rootTensor = 0
        return ([x],), opts, [x]
    if name == "reduce_scatter":
        out = torch.zeros(n, dtype=dtype)
        ins = [_data((n,), dtype, seed * 43 + rank * 7 + i) for i in range(world)]
        return ([out], [ins]), _opts(ReduceScatterOptions, ReduceOp.SUM), [out]
    if name == "reduce_scatter_tensor_coalesced":
        out = torch.zeros(n, dtype=dtype)
        inp = _data((n * world,), dtype, seed * 47 + rank)
        return ([out], [inp]), _opts(ReduceScatterOptions, ReduceOp.SUM), [out]
    if name == "barrier":
        return (), BarrierOptions(), []
    raise AssertionError(name)


COLLECTIVE_CASES = ("allreduce_sum", "allreduce_avg", "allreduce_max", "allreduce_coalesced", "allgather",
                    "allgather_into_tensor_coalesced", "alltoall_base", "broadcast", "reduce_scatter",
                    "reduce_scatter_tensor_coalesced", "barrier", "send_recv")
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def issue(group: Any, name: str, args: tuple, opts: Any) -> Any:
    method = {"allreduce_sum": "allreduce", "allreduce_avg": "allreduce", "allreduce_max": "allreduce"}.get(name, name)
    if method == "barrier":
        return group.barrier(opts)
    return getattr(group, method)(*args, opts)


def run_case(group: Any, name: str, dtype: torch.dtype, rank: int, world: int, seed: int,
             use_future: bool = False) -> list[torch.Tensor]:
    """Run one table case on `group` (waiting on the Work, or on its future); returns the outputs."""
    if name == "send_recv":
        x = _data((5,), dtype, seed * 53 + rank)
        got = torch.zeros(5, dtype=dtype)
        send = group.send([x], (rank + 1) % world, 7)
        recv = group.recv([got], (rank - 1) % world, 7)
        send.wait()
        recv.wait()
        return [got]
    args, opts, outputs = collective_call(name, dtype, rank, world, seed)
    work = issue(group, name, args, opts)
    if use_future:
        work.get_future().wait()
    else:
        work.wait()
    return [t.clone() for t in outputs]


def table_cases(world: int) -> list[tuple[str, torch.dtype]]:
    return [(name, dtype) for name in COLLECTIVE_CASES for dtype in DTYPES
            if not (name == "send_recv" and world == 1) and not (name == "allreduce_avg" and not dtype.is_floating_point)]


def resources() -> tuple[int, int, frozenset[str]]:
    """(open fds, OS threads, child pids) of this process, after a garbage collection."""
    gc.collect()
    tasks = os.listdir("/proc/self/task")
    children: set[str] = set()
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children.update(f.read().split())
        except FileNotFoundError:
            continue
    return len(os.listdir("/proc/self/fd")), len(tasks), frozenset(children)
