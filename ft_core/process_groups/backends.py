"""Reconfigurable process groups: Gloo, NCCL and XCCL in this process, subprocess variants, wrappers.

Each quorum change the Manager calls `configure(store_addr, ...)` with a fresh store prefix; the old
backend is aborted and a new one is built for the new members. A dead or hung peer becomes an error
(FTTimeoutError or ProcessGroupError) within the timeout, never a hang.

    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    pg.configure("10.0.0.1:29500/ft/7/0", replica_id="a", rank=0, world_size=2)
    pg.allreduce([grad], ReduceOp.SUM).wait()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ft_core.cancels import QuorumCancels
from ft_core.errors import FTTimeoutError, ProcessGroupError
from ft_core.process_groups.base import (
    Deadlines,
    ProcessGroup,
    as_error,
    configure_store_host,
    default_opts,
    flat_tensors,
    group_label,
    op_future,
    op_result,
)
from ft_core.process_groups.cancel import CancellableStore, ConfigureAttempt, run_attempt
from ft_core.process_groups.gloo_abort import rendezvous_connections, shutdown_sockets, socket_inodes
from ft_core.process_groups.child import (
    Waiter,
    as_c10d_group,
    connect_store,
    gloo_bind_address,
    new_backend,
    nccl_version,
    on_completion,
    supports_nonblocking_abort,
    use_nccl_interface_toward,
)

logger = logging.getLogger("ft_core.process_groups")

__all__ = ["ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupWrapper", "ProcessGroupXCCL"]

# Extra seconds wait() allows past the backend's own op timeout before it gives up by itself.
WAIT_GRACE_S = 1.0
# Extra seconds configure() waits for its construction past the store connect and the backend's timeouts.
CONFIGURE_GRACE_S = 5.0


class _BackendWork(dist.Work):
    """Work of an in-process backend: errors mapped and recorded on the group; wait() has a deadline."""

    def __init__(self, pg: ProcessGroupWrapper, inner: dist.Work, name: str, result: Any,
                 generation: int, devices: list[torch.device] | None) -> None:
        super().__init__()
        self._pg = pg
        self._inner = inner
        self._name = name
        self._result = result
        self._generation = generation
        self._devices = devices
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = timeout if timeout and timeout.total_seconds() > 0 else self._pg.timeout
        try:
            completed = self._inner.wait(limit + timedelta(seconds=WAIT_GRACE_S))
        except Exception as exc:
            raise self._pg._fail(exc, self._name, self._generation) from exc
        if completed is False:
            error = FTTimeoutError(f"{self._name} did not finish within {limit.total_seconds():.1f}s")
            raise self._pg._fail(error, self._name, self._generation)
        return True

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            future = op_future(self._devices or ())

            def done(exc: BaseException | None) -> None:
                if exc is not None:
                    future.set_exception(self._pg._fail(exc, self._name, self._generation))
                else:
                    future.set_result(self._result)

            on_completion(self._inner, self._pg._waiter, done)
            self._future = future
            return future

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())


class ProcessGroupWrapper(ProcessGroup):
    """A reconfigurable group running a c10d backend in this process (Gloo, NCCL, XCCL).

    torchft's `ProcessGroupWrapper(pg=other)` (wrap an existing group, `.parent` is it) returns a
    `ft_core.process_groups.wrappers.WrappedProcessGroup`, which is also a ProcessGroupWrapper.
    """

    BACKEND = "none"
    # The backend's rendezvous may wait on a CancellableStore (a cancel ends the construction itself);
    # False: a cancel releases configure() and the construction is discarded when it ends by itself.
    CANCELLABLE_STORE = False
    _wrapping_class: type | None = None  # set by ft_core.process_groups.wrappers

    def __new__(cls, *args: Any, pg: ProcessGroup | None = None, **kwargs: Any) -> "ProcessGroupWrapper":
        if pg is not None and cls is ProcessGroupWrapper and cls._wrapping_class is not None:
            return super().__new__(cls._wrapping_class)
        return super().__new__(cls)

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        super().__init__(timeout)
        self._lock = threading.Lock()
        self._backend: Any = None
        self._generation = 0
        self._error: Exception | None = None
        self._configure_lock = threading.Lock()
        self._cancels: QuorumCancels[ConfigureAttempt] = QuorumCancels()  # keys are the reasons
        self._waiter = Waiter(f"ft-{self.BACKEND}-waiter")

    def getBackendName(self) -> str:
        return f"ft-{self.BACKEND}"

    # -- subclass hooks ---------------------------------------------------------------------
    def _create_backend(self, store: Any, store_host: str, rank: int, world_size: int, name: str,
                        global_ranks: list[int] | None) -> Any:
        raise ProcessGroupError(f"{type(self).__name__} has no backend")

    def _devices(self, args: tuple) -> list[torch.device] | None:
        """The devices of the op's device tensors (Gloo takes CUDA tensors too): its future is made for
        them, so a reader waiting on it is ordered after the op on the GPU. None: host tensors only."""
        found = {t.device for t in flat_tensors(args) if t.device.type == "cuda"}
        return sorted(found, key=lambda d: d.index or 0) if found else None

    def _after_issue(self, work: _BackendWork, generation: int) -> None:
        """Called once per issued op (NCCL uses it to arm the op's deadline)."""

    def _claim(self, backend: Any) -> None:
        """Called when configure() installs `backend` (not for one it discards)."""

    def _construction_setup(self) -> Callable[[], None]:
        """Called on configure()'s thread; what it returns runs first on the construction's own thread."""
        return lambda: None

    # -- lifecycle ------------------------------------------------------------------------------
    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
        host = configure_store_host(store_addr, rank, world_size)
        with self._configure_lock:
            self._drop_backend("reconfigure")
            name = group_label(quorum_id, replica_id, rank)
            started = time.monotonic()
            timeout_s = self._timeout.total_seconds()
            attempt = self._cancels.begin(ConfigureAttempt(quorum_id))

            on_thread = self._construction_setup()

            def build() -> Any:
                on_thread()
                store = connect_store(store_addr, self._timeout)
                if self.CANCELLABLE_STORE:
                    store = CancellableStore(store, attempt, self._timeout)
                return self._create_backend(store, host, rank, world_size, name, global_ranks)

            try:
                # store connect + construction, each bounded by the timeout; a cancel ends the wait at once
                backend = run_attempt(attempt, f"ft-{self.BACKEND}-configure", build, self._discard_backend,
                                      2 * timeout_s + CONFIGURE_GRACE_S)
            except Exception as exc:
                if attempt.reason is not None:
                    raise ProcessGroupError(f"configure {self.getBackendName()} rank {rank}/{world_size} "
                                            f"at {store_addr}: {attempt.reason}") from exc
                raise as_error(exc, f"configure {self.getBackendName()} rank {rank}/{world_size} "
                                    f"at {store_addr} (timeout {timeout_s:.1f}s; "
                                    "are all members configuring with the same store prefix?)") from exc
            finally:
                self._cancels.end(attempt)
            self._claim(backend)
            with self._lock:
                self._backend = backend
                self._generation += 1
                self._error = None
                self._rank = rank
                self._world_size = world_size
            logger.info("process group configured", extra={
                "backend": self.BACKEND, "quorum_id": quorum_id, "replica_id": replica_id, "rank": rank,
                "world_size": world_size, "seconds": round(time.monotonic() - started, 3)})

    def cancel_configure(self, quorum_id: int, reason: str) -> None:
        self._cancels.cancel(quorum_id, reason)

    def forget_cancel(self, quorum_id: int, reason: str) -> None:
        self._cancels.forget(quorum_id, reason)

    def _discard_backend(self, backend: Any) -> None:
        """A backend whose configure was abandoned (cancelled or past its deadline): abort it, never install it."""
        try:
            backend.abort()
        except Exception as exc:
            logger.warning("abort of an abandoned %s backend failed: %s", self.BACKEND, exc)
        logger.info("abandoned process group discarded", extra={"backend": self.BACKEND})

    def _drop_backend(self, reason: str) -> None:
        with self._lock:
            backend, self._backend = self._backend, None
            self._generation += 1
        if backend is not None:
            try:
                backend.abort()
            except Exception as exc:  # the old group is being thrown away anyway
                logger.warning("abort of old %s backend failed (%s): %s", self.BACKEND, reason, exc)

    def abort(self) -> None:
        with self._lock:
            if self._backend is not None and self._error is None:
                self._error = ProcessGroupError(f"{self.getBackendName()} process group was aborted")
        self._drop_backend("abort")

    def shutdown(self) -> None:
        self.unregister()
        self._cancels.cancel_current(f"{self.getBackendName()} process group was shut down while configuring")
        self._drop_backend("shutdown")
        self._waiter.close(self._timeout.total_seconds() + 2)

    def errored(self) -> Exception | None:
        return self._error

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        with self._lock:
            backend = self._backend
        if backend is not None and hasattr(backend, "set_timeout"):
            backend.set_timeout(self._timeout)

    def _fail(self, exc: BaseException, name: str, generation: int) -> Exception:
        """Record a failed op as this group's error (if it belongs to the current generation)."""
        error = as_error(exc, f"{self.getBackendName()} {name} (rank {self._rank}/{self._world_size})")
        with self._lock:
            if generation == self._generation and self._error is None:
                self._error = error
        # DEBUG: the Manager reports the step's failure once, with its cause (the user's console stays readable)
        logger.debug("collective %s failed: %s", name, error, extra={"backend": self.BACKEND, "op": name})
        return error

    # -- collectives ----------------------------------------------------------------------------
    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        with self._lock:
            backend, generation = self._backend, self._generation
        if backend is None:
            raise ProcessGroupError(f"{self.getBackendName()} {name}: the group is not configured "
                                    "(call configure() after each quorum change)")
        try:
            if name in ("send", "recv"):
                inner = getattr(backend, name)(*args)
            elif name == "barrier":
                inner = backend.barrier(default_opts(name, opts))
            else:
                inner = getattr(backend, name)(*args, default_opts(name, opts))
        except Exception as exc:  # bad arguments or an unsupported op: the group itself is fine
            raise as_error(exc, f"{self.getBackendName()} {name} could not be issued", broken=False) from exc
        work = _BackendWork(self, inner, name, op_result(name, args), generation, self._devices(args))
        self._after_issue(work, generation)
        return work


class ProcessGroupGloo(ProcessGroupWrapper):
    """Gloo (CPU tensors; CUDA tensors too, staged by Gloo). ReduceOp.AVG is not supported by Gloo.

    Gloo's own abort() neither wakes a pending op nor tells the peers (torch 2.13: both wait for the
    full timeout), so abort also shuts down the connections the backend opened at configure: the local
    op and every peer's op on those connections fail at once, and the survivors rebuild sooner
    (gloo_abort: the sockets that appeared meanwhile, with an end at an address the rendezvous exchanged).
    """

    BACKEND = "gloo"
    CANCELLABLE_STORE = True

    def __init__(self, timeout: timedelta | float | None = None) -> None:
        super().__init__(timeout)
        self._owned_sockets: dict[int, str] = {}
        self.last_abort = "none yet"  # what the last abort did (redo's stall diagnostics name it)
        # id(backend) -> (its sockets, whether another construction overlapped it), until claimed or discarded
        self._built: dict[int, tuple[dict[int, str], bool]] = {}

    def _create_backend(self, store: Any, store_host: str, rank: int, world_size: int, name: str,
                        global_ranks: list[int] | None) -> Any:
        # Bind the local address of the route toward the store (loopback for a loopback store);
        # GLOO_SOCKET_IFNAME, when set, wins (child.gloo_devices).
        hostname = gloo_bind_address(store_host) or ""
        with _BUILDS_LOCK:
            overlapped = _BUILDS["running"] > 0
            _BUILDS["running"] += 1
            _BUILDS["started"] += 1
            mine = _BUILDS["started"]
        try:
            before = socket_inodes()
            backend = new_backend("gloo", store, rank, world_size, self._timeout, self._timeout, hostname, name,
                                  global_ranks)
            after = socket_inodes()
        finally:
            with _BUILDS_LOCK:
                _BUILDS["running"] -= 1
                overlapped = overlapped or _BUILDS["started"] != mine
        appeared = {fd: t for fd, t in after.items() if before.get(fd) != t}
        owned = rendezvous_connections(appeared, store.take_exchanged() if isinstance(store, CancellableStore) else [])
        with self._lock:
            self._built[id(backend)] = (owned, overlapped)
        return backend

    def _claim(self, backend: Any) -> None:
        with self._lock:
            self._owned_sockets = self._built.pop(id(backend), ({}, False))[0]

    def _discard_backend(self, backend: Any) -> None:
        """Abort an abandoned backend and shut its connections down (the peers' ops on them fail at once),
        unless another construction overlapped it: the socket diff could then hold that one's sockets."""
        with self._lock:
            owned, overlapped = self._built.pop(id(backend), ({}, False))
        if owned and not overlapped:
            shutdown_sockets(owned)
        super()._discard_backend(backend)

    def _drop_backend(self, reason: str) -> None:
        owned, self._owned_sockets = self._owned_sockets, {}
        if reason == "abort":
            closed = shutdown_sockets(owned) if owned else 0
            self.last_abort = f"shut down {closed} of the {len(owned)} socket(s) its group opened"
            if owned:
                logger.info("gloo abort %s", self.last_abort, extra={"backend": self.BACKEND})
        super()._drop_backend(reason)


# Gloo constructions in flight in this process: one overlapped by another cannot tell its sockets (the
# socket-inode diff) from the other's.
_BUILDS_LOCK = threading.Lock()
_BUILDS = {"running": 0, "started": 0}


class _AcceleratorGroup(ProcessGroupWrapper):
    """NCCL/XCCL: ops are asynchronous on the device, so each op gets a deadline on its completion;
    an expired deadline aborts the communicator (not the process) and errored() reports it."""

    DEVICE = "cuda"

    def __init__(self, timeout: timedelta | float | None = None, device: torch.device | int | str | None = None) -> None:
        """device: the one device this rank's communicator uses (default: the device current on the
        thread that configures, which the Manager sets to its creator's)."""
        super().__init__(timeout)
        self._deadlines = Deadlines(f"ft-{self.BACKEND}-deadlines")
        self._device = _as_device(self.DEVICE, device)
        self._abort_on_deadline = True  # False: a hung op is ended by the process-level timeout instead

    def _device_module(self) -> Any:
        return getattr(torch, self.DEVICE)

    def _current_device(self) -> torch.device:
        if self._device is not None and self._device.index is not None:
            return self._device
        return torch.device(self.DEVICE, self._device_module().current_device())

    def _construction_setup(self) -> Callable[[], None]:
        # The construction runs on a thread of its own: the device current on the configuring thread is its default.
        module = getattr(torch, self.DEVICE, None)
        if module is None or not module.is_available():
            return lambda: None  # _create_backend says why this group cannot run here
        device = self._current_device()
        return lambda: module.set_device(device)

    def _devices(self, args: tuple) -> list[torch.device] | None:
        """The devices of the op's tensors (its future is made for them), else the group's device."""
        found = {t.device for t in flat_tensors(args) if t.device.type == self.DEVICE}
        return sorted(found, key=lambda d: d.index or 0) if found else [self._current_device()]

    def _after_issue(self, work: _BackendWork, generation: int) -> None:
        if not self._abort_on_deadline:
            return
        seconds = self._timeout.total_seconds()

        def check() -> None:
            if generation != self._generation or work.is_completed():
                return
            error = FTTimeoutError(f"{self.getBackendName()} {work._name} did not complete within "
                                   f"{seconds:.1f}s; aborting the communicator")
            with self._lock:
                if generation == self._generation and self._error is None:
                    self._error = error
            logger.error("collective timed out; aborting communicator",
                         extra={"backend": self.BACKEND, "op": work._name})
            self._drop_backend("timeout")

        self._deadlines.schedule(seconds, check)

    def errored(self) -> Exception | None:
        # Let queued device work finish (or time out and abort) so its failure is visible here.
        if self._error is None and self._backend is not None:
            self._device_module().current_stream(self._current_device()).synchronize()
        return self._error

    def shutdown(self) -> None:
        super().shutdown()
        self._deadlines.close()


def _as_device(kind: str, device: torch.device | int | str | None) -> torch.device | None:
    if device is None:
        return None
    out = torch.device(kind, device) if isinstance(device, int) else torch.device(device)
    if out.type != kind:
        raise ProcessGroupError(f"device={device!r}: this group runs on {kind} devices; pass e.g. '{kind}:0'")
    return out


def _check_blocking_fallback(version: tuple[int, int, int] | None) -> None:
    """Before a blocking NCCL communicator (NCCL older than 2.25): its hung op must end the process."""
    shown = ".".join(map(str, version)) if version else "unknown"
    if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "").strip() == "0":
        raise ProcessGroupError(
            f"NCCL {shown} cannot abort a hung communicator safely (needs NCCL >= 2.25), so a hung op must "
            "end the process, but TORCH_NCCL_ASYNC_ERROR_HANDLING=0 disables that; unset it or install "
            "torch with NCCL >= 2.25")
    logger.warning("NCCL %s is older than 2.25: using a blocking communicator; a collective that outlives "
                   "the timeout ends this process (torch's watchdog) instead of aborting the communicator",
                   shown, extra={"backend": "nccl", "nccl_version": shown})


class ProcessGroupNCCL(_AcceleratorGroup):
    """NCCL with non-blocking communicators: a timed-out op aborts the communicator, not the process."""

    BACKEND = "nccl"
    DEVICE = "cuda"

    def _create_backend(self, store: Any, store_host: str, rank: int, world_size: int, name: str,
                        global_ranks: list[int] | None) -> Any:
        if not torch.cuda.is_available():
            raise ProcessGroupError("ProcessGroupNCCL needs CUDA; use ProcessGroupGloo on CPU")
        version = nccl_version()
        nonblocking = supports_nonblocking_abort(version)
        if nonblocking:
            # Non-blocking init/ops poll for this long before giving up (torch's knob; ours if unset).
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(self._timeout.total_seconds()))))
        else:
            _check_blocking_fallback(version)
        use_nccl_interface_toward(store_host)  # unless NCCL_SOCKET_IFNAME is set
        from torch._C._distributed_c10d import ProcessGroupNCCL as _NCCL

        opts = _NCCL.Options()
        if nonblocking:
            opts.config.blocking = False
            # Our deadline aborts the communicator first; torch's watchdog (which would end the
            # process) only acts as a far backstop.
            opts._timeout = self._timeout + timedelta(seconds=60)
        else:
            # Blocking communicator: a hung op is ended by torch's watchdog at our timeout, which ends
            # the process (the group restarts and heals); no abort from our deadline thread.
            opts._timeout = self._timeout
        self._abort_on_deadline = nonblocking
        opts.group_name = name
        opts.global_ranks_in_group = list(global_ranks or range(world_size))
        backend = _NCCL(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        backend.eager_connect_single_device(self._current_device())
        logger.info("NCCL communicator up", extra={"nccl_version": torch.cuda.nccl.version(), "group": name})
        return as_c10d_group(store, rank, world_size, backend, "NCCL", ["cuda"])


class ProcessGroupXCCL(_AcceleratorGroup):
    """XCCL for Intel XPU, the same design as ProcessGroupNCCL."""

    BACKEND = "xccl"
    DEVICE = "xpu"

    def _create_backend(self, store: Any, store_host: str, rank: int, world_size: int, name: str,
                        global_ranks: list[int] | None) -> Any:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise ProcessGroupError("ProcessGroupXCCL needs an Intel XPU; use ProcessGroupGloo on CPU")
        return new_backend("xccl", store, rank, world_size, self._timeout, self._timeout + timedelta(seconds=60),
                           str(self._current_device()), name, global_ranks)
