"""Subprocess ("Baby") process groups: the backend runs in a child process, so a hung collective is
ended by killing the child, which can never deadlock the trainer.

configure() kills the old child and starts a new one (see START_METHODS). CPU tensors cross through shared memory
(moved there in place on first use), CUDA tensors through CUDA IPC; before each device op the parent
records an interprocess event on its current stream and the child's stream waits on it, so the child
never reads a tensor before the parent's kernels that wrote it have finished. The child reports an
op done only after its stream reached the op's end. One receiver thread per child reads the replies
and enforces each op's deadline: an op that outlives its timeout fails with FTTimeoutError and the
child is killed.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ft_core import settings
from ft_core.errors import FTTimeoutError, ProcessGroupError
from ft_core.process_groups.base import (
    FutureWork,
    ProcessGroup,
    configure_store_host,
    default_opts,
    flat_tensors,
    group_label,
    op_future,
    op_result,
)
from ft_core.process_groups.child import (
    ChildSpec,
    gloo_bind_address,
    opts_spec,
)
from ft_core.process_groups.child import main as child_main

logger = logging.getLogger("ft_core.process_groups")

# How long configure waits past `timeout` for the child's own error report (which names the cause).
_REPLY_GRACE_S = 1.0
# How children start. Both give a fresh interpreter (never a fork of the trainer with its threads
# and CUDA state): "forkserver" forks each child from one preloaded server (fast reconfigure),
# "spawn" starts each child from scratch (imports torch every time).
START_METHODS = settings.get("FT_BABY_START_METHOD").choices  # ("forkserver", "spawn")


@dataclass
class _Pending:
    """One op in flight in the child."""

    name: str
    deadline: float
    result: Any
    keep: Any  # tensors and events that must outlive the op
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


class _Child:
    """One generation of the child process: its pipes, its in-flight ops and its receiver thread."""

    def __init__(self, owner: str, spec: ChildSpec, start_timeout: float, start_method: str,
                 explicit_start: bool = True) -> None:
        ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Children fork from a server that already imported torch and our child module, so a
            # reconfigure costs milliseconds rather than a torch import. (Takes effect when the
            # server first starts; the server itself is a fresh interpreter, never a fork of ours.)
            ctx.set_forkserver_preload(["ft_core.process_groups.child"])
        self.owner = owner
        self._req_recv, self._req_send = ctx.Pipe(duplex=False)
        self._rep_recv, self._rep_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=child_main, args=(self._req_recv, self._rep_send, spec),
                                name=f"{owner}-child", daemon=True)
        self._lock = threading.Lock()  # guards pending, error, and the request pipe
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self.error: Exception | None = None
        self._closing = False
        self.proc.start()
        self._req_recv.close()  # the child's ends: closing ours makes the child's death an EOF here
        self._rep_send.close()
        try:
            self._await_ready(start_timeout, explicit_start)
        except BaseException:
            self.kill()
            self._req_send.close()
            self._rep_recv.close()
            self.proc.close()
            raise
        self._thread = threading.Thread(target=self._receive, name=f"{owner}-recv", daemon=True)
        self._thread.start()

    def _await_ready(self, start_timeout: float, explicit_start: bool) -> None:
        deadline = time.monotonic() + start_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                if explicit_start:
                    raise FTTimeoutError(f"{self.owner}: child process did not come up within {start_timeout:.1f}s "
                                         "(are all members configuring with the same store prefix?)")
                raise FTTimeoutError(
                    f"{self.owner}: configure did not finish within timeout={start_timeout - _REPLY_GRACE_S:.1f}s "
                    "(are all members configuring with the same store prefix? a child's first start imports "
                    "torch: pass start_timeout= or FT_BABY_START_TIMEOUT_SEC to give start-up its own deadline)")
            ready = multiprocessing.connection.wait([self._rep_recv, self.proc.sentinel], timeout=remaining)
            if self._rep_recv in ready:
                try:
                    message = self._rep_recv.recv()
                except (EOFError, OSError):
                    message = None
                if message is not None and message[0] == "ready":
                    return
                self.kill()
                if message is None:
                    raise ProcessGroupError(f"{self.owner}: child process exited during start-up "
                                            f"(exit code {self.proc.exitcode})")
                kind, text = message[1], message[2]
                cls = FTTimeoutError if kind == "timeout" else ProcessGroupError
                raise cls(f"{self.owner}: building the group in the child failed: {text}")
            if self.proc.sentinel in ready:
                self.kill()
                raise ProcessGroupError(f"{self.owner}: child process exited during start-up "
                                        f"(exit code {self.proc.exitcode})")

    # -- ops ------------------------------------------------------------------------------------
    def submit(self, name: str, args: tuple, opts: dict[str, Any], timeout: float,
               ready_event: Any) -> _Pending:
        # CUDA: the op's future is made for its tensors' devices, so whoever waits on it (or chains onto
        # it) is ordered after the receiver thread's completion, whatever stream it runs on.
        devices = sorted({t.device for t in flat_tensors(args) if t.device.type == "cuda"}, key=lambda d: d.index or 0)
        pending = _Pending(name=name, deadline=time.monotonic() + timeout, result=op_result(name, args),
                           keep=(args, ready_event), future=op_future(devices))
        with self._lock:
            if self.error is not None:
                raise self.error
            op_id = next(self._ids)
            self._pending[op_id] = pending
            try:
                self._req_send.send(("op", op_id, name, args, opts, ready_event))
            except (BrokenPipeError, EOFError, OSError) as exc:
                self._pending.pop(op_id, None)
                raise ProcessGroupError(f"{self.owner}: child process is gone ({exc}); reconfigure") from exc
        return pending

    def _receive(self) -> None:
        """Read replies; fail everything when the child dies; enforce op deadlines."""
        while True:
            with self._lock:
                if self._closing:
                    return
                next_deadline = min((p.deadline for p in self._pending.values()), default=None)
            wait_s = 0.5 if next_deadline is None else max(0.0, min(0.5, next_deadline - time.monotonic()))
            try:
                ready = multiprocessing.connection.wait([self._rep_recv], timeout=wait_s)
                message = self._rep_recv.recv() if ready else None
            except (EOFError, OSError):
                self._fail_all(ProcessGroupError(
                    f"{self.owner}: child process exited (exit code {self._exitcode()}); reconfigure"))
                return
            if message is not None:
                self._on_reply(message)
            expired = self._expired()
            if expired:
                self._fail_all(FTTimeoutError(f"{self.owner}: {expired} did not finish within its timeout; "
                                              "the child was killed (a peer is dead or hung)"), kill=True)
                return

    def _exitcode(self) -> Any:
        self.proc.join(timeout=1)
        return self.proc.exitcode

    def _expired(self) -> str | None:
        now = time.monotonic()
        with self._lock:
            for pending in self._pending.values():
                if pending.deadline <= now:
                    return pending.name
        return None

    def _on_reply(self, message: tuple) -> None:
        kind, op_id = message[0], message[1]
        with self._lock:
            pending = self._pending.pop(op_id, None)
        if pending is None:
            return
        if kind == "done":
            pending.future.set_result(pending.result)
            return
        error_kind, text = message[2], message[3]
        if error_kind == "invalid":
            pending.future.set_exception(ProcessGroupError(f"{self.owner}: {pending.name} could not be issued: {text}"))
            return
        if error_kind == "timeout":
            error: Exception = FTTimeoutError(f"{self.owner}: {pending.name} timed out in the child: {text}")
        else:
            error = ProcessGroupError(f"{self.owner}: {pending.name} failed in the child: {text}")
        with self._lock:
            if self.error is None:
                self.error = error
        pending.future.set_exception(error)
        if error_kind == "timeout":
            self._fail_all(error, kill=True)

    def _fail_all(self, error: Exception, kill: bool = False) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            pending, self._pending = list(self._pending.values()), {}
        if kill:
            self.kill()
        for item in pending:
            item.future.set_exception(error)

    def expire_now(self) -> Exception:
        """Called by a wait() whose deadline passed before the receiver noticed."""
        error = FTTimeoutError(f"{self.owner}: an op did not finish within its timeout; the child was killed")
        self._fail_all(error, kill=True)
        return self.error or error

    # -- teardown -------------------------------------------------------------------------------
    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self.kill()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._fail_all(ProcessGroupError(f"{self.owner}: the group was reconfigured or shut down"))
        for conn in (self._req_send, self._rep_recv):
            conn.close()
        self.proc.close()


class ProcessGroupBaby(ProcessGroup):
    """Runs backend BACKEND in a child process; see the module docstring.

    `timeout` bounds each op and, as in torchft, the whole of configure (child start, store rendezvous,
    group build). `start_timeout` (or FT_BABY_START_TIMEOUT_SEC), when set, gives the child's start and
    the meeting of its peers a deadline of their own, for short op timeouts on a slow-starting machine."""

    BACKEND = "gloo"

    def __init__(self, timeout: timedelta | float | None = None,
                 start_timeout: timedelta | float | None = None, start_method: str | None = None) -> None:
        super().__init__(timeout)
        # torchft bounds configure by `timeout` alone; start-up gets a deadline of its own only when asked.
        self._start_timeout: timedelta | None = settings.value("FT_BABY_START_TIMEOUT_SEC", start_timeout,
                                                               where="start_timeout")
        self._start_method = settings.value("FT_BABY_START_METHOD", start_method, where="start_method")
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._aborted: Exception | None = None

    def getBackendName(self) -> str:
        return f"ft-baby-{self.BACKEND}"

    def _child_device(self, store_host: str) -> str | None:
        return gloo_bind_address(store_host)  # the route toward the store; GLOO_SOCKET_IFNAME wins in the child

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        host = configure_store_host(store_addr, rank, world_size)
        self._end_child()
        timeout_s = self._timeout.total_seconds()
        start_s = None if self._start_timeout is None else self._start_timeout.total_seconds()
        spec = ChildSpec(
            backend=self.BACKEND, store_addr=store_addr, rank=rank, world_size=world_size,
            timeout_s=timeout_s, start_timeout_s=start_s, deadline=time.time() + timeout_s,
            device=self._child_device(host),
            group_name=group_label(quorum_id, replica_id, rank),
            global_ranks=tuple(global_ranks) if global_ranks else None)
        owner = f"ft-baby-{self.BACKEND}-r{rank}"
        started = time.monotonic()
        # The child's own deadlines end it first (its error names the cause); this bound covers a stuck
        # start. Without start_timeout, configure as a whole is bounded by `timeout`, as in torchft.
        bound = timeout_s + _REPLY_GRACE_S if start_s is None else start_s * 2 + timeout_s
        child = _Child(owner, spec, bound, self._start_method, explicit_start=start_s is not None)
        with self._lock:
            self._child = child
            self._aborted = None
            self._rank = rank
            self._world_size = world_size
        logger.info("process group configured", extra={
            "backend": self.getBackendName(), "quorum_id": quorum_id, "replica_id": replica_id, "rank": rank,
            "world_size": world_size, "seconds": round(time.monotonic() - started, 3)})

    def _end_child(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.close()

    def abort(self) -> None:
        with self._lock:
            if self._child is not None and self._aborted is None:
                self._aborted = ProcessGroupError(f"{self.getBackendName()} process group was aborted")
        self._end_child()

    def shutdown(self) -> None:
        self.unregister()
        self._end_child()

    def num_active_work(self) -> int:
        """Ops issued to the child and not finished yet (torchft's name)."""
        with self._lock:
            child = self._child
        if child is None:
            return 0
        with child._lock:
            return len(child._pending)

    def errored(self) -> Exception | None:
        with self._lock:
            child = self._child
            if self._aborted is not None:
                return self._aborted
        return child.error if child is not None else None

    # -- collectives ----------------------------------------------------------------------------
    def _prepare(self, name: str, args: tuple) -> Any:
        """Move CPU tensors to shared memory in place; returns the event the child must wait on."""
        device_tensor = None
        for tensor in flat_tensors(args):
            if tensor.device.type == "cpu":
                if not tensor.is_shared():
                    try:
                        tensor.share_memory_()
                    except RuntimeError as exc:
                        raise ProcessGroupError(
                            f"{self.getBackendName()} {name}: cannot move a tensor to shared memory ({exc}); "
                            "pass tensors allocated by torch (not views of numpy arrays)") from exc
            else:
                device_tensor = tensor
        if device_tensor is None:
            return None
        return self._ready_event(device_tensor)

    def _ready_event(self, tensor: torch.Tensor) -> Any:
        raise ProcessGroupError(f"{self.getBackendName()} handles CPU tensors only; got a {tensor.device} tensor "
                                "(use ProcessGroupBabyNCCL for CUDA tensors)")

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        with self._lock:
            child = self._child
        if child is None:
            raise ProcessGroupError(f"{self.getBackendName()} {name}: the group is not configured "
                                    "(call configure() after each quorum change)")
        ready_event = self._prepare(name, args)
        spec = opts_spec(name, default_opts(name, opts)) if name not in ("send", "recv") else {}
        pending = child.submit(name, args, spec, self._timeout.total_seconds(), ready_event)
        return FutureWork(pending.future, self._timeout + timedelta(seconds=0.5), child.expire_now)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """Gloo in a child process (CPU tensors)."""

    BACKEND = "gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process. Costs a second CUDA context (about 1 GB) per GPU."""

    BACKEND = "nccl"

    def __init__(self, timeout: timedelta | float | None = None, start_timeout: timedelta | float | None = None,
                 start_method: str | None = None, device: torch.device | int | str | None = None) -> None:
        """device: the GPU the child's communicator uses (default: the device current on the thread that
        configures, which the Manager sets to its creator's); the child calls torch.cuda.set_device on it."""
        super().__init__(timeout, start_timeout, start_method)
        self._device = None if device is None else (torch.device("cuda", device) if isinstance(device, int)
                                                    else torch.device(device))
        if self._device is not None and self._device.type != "cuda":
            raise ProcessGroupError(f"ProcessGroupBabyNCCL(device={device!r}): pass a CUDA device such as 'cuda:1'")

    def _child_device(self, store_host: str) -> str | None:
        if not torch.cuda.is_available():
            raise ProcessGroupError("ProcessGroupBabyNCCL needs CUDA; use ProcessGroupBabyGloo on CPU")
        if self._device is not None and self._device.index is not None:
            return f"cuda:{self._device.index}"
        return f"cuda:{torch.cuda.current_device()}"  # the parent's current device: the child sets it too

    def _ready_event(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "cuda":
            return super()._ready_event(tensor)
        event = torch.cuda.Event(interprocess=True)
        event.record(torch.cuda.current_stream(tensor.device))
        return event


class ProcessGroupBabyXCCL(ProcessGroupBaby):
    """XCCL in a child process for Intel XPU (needs torch's XPU tensor IPC)."""

    BACKEND = "xccl"

    def _child_device(self, store_host: str) -> str | None:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise ProcessGroupError("ProcessGroupBabyXCCL needs an Intel XPU; use ProcessGroupBabyGloo on CPU")
        return f"xpu:{xpu.current_device()}"

    def _ready_event(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type != "xpu":
            return super()._ready_event(tensor)
        # No interprocess XPU events in torch: finish the producer's work before the child reads.
        torch.xpu.synchronize(tensor.device)
        return None
