"""The base of every fault-tolerant process group: a c10d ProcessGroup that can be rebuilt in place.

Subclassing torch's c10d `ProcessGroup` lets these objects go wherever torch expects one (DDP's
`process_group=`, `dist.all_reduce(group=...)`, functional collectives after `register()`); torch's
C++ calls our Python collectives through its trampoline. `size()`/`rank()` follow the latest
`configure()`, since membership changes with every quorum.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    _register_process_group,
    _unregister_process_group,
)
from torch._C._distributed_c10d import ProcessGroup as _C10dProcessGroup

from ft_core import settings
from ft_core.errors import FTTimeoutError, ProcessGroupError
from ft_core.net import parse_store_addr
from ft_core.process_groups.child import error_kind

logger = logging.getLogger("ft_core.process_groups")

DEFAULT_TIMEOUT: timedelta = settings.get("FT_TIMEOUT_SEC").default
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_into_tensor_coalesced",
               "alltoall_base", "barrier", "broadcast", "reduce_scatter", "reduce_scatter_tensor_coalesced",
               "send", "recv")


def as_error(exc: BaseException, context: str, broken: bool = True) -> Exception:
    """Map a backend failure to FTTimeoutError (a deadline passed) or ProcessGroupError, naming the call.

    `broken`: the failure broke the group (say so) rather than only this call's arguments.
    """
    if isinstance(exc, (FTTimeoutError, ProcessGroupError)):
        return exc
    message = f"{context}: {type(exc).__name__}: {exc}"
    if error_kind(exc) == "timeout":
        return FTTimeoutError(message + " (a peer is dead or hung; the group must be reconfigured)")
    if not broken:
        return ProcessGroupError(message)
    return ProcessGroupError(message + " (the group must be reconfigured before the next collective)")


# ---------------------------------------------------------------- options normalisation

def allreduce_opts(opts: Any) -> AllreduceOptions:
    """Accept AllreduceOptions, a ReduceOp, or None (SUM)."""
    if isinstance(opts, AllreduceOptions):
        return opts
    out = AllreduceOptions()
    if opts is not None:
        out.reduceOp = opts
    return out


def allreduce_coalesced_opts(opts: Any) -> AllreduceCoalescedOptions:
    if isinstance(opts, AllreduceCoalescedOptions):
        return opts
    out = AllreduceCoalescedOptions()
    if isinstance(opts, AllreduceOptions):
        out.reduceOp = opts.reduceOp
    elif opts is not None:
        out.reduceOp = opts
    return out


def reduce_scatter_opts(opts: Any) -> ReduceScatterOptions:
    if isinstance(opts, ReduceScatterOptions):
        return opts
    out = ReduceScatterOptions()
    if opts is not None:
        out.reduceOp = opts
    return out


def broadcast_opts(opts: Any) -> BroadcastOptions:
    """Accept BroadcastOptions, a root rank (int), or None (root 0)."""
    if isinstance(opts, BroadcastOptions):
        return opts
    out = BroadcastOptions()
    if opts is not None:
        out.rootRank = int(opts)
        out.rootTensor = 0
    return out


def default_opts(name: str, opts: Any) -> Any:
    """Normalise the `opts` argument of collective `name` into its c10d options object."""
    if name == "allreduce":
        return allreduce_opts(opts)
    if name == "allreduce_coalesced":
        return allreduce_coalesced_opts(opts)
    if name in ("reduce_scatter", "reduce_scatter_tensor_coalesced"):
        return reduce_scatter_opts(opts)
    if name == "broadcast":
        return broadcast_opts(opts)
    if opts is not None:
        return opts
    return {"allgather": AllgatherOptions, "allgather_into_tensor_coalesced": AllgatherOptions,
            "alltoall_base": AllToAllOptions, "barrier": BarrierOptions}[name]()


def op_result(name: str, args: tuple) -> Any:
    """What a collective's future resolves to: its output tensors (torch's convention)."""
    if name in ("allreduce", "allreduce_coalesced", "broadcast", "send", "recv"):
        return args[0]
    if name in ("allgather", "allgather_into_tensor_coalesced", "reduce_scatter",
                "reduce_scatter_tensor_coalesced"):
        return args[0]
    if name == "alltoall_base":
        return [args[0]]
    return []


def flat_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a collective's arguments (nested lists and tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in flat_tensors(item)]
    return []


def op_future(devices: Iterable[torch.device] = ()) -> torch.futures.Future:
    """The future of an op on `devices` (CUDA; none: a plain CPU future). The devices are also kept on it
    as `_ft_devices`, which ft_core.futures.future_devices reads (this room may not import that module)."""
    devs = tuple(devices)
    future = torch.futures.Future(devices=list(devs)) if devs else torch.futures.Future()
    future._ft_devices = devs  # type: ignore[attr-defined]
    return future


def op_future_like(inner: torch.futures.Future) -> torch.futures.Future:
    """An op future on the same CUDA devices as `inner`, so stream order carries through a wrapper."""
    return op_future(getattr(inner, "_ft_devices", ()))


# ---------------------------------------------------------------- works

class CompletedWork(dist.Work):
    """A Work that is already finished, with `result` as its value (or `error` raised)."""

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        if error is None:
            self._future.set_result(result)
        else:
            self._future.set_exception(error)
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class FutureWork(dist.Work):
    """A Work backed by a torch Future (completed elsewhere); wait() is bounded by `timeout`."""

    def __init__(self, future: torch.futures.Future, timeout: timedelta, on_timeout: Callable[[], BaseException]) -> None:
        super().__init__()
        self._future = future
        self._timeout = timeout
        self._on_timeout = on_timeout

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = (timeout if timeout and timeout.total_seconds() > 0 else self._timeout).total_seconds()
        done = threading.Event()
        self._future.add_done_callback(lambda _f: done.set())
        if not done.wait(limit):
            raise self._on_timeout()
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


# ---------------------------------------------------------------- deadlines

class Deadlines:
    """One named thread that runs callbacks when their deadlines pass, unless cancelled first.

    Owned by one process group: started on first use, stopped by close().
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._cond = threading.Condition()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, seconds: float, callback: Callable[[], None]) -> int:
        with self._cond:
            if self._closed:
                raise ProcessGroupError(f"{self._name}: deadline monitor is closed (the group was shut down)")
            handle = next(self._counter)
            heapq.heappush(self._heap, (time.monotonic() + seconds, handle, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
        with self._cond:
            self._cancelled.add(handle)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, handle, callback = heapq.heappop(self._heap)
                if handle in self._cancelled:
                    self._cancelled.discard(handle)
                    continue
            try:
                callback()
            except Exception:  # a failing callback must not stop the monitor
                logger.exception("%s: deadline callback failed", self._name)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cancelled.clear()
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


# ---------------------------------------------------------------- the base class

class ProcessGroup(_C10dProcessGroup):
    """A process group whose members change: `configure()` rebuilds it for a new quorum.

    Collectives not supported by a backend raise ProcessGroupError naming the backend.
    """

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        super().__init__(0, 1)
        self._timeout = settings.value("FT_TIMEOUT_SEC", timeout)
        self._rank = 0
        self._world_size = 1
        self._group_name = ""
        self._group_desc = ""
        self._registered: str | None = None

    # -- lifecycle (subclasses override) --------------------------------------------------
    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        """Rebuild the group for a new membership; blocks until it is up or raises."""
        raise ProcessGroupError(f"{type(self).__name__} cannot be configured")

    def cancel_configure(self, quorum_id: int, reason: str) -> None:
        """A configure for quorum `quorum_id`, in flight or starting before `forget_cancel(quorum_id, reason)`,
        raises ProcessGroupError(reason) at once (a member of that quorum is lost and will never join it).
        Never blocks. This default does nothing: configure() ends at its own timeout."""

    def forget_cancel(self, quorum_id: int, reason: str) -> None:
        """Undo `cancel_configure(quorum_id, reason)` for later configures."""

    def abort(self) -> None:
        """Stop the current group at once (pending ops fail); configure() builds a new one."""

    def shutdown(self) -> None:
        """Release everything this group owns (threads, sockets, child processes)."""
        self.abort()

    def errored(self) -> Exception | None:
        """The error that broke the current group, or None while it is healthy."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Deadline for each collective from now on (and for the next configure)."""
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- identity ---------------------------------------------------------------------------
    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return "ft-base"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def register(self, name: str) -> ProcessGroup:
        """Make functional collectives (and anything resolving a group by name) find this group.

        Registers this object in torch's process-group registry under
        `f"{getBackendName()}:{name}"`; returns self. unregister() undoes it.
        """
        group_name = f"{self.getBackendName()}:{name}"
        if self._registered is not None:
            raise ProcessGroupError(f"process group already registered as {self._registered!r}; "
                                    "call unregister() first")
        self.setGroupName(group_name)
        self.setGroupDesc(group_name)
        _register_process_group(group_name, self)
        self._registered = group_name
        return self

    def unregister(self) -> None:
        if self._registered is not None:
            _unregister_process_group(self._registered)
            self._registered = None

    # -- collectives (torch's signatures; subclasses route them) ------------------------------
    def _unsupported(self, name: str) -> dist.Work:
        raise ProcessGroupError(f"{name} is not supported by the {self.getBackendName()} process group")

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        return self._unsupported(name)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._collective("allreduce", (tensors,), opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._collective("allreduce_coalesced", (tensors,), opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        return self._collective("allgather", (output_tensors, input_tensors), opts)

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._collective("allgather_into_tensor_coalesced", (output_tensors, input_tensors), opts)

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        return self._collective("alltoall_base", (output_buffer, input_buffer, list(output_split_sizes),
                                                  list(input_split_sizes)), opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._collective("barrier", (), opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._collective("broadcast", (tensor_list,), opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        return self._collective("reduce_scatter", (output_tensors, input_tensors), opts)

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor],
                                        input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._collective("reduce_scatter_tensor_coalesced", (output_tensors, input_tensors), opts)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return self._collective("send", (tensors, int(dst_rank), int(tag)), None)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return self._collective("recv", (tensors, int(src_rank), int(tag)), None)

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcast a single tensor from `root` (a convenience over broadcast())."""
        return self.broadcast([tensor], broadcast_opts(root))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, size={self._world_size}, timeout={self._timeout})"


def group_label(quorum_id: int | None, replica_id: str, rank: int) -> str:
    """Group name given to the backend (flight recorder, logs)."""
    return f"ft_quorum_{quorum_id if quorum_id is not None else 'none'}_replica_{replica_id}_rank_{rank}"


def configure_store_host(store_addr: str, rank: int, world_size: int) -> str:
    """Validate configure()'s arguments; returns the host of the store at `store_addr`."""
    check_membership(rank, world_size)
    try:
        host, _, _ = parse_store_addr(store_addr)
    except ValueError as exc:
        raise ProcessGroupError(str(exc)) from exc
    return host


def check_membership(rank: int, world_size: int) -> None:
    """Reject impossible (rank, world_size) pairs with a message that names the fix."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ProcessGroupError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ProcessGroupError(f"rank {rank!r} is outside 0..{world_size - 1} for world_size {world_size}")
