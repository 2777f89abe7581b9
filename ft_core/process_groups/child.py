"""The child side of the subprocess ("Baby") process groups, plus the op encoding both sides share.

This module is what a spawned child imports, so it imports only the standard library, torch and the
small ft_core.net: a child must start fast and must not pull in the rest of ft_core.

Wire protocol (over two one-way multiprocessing pipes, local to this machine):
  parent -> child: ("op", op_id, name, args, opts, ready_event) | ("shutdown",)
  child -> parent: ("ready",) | ("init_error", kind, message)
                   | ("done", op_id) | ("error", op_id, kind, message)
`kind` is "timeout", "error" or "invalid" (the op could not be issued; the group is fine); tensors in `args` cross as shared memory (CPU) or CUDA IPC handles.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceScatterOptions,
    TCPStore,
)
from torch._C._distributed_c10d import ProcessGroup as C10dGroup

from ft_core import net
from ft_core.net import parse_store_addr

# Error messages from gloo/NCCL/the store that mean "a deadline passed" rather than "something broke".
_TIMEOUT_MARKERS = ("timed out", "timeout", "deadline")


def is_timeout_message(message: str) -> bool:
    """True when a backend error message describes an expired deadline."""
    low = message.lower()
    return any(marker in low for marker in _TIMEOUT_MARKERS)


def error_kind(exc: BaseException) -> str:
    """'timeout' or 'error': how a backend failure is reported across the pipe."""
    if isinstance(exc, TimeoutError) or is_timeout_message(str(exc)):
        return "timeout"
    return "error"


# NCCL aborts a non-blocking communicator reliably from another thread while one of its ops hangs only
# from this version on; with older NCCL, ncclCommAbort itself can hang, so ProcessGroupNCCL falls back
# to a blocking communicator whose hung op ends the process (torch's watchdog) instead.
NONBLOCKING_ABORT_MIN_NCCL = (2, 25)


def parse_nccl_version(version: Any) -> tuple[int, int, int]:
    """(major, minor, patch) from torch.cuda.nccl.version(): a tuple (torch >= 1.13) or the old int code."""
    if isinstance(version, int):
        if version >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
            return version // 10000, (version % 10000) // 100, version % 100
        return version // 1000, (version % 1000) // 100, version % 100
    major, minor, patch = (int(part) for part in tuple(version)[:3])
    return major, minor, patch


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch was built with; None when this torch has no NCCL (CPU builds)."""
    try:
        return parse_nccl_version(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def supports_nonblocking_abort(version: tuple[int, ...] | None) -> bool:
    """True when NCCL `version` can abort a non-blocking communicator with an op in flight."""
    return version is not None and tuple(version[:2]) >= NONBLOCKING_ABORT_MIN_NCCL


def connect_store(store_addr: str, timeout: timedelta) -> PrefixStore:
    """A TCPStore client (never the master) under the address's prefix; raises after `timeout`."""
    host, port, prefix = parse_store_addr(store_addr)
    client = TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return PrefixStore(prefix, client)


def gloo_bind_address(store_host: str) -> str | None:
    """The local address a Gloo group binds to reach peers that rendezvous at `store_host`: loopback for
    a loopback store, else the source address of the route toward it (not the host name's address, which
    is 127.0.1.1 on many Debian/Ubuntu hosts); None (Gloo's default device) when there is no route."""
    if net.is_loopback(store_host):
        return "127.0.0.1"
    try:
        return net.local_address_toward(store_host)
    except OSError:
        return None


def gloo_devices(hostname: str | None) -> list[Any]:
    """Gloo devices: GLOO_SOCKET_IFNAME's interfaces when set (comma-separated, as plain torch reads it),
    else one bound to `hostname`, else Gloo's default."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    names = [n.strip() for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    if names:
        return [ProcessGroupGloo.create_device(interface=name) for name in names]
    return [ProcessGroupGloo.create_device(hostname=hostname) if hostname else ProcessGroupGloo.create_default_device()]


def use_nccl_interface_toward(store_host: str) -> None:
    """Point NCCL's bootstrap and socket transport at the interface of the route toward `store_host`,
    unless NCCL_SOCKET_IFNAME is set (then NCCL reads it, as in plain torch) or the store is on loopback
    (NCCL's own choice, as before). NCCL reads the variable once per process, at its first communicator."""
    if os.environ.get("NCCL_SOCKET_IFNAME") or net.is_loopback(store_host):
        return
    address = gloo_bind_address(store_host)
    name = net.interface_of(address) if address else None
    if name:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"


class Waiter:
    """A named thread that waits on Works lacking a future (Gloo's reduce_scatter works have none)
    and then calls callback(error_or_None). Owned by one group: started on first use, close() ends it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, work: Any, callback: Any) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((work, callback))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, callback = item
            try:
                work.wait()
            except Exception as exc:  # handed to the callback, which reports it
                callback(exc)
                continue
            callback(None)

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


def on_completion(work: Any, waiter: Waiter, callback: Any) -> None:
    """Call callback(error_or_None) once `work` finishes: through its future, else through `waiter`."""
    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        waiter.add(work, callback)
        return

    def done(fut: Any) -> None:
        try:
            fut.wait()
        except Exception as exc:  # handed to the callback, which reports it
            callback(exc)
            return
        callback(None)

    future.add_done_callback(done)


# ---------------------------------------------------------------- op encoding (shared)

def reduce_op_name(op: Any) -> str:
    """Name of a ReduceOp / RedOpType / AllreduceOptions.reduceOp value, e.g. 'SUM'."""
    inner = getattr(op, "op", op)
    name = getattr(inner, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"cannot use reduce op {op!r}; pass a torch.distributed.ReduceOp")
    return name


def build_opts(name: str, spec: dict[str, Any]) -> Any:
    """Rebuild the c10d options object for collective `name` from its plain-dict spec."""
    if name == "allreduce":
        opts = AllreduceOptions()
    elif name == "allreduce_coalesced":
        opts = AllreduceCoalescedOptions()
    elif name in ("allgather", "allgather_into_tensor_coalesced"):
        opts = AllgatherOptions()
    elif name == "alltoall_base":
        opts = AllToAllOptions()
    elif name == "barrier":
        opts = BarrierOptions()
    elif name == "broadcast":
        opts = BroadcastOptions()
        opts.rootRank = int(spec.get("root_rank", 0))
        opts.rootTensor = int(spec.get("root_tensor", 0))
    elif name in ("reduce_scatter", "reduce_scatter_tensor_coalesced"):
        opts = ReduceScatterOptions()
    else:
        raise ValueError(f"unknown collective {name!r}")
    if "reduce_op" in spec:
        opts.reduceOp = getattr(dist.ReduceOp, spec["reduce_op"])
    if spec.get("timeout_s") is not None:
        opts.timeout = timedelta(seconds=float(spec["timeout_s"]))
    return opts


def opts_spec(name: str, opts: Any) -> dict[str, Any]:
    """Plain-dict form of a c10d options object (those objects do not pickle)."""
    spec: dict[str, Any] = {}
    if opts is None:
        return spec
    if name == "broadcast":
        spec["root_rank"] = int(opts.rootRank)
        spec["root_tensor"] = int(opts.rootTensor)
    if hasattr(opts, "reduceOp"):
        spec["reduce_op"] = reduce_op_name(opts.reduceOp)
    return spec


def run_op(pg: Any, name: str, args: tuple, opts_dict: dict[str, Any]) -> Any:
    """Issue collective `name` on a c10d backend; returns its Work."""
    if name == "send":
        tensors, dst, tag = args
        return pg.send(tensors, dst, tag)
    if name == "recv":
        tensors, src, tag = args
        return pg.recv(tensors, src, tag)
    opts = build_opts(name, opts_dict)
    if name == "alltoall_base":
        output, inp, out_splits, in_splits = args
        return pg.alltoall_base(output, inp, list(out_splits), list(in_splits), opts)
    if name == "barrier":
        return pg.barrier(opts)
    return getattr(pg, name)(*args, opts)


# ---------------------------------------------------------------- backends (shared)

def as_c10d_group(store: Any, rank: int, world_size: int, backend: Any, kind: str, devices: list[str]) -> Any:
    """Put a backend behind a c10d ProcessGroup: its dispatcher adds the coalesced/tensor variants
    (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced) the bare backend lacks."""
    backend_type = getattr(C10dGroup.BackendType, kind)
    group = C10dGroup(store, rank, world_size)
    group._set_default_backend(backend_type)
    for device in devices:
        group._register_backend(torch.device(device), backend_type, backend)
    return group


def new_backend(backend: str, store: Any, rank: int, world_size: int, connect_timeout: timedelta,
                op_timeout: timedelta, device: str | None, group_name: str,
                global_ranks: list[int] | None) -> Any:
    """Build a c10d group for `backend` ('gloo', 'nccl' or 'xccl'); used in-process and in children.

    Gloo: `device` is the address to bind ('' = the default interface; GLOO_SOCKET_IFNAME wins when set).
    NCCL/XCCL: the device string.
    The connect deadline covers building the group; the op deadline applies to each collective after.
    """
    ranks = list(global_ranks or range(world_size))
    if backend == "gloo":
        from torch._C._distributed_c10d import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = connect_timeout
        opts._devices = gloo_devices(device)
        opts.group_name = group_name
        opts.global_ranks_in_group = ranks
        pg = ProcessGroupGloo(store, rank, world_size, opts)
        pg.set_timeout(op_timeout)
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        return as_c10d_group(store, rank, world_size, pg, "GLOO", devices)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = op_timeout
        opts.group_name = group_name
        opts.global_ranks_in_group = ranks
        pg = ProcessGroupNCCL(store, rank, world_size, opts)
        pg._set_sequence_number_for_group()
        pg.eager_connect_single_device(torch.device(device or "cuda"))
        return as_c10d_group(store, rank, world_size, pg, "NCCL", ["cuda"])
    if backend == "xccl":
        from torch._C._distributed_c10d import ProcessGroupXCCL  # type: ignore[attr-defined]

        opts = ProcessGroupXCCL.Options()
        opts._timeout = op_timeout
        opts.global_ranks_in_group = ranks
        pg = ProcessGroupXCCL(store, rank, world_size, opts)
        return as_c10d_group(store, rank, world_size, pg, "XCCL", ["xpu"])
    raise ValueError(f"unknown backend {backend!r}; expected 'gloo', 'nccl' or 'xccl'")


@dataclass(frozen=True)
class ChildSpec:
    """Everything a child needs to build its process group (plain values: it is pickled to the child)."""

    backend: str
    store_addr: str
    rank: int
    world_size: int
    timeout_s: float
    start_timeout_s: float | None  # None: the whole build shares `deadline` (torchft: `timeout` bounds configure)
    deadline: float  # time.time() by which the group must be built when start_timeout_s is None
    device: str | None  # gloo: hostname to bind; nccl/xccl: device string like 'cuda:0'
    group_name: str
    global_ranks: tuple[int, ...] | None


def _ready_barrier(store: Any, spec: ChildSpec, timeout: timedelta) -> None:
    """Wait until every member's child has imported torch, so start-up skew doesn't eat the op timeout."""
    store.set(f"baby_ready/{spec.rank}", "1")
    store.wait([f"baby_ready/{r}" for r in range(spec.world_size)], timeout)


def build_deadlines(spec: ChildSpec, now: float) -> tuple[timedelta, timedelta]:
    """(start-up deadline for the store and the ready barrier, connect deadline for building the group).

    With an explicit start timeout, start-up has its own deadline and the build gets max(timeout, start);
    without one, both share what is left of `timeout` since configure began (torchft's bound)."""
    timeout = timedelta(seconds=spec.timeout_s)
    if spec.start_timeout_s is not None:
        start = timedelta(seconds=spec.start_timeout_s)
        return start, max(timeout, start)
    left = spec.deadline - now
    if left <= 0:
        raise TimeoutError(f"the child process took longer than the configure timeout ({spec.timeout_s:.1f}s) "
                           "to start; pass start_timeout= (FT_BABY_START_TIMEOUT_SEC) to give start-up its own deadline")
    return timedelta(seconds=left), timedelta(seconds=left)


def main(requests: Any, replies: Any, spec: ChildSpec) -> None:
    """Child entry point: build the backend, then run ops from the parent until the pipe closes."""
    send_lock = threading.Lock()

    def reply(message: tuple) -> None:
        with send_lock:
            try:
                replies.send(message)
            except (BrokenPipeError, EOFError, OSError):
                os._exit(0)  # parent is gone

    # Device backends complete on a stream; their module gives events and streams.
    accel = {"nccl": "cuda", "xccl": "xpu"}.get(spec.backend)
    dev = getattr(torch, accel) if accel else None
    try:
        if dev is not None:
            dev.set_device(torch.device(spec.device or accel))
        if spec.backend == "nccl":
            use_nccl_interface_toward(parse_store_addr(spec.store_addr)[0])
        # Recomputed before each stage: without start_timeout each stage gets what is left of `timeout`.
        store = connect_store(spec.store_addr, build_deadlines(spec, time.time())[0])
        _ready_barrier(store, spec, build_deadlines(spec, time.time())[0])
        pg = new_backend(spec.backend, store, spec.rank, spec.world_size, build_deadlines(spec, time.time())[1],
                         timedelta(seconds=spec.timeout_s),
                         spec.device, spec.group_name, list(spec.global_ranks) if spec.global_ranks else None)
    except Exception as exc:  # reported to the parent, which raises it from configure()
        reply(("init_error", error_kind(exc), f"{type(exc).__name__}: {exc}"))
        os._exit(0)
    reply(("ready",))

    inflight: dict[int, Any] = {}
    inflight_lock = threading.Lock()
    completions: queue.Queue = queue.Queue()
    kept_events: collections.deque = collections.deque(maxlen=256)

    def finish(op_id: int, exc: BaseException | None) -> None:
        with inflight_lock:
            inflight.pop(op_id, None)
        if exc is None:
            reply(("done", op_id))
        else:
            reply(("error", op_id, error_kind(exc), f"{type(exc).__name__}: {exc}"))

    def complete_cuda() -> None:
        # Device ops: report done only once the stream reached the op's end, so the parent's
        # later reads are ordered after it (the parent blocks on this report in wait()).
        while True:
            item = completions.get()
            if item is None:
                return
            op_id, work, event = item
            try:
                work.wait()
                event.synchronize()
                finish(op_id, None)
            except Exception as exc:  # reported to the parent
                finish(op_id, exc)

    waiter = Waiter("ft-baby-child-waiter")
    if dev is not None:
        threading.Thread(target=complete_cuda, name="ft-baby-child-complete", daemon=True).start()

    while True:
        try:
            message = requests.recv()
        except (EOFError, OSError):
            break
        if message[0] == "shutdown":
            break
        _, op_id, name, args, opts_dict, ready_event = message
        try:
            if ready_event is not None:
                kept_events.append(ready_event)
                dev.current_stream().wait_event(ready_event)
            work = run_op(pg, name, args, opts_dict)
        except Exception as exc:  # bad arguments or an unsupported op: the group itself is fine
            reply(("error", op_id, "invalid", f"{type(exc).__name__}: {exc}"))
            continue
        with inflight_lock:
            inflight[op_id] = (args, work)
        if dev is not None:
            work.wait()  # orders the current stream after the collective (no CPU block)
            done = dev.Event()
            done.record(dev.current_stream())
            completions.put((op_id, work, done))
        else:
            on_completion(work, waiter, lambda exc, op_id=op_id: finish(op_id, exc))
    # Skip destructors: a backend with a hung op could block in them; the parent reaps us.
    os._exit(0)
