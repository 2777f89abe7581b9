"""Process groups that wrap another: error swallowing, fault injection (tests), the Manager's
allreduce route, and a world-size-1 dummy."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ft_core.errors import ProcessGroupError
from ft_core.process_groups.backends import ProcessGroupWrapper
from ft_core.process_groups.base import (
    CompletedWork,
    FutureWork,
    ProcessGroup,
    allreduce_opts,
    check_membership,
    default_opts,
    op_future_like,
    op_result,
)

logger = logging.getLogger("ft_core.process_groups")


def call_collective(pg: ProcessGroup, name: str, args: tuple, opts: Any) -> dist.Work:
    """Issue collective `name` on `pg` through its public method."""
    if name in ("send", "recv"):
        return getattr(pg, name)(*args)
    if name == "barrier":
        return pg.barrier(opts)
    return getattr(pg, name)(*args, opts)


class ProcessGroupDelegate(ProcessGroup):
    """Forwards everything to an inner ProcessGroup; subclasses change how ops behave."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg.timeout)
        self._pg = pg

    @property
    def inner(self) -> ProcessGroup:
        return self._pg

    @property
    def parent(self) -> ProcessGroup:
        """The wrapped group (torchft's name for `inner`)."""
        return self._pg

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        self._pg.configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                           global_ranks)

    def cancel_configure(self, quorum_id: int, reason: str) -> None:
        self._pg.cancel_configure(quorum_id, reason)

    def forget_cancel(self, quorum_id: int, reason: str) -> None:
        self._pg.forget_cancel(quorum_id, reason)

    def abort(self) -> None:
        self._pg.abort()

    def shutdown(self) -> None:
        self.unregister()
        self._pg.shutdown()

    def errored(self) -> Exception | None:
        return self._pg.errored()

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._pg.set_timeout(timeout)

    def size(self) -> int:
        return self._pg.size()

    def rank(self) -> int:
        return self._pg.rank()

    def getBackendName(self) -> str:
        return self._pg.getBackendName()

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        return call_collective(self._pg, name, args, opts)


class WrappedProcessGroup(ProcessGroupDelegate, ProcessGroupWrapper):
    """What torchft's `ProcessGroupWrapper(pg=other)` builds: every call forwarded to `other` (`.parent`)."""

    def __init__(self, timeout: timedelta | float | None = None, pg: ProcessGroup | None = None) -> None:
        if pg is None:
            raise ProcessGroupError("WrappedProcessGroup needs the group to wrap: pass pg=")
        ProcessGroupDelegate.__init__(self, pg)
        if timeout is not None:
            self.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout)))


ProcessGroupWrapper._wrapping_class = WrappedProcessGroup


class _SwallowingWork(dist.Work):
    """Waits on the real work; an error is recorded on the wrapper and the op returns its inputs."""

    def __init__(self, owner: ErrorSwallowingProcessGroupWrapper, work: dist.Work, result: Any) -> None:
        super().__init__()
        self._owner = owner
        self._work = work
        self._result = result
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:
            self._owner.report_error(exc)
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            inner_future = self._work.get_future()
            future = op_future_like(inner_future)

            def done(inner: torch.futures.Future) -> None:
                try:
                    inner.wait()
                except Exception as exc:
                    self._owner.report_error(exc)
                future.set_result(self._result)

            inner_future.add_done_callback(done)
            self._future = future
        return self._future


class ErrorSwallowingProcessGroupWrapper(ProcessGroupDelegate):
    """After the first error every op is a no-op returning its inputs, until the next configure().

    The error stays readable through error() (and errored()) so the step protocol can refuse to commit.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._error: Exception | None = None
        self._error_lock = threading.Lock()

    def configure(self, *args: Any, **kwargs: Any) -> None:
        with self._error_lock:
            self._error = None
        super().configure(*args, **kwargs)

    def error(self) -> Exception | None:
        return self._error

    def errored(self) -> Exception | None:
        return self._error or self._pg.errored()

    def report_error(self, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = exc if isinstance(exc, Exception) else ProcessGroupError(str(exc))
                logger.warning("process group error swallowed until the next configure",
                               extra={"error": str(exc)})

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        result = op_result(name, args)
        if self._error is not None:
            return CompletedWork(result)
        try:
            work = super()._collective(name, args, opts)
        except Exception as exc:
            self.report_error(exc)
            return CompletedWork(result)
        return _SwallowingWork(self, work, result)


class _FailingWork(dist.Work):
    """The real op runs (so peers are not left waiting), then its wait/future raise the injected error."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception:  # the injected error is what the caller must see
            pass
        raise self._error

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            inner_future = self._work.get_future()
            future = op_future_like(inner_future)
            inner_future.add_done_callback(lambda _inner: future.set_exception(self._error))
            self._future = future
        return self._future


class FakeProcessGroupWrapper(ProcessGroupDelegate):
    """For tests: report_future_error(e) makes the next op's wait() and future raise `e`."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._next_error: Exception | None = None
        self._lock = threading.Lock()

    def report_future_error(self, error: Exception) -> None:
        with self._lock:
            self._next_error = error

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        work = super()._collective(name, args, opts)
        with self._lock:
            error, self._next_error = self._next_error, None
        return work if error is None else _FailingWork(work, error)


class SupportsManagedAllreduce(Protocol):
    """What ManagedProcessGroup needs from a Manager."""

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = ...) -> dist.Work: ...

    def num_participants(self) -> int: ...


class ManagedProcessGroup(ProcessGroup):
    """Routes allreduce through `manager.allreduce` (fault tolerant, commit-gated); size() is the
    number of participants. Lets torch code that takes a process group (DDP, FSDP hooks) use the Manager.

    Every other collective goes to the Manager's own process group (`parent`), as in torchft: those are
    not commit-gated, and a failure surfaces from the op's wait() like on that group.
    """

    def __init__(self, manager: SupportsManagedAllreduce, timeout: timedelta | float | None = None) -> None:
        super().__init__(timeout)
        self._manager = manager

    def getBackendName(self) -> str:
        return "ft-managed"

    def size(self) -> int:
        return int(self._manager.num_participants())

    def configure(self, *args: Any, **kwargs: Any) -> None:
        raise ProcessGroupError("ManagedProcessGroup is configured by its Manager; configure the Manager's group")

    @property
    def parent(self) -> ProcessGroup:
        """The Manager's process group, which carries every collective but allreduce."""
        pg = getattr(self._manager, "_pg", None)
        if pg is None:
            raise ProcessGroupError("ManagedProcessGroup: this manager has no process group to forward to")
        return pg

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        if name != "allreduce":
            return call_collective(self.parent, name, args, opts)
        tensors: list[torch.Tensor] = args[0]
        reduce_op = allreduce_opts(opts).reduceOp
        reduce_op = getattr(reduce_op, "op", reduce_op)  # options hold a ReduceOp; the Manager takes its RedOpType
        works = [self._manager.allreduce(tensor, reduce_op=reduce_op) for tensor in tensors]
        if len(works) == 1:
            return works[0]
        combined = torch.futures.collect_all([work.get_future() for work in works])
        future = combined.then(lambda fut: [f.value() for f in fut.value()] and tensors)
        return FutureWork(future, self._timeout, lambda: ProcessGroupError("managed allreduce timed out"))


class ProcessGroupDummy(ProcessGroup):
    """A world-size-1 group: every op completes at once; gathers copy the input, the rest keep data."""

    def __init__(self, rank: int = 0, world: int = 1, timeout: timedelta | float | None = None) -> None:
        super().__init__(timeout)
        check_membership(rank, world)
        self._rank = rank
        self._world_size = world
        self.configure_count = 0

    def getBackendName(self) -> str:
        return "ft-dummy"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        self.configure_count += 1

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        default_opts(name, opts) if name not in ("send", "recv") else None  # validates opts like a real group
        with torch.no_grad():
            if name == "allgather":
                for outputs, tensor in zip(args[0], args[1]):
                    for out in outputs:
                        out.copy_(tensor)
            elif name == "allgather_into_tensor_coalesced":
                for out, tensor in zip(args[0], args[1]):
                    out.copy_(tensor.reshape(out.shape) if out.numel() == tensor.numel() else tensor)
            elif name == "alltoall_base":
                args[0].copy_(args[1])
            elif name == "reduce_scatter":
                for out, inputs in zip(args[0], args[1]):
                    out.copy_(inputs[0])
            elif name == "reduce_scatter_tensor_coalesced":
                for out, tensor in zip(args[0], args[1]):
                    out.copy_(tensor.reshape(out.shape) if out.numel() == tensor.numel() else tensor)
        return CompletedWork(op_result(name, args))
