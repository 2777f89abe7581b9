"""Deadlines for futures, served by one named timer thread.

`future_timeout(fut, timeout)` returns a future that completes with `fut`'s value, or fails with
FTTimeoutError when the deadline passes first. All deadlines share one daemon thread ("ft-timer")
that sleeps on a heap of deadlines, so arming a timeout costs a heap push, not a thread;
`stop_timer_if_idle()` ends that thread (Manager.shutdown calls it).

CUDA: every future made here is created with the CUDA devices its value lives on (given, or taken
from the input future or the value), so completing it records an event on the completing stream and
`wait()` makes the waiter's current stream wait for that event; continuations run on a stream that
waits for the input's events (torch's `ivalue::Future` semantics). A collective's AVG division and
anything chained after it is therefore ordered after the collective for every reader, with no
`torch.cuda.synchronize()`. On CPU the futures are plain (devices=[]), as before.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import pickle
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar, Union

import torch

from ft_core.errors import FTError, FTTimeoutError

T = TypeVar("T")
logger = logging.getLogger(__name__)
AnyFuture = Union[torch.futures.Future, concurrent.futures.Future]


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _Timer:
    """One thread running callbacks at their deadlines; cancellable by handle.

    The thread starts with the first deadline and ends at `stop_if_idle` (a Manager's shutdown)
    once no live deadline is left; the next `schedule` starts a new one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], None]] = {}
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._wake_at = float("inf")  # when the thread wakes next by itself (inf: only when notified)

    def schedule(self, delay_s: float, callback: Callable[[], None]) -> int:
        """The thread is woken only when this deadline is earlier than its next wake-up: with one
        timeout per collective (the same for all of them) that is about once per timeout, not per op."""
        with self._cond:
            handle = next(self._seq)
            deadline = time.monotonic() + max(delay_s, 0.0)
            heapq.heappush(self._heap, (deadline, handle))
            self._live[handle] = callback
            self._stopping = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ft-timer", daemon=True)
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at = deadline  # the thread sleeps until then at most (set again when it runs)
                self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
        """No wake-up: a cancelled entry leaves the heap when the thread next wakes (or now, when none is live)."""
        with self._cond:
            self._live.pop(handle, None)
            if not self._live:
                self._heap.clear()  # cancelled entries would otherwise sit there until their deadline

    def stop_if_idle(self, timeout: float) -> bool:
        """End the thread if no deadline is live; True when no timer thread is left running."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return True
            if self._live:
                return False
            self._stopping = True
            self._cond.notify()
        thread.join(timeout)
        return not thread.is_alive()

    def _next_callback(self) -> Callable[[], None] | None:
        """Wait for the next due callback; None when asked to stop with nothing live."""
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if self._stopping and not self._live:
                    self._stopping = False
                    self._thread = None
                    self._wake_at = float("inf")
                    return None
                if not self._heap:
                    self._wake_at = float("inf")
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if self._heap[0][0] <= now:
                    return self._live.pop(heapq.heappop(self._heap)[1])
                self._wake_at = self._heap[0][0]
                self._cond.wait(self._wake_at - now)

    def _run(self) -> None:
        while (callback := self._next_callback()) is not None:
            try:
                callback()
            except Exception:  # a callback's failure must not stop every other deadline
                logger.exception("timer callback failed")


_TIMER = _Timer()


def schedule(delay: timedelta | float, callback: Callable[[], None]) -> int:
    """Run `callback` on the timer thread after `delay`; returns a handle for `cancel`."""
    return _TIMER.schedule(_seconds(delay), callback)


def cancel(handle: int) -> None:
    """Cancel a scheduled callback (no-op when it already ran)."""
    _TIMER.cancel(handle)


def stop_timer_if_idle(timeout: timedelta | float = 1.0) -> bool:
    """End the "ft-timer" thread when no deadline is pending (it restarts on the next one).

    Returns True when no timer thread is left; False while some deadline is still live.
    """
    return _TIMER.stop_if_idle(_seconds(timeout))


# ---------------------------------------------------------------- devices

# The devices a future was created with, on the future object: set by device_future here and by the
# process groups on their ops' futures, so a continuation made before the op completes knows them.
_DEVICES_ATTR = "_ft_devices"


def devices_of(value: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in `value` (a tensor, or lists/tuples/dicts of them), in order."""
    if isinstance(value, torch.Tensor):  # the usual case, once per collective and per DDP bucket
        return [value.device] if value.is_cuda else []
    found: set[torch.device] = set()
    _collect_devices(value, found, 0)
    return sorted(found, key=lambda d: d.index if d.index is not None else -1)


def _collect_devices(value: Any, found: set[torch.device], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            found.add(value.device)
        return
    if depth >= 4:  # values here are tensors or short lists of them; never walk a large structure
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _collect_devices(item, found, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_devices(item, found, depth + 1)


def device_future(devices: Iterable[torch.device] = ()) -> torch.futures.Future:
    """A torch Future for a value on `devices` (CUDA): completing it records an event on the completing
    thread's current stream of each device the value uses, and `wait()` (or a callback) orders the
    waiter's stream after it. With no devices: a plain CPU future."""
    if not devices:  # CPU values: a plain future, without sorting an empty set
        fut: torch.futures.Future = torch.futures.Future()
        setattr(fut, _DEVICES_ATTR, ())
        return fut
    devs = sorted(set(devices), key=lambda d: d.index if d.index is not None else -1)
    fut = torch.futures.Future(devices=devs) if devs else torch.futures.Future()
    setattr(fut, _DEVICES_ATTR, tuple(devs))
    return fut


def future_devices(fut: AnyFuture) -> list[torch.device]:
    """The CUDA devices of `fut`'s value, as far as known now: those it was made with here, else (for a
    completed future) its value's. Empty for CPU values and for foreign futures still pending."""
    known = getattr(fut, _DEVICES_ATTR, None)
    if known is not None:
        return list(known)
    try:
        if isinstance(fut, concurrent.futures.Future):
            return devices_of(fut.result(timeout=0)) if fut.done() and not fut.cancelled() else []
        return devices_of(fut.value()) if fut.done() else []
    except Exception:  # noqa: BLE001 - a failed future carries no tensors
        return []


def _union(*groups: Sequence[torch.device]) -> list[torch.device]:
    return sorted({d for group in groups for d in group}, key=lambda d: d.index if d.index is not None else -1)


def _finish(out: torch.futures.Future, value: Any) -> None:
    """Complete `out` with `value` on the current stream; a value on a device `out` was not made for
    becomes a clear error (torch would fail the future with a terser one)."""
    devs = getattr(out, _DEVICES_ATTR, ())
    if devs:
        extra = [d for d in devices_of(value) if d not in devs]
        if extra:
            _fail(out, FTError(f"a future made for {list(devs)} got a value on {extra}; keep the tensors of "
                               "one collective on the device it was issued from (torch.cuda.set_device)"))
            return
    out.set_result(value)


def _fail(out: torch.futures.Future, exc: BaseException) -> None:
    """Fail `out` with `exc`. A device future extracts tensors from its value by pickling, so an
    exception that cannot be pickled is carried as an FTError with the same message."""
    if not isinstance(exc, Exception):
        exc = FTError(f"{type(exc).__name__}: {exc}")
    elif getattr(out, _DEVICES_ATTR, ()):
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - any pickling failure: carry the message instead
            exc = FTError(f"{type(exc).__name__}: {exc}")
    out.set_exception(exc)


def current_device_initializer() -> Callable[[], None]:
    """An initializer for a ThreadPoolExecutor (or any thread): its threads use the CUDA device that is
    current on the calling thread now. A no-op when this process has not initialized CUDA."""
    index = _current_cuda_index()
    if index is None:
        return _no_device

    def set_current_device() -> None:
        torch.cuda.set_device(index)

    return set_current_device


def with_current_device(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, run on the CUDA device current on the calling thread now, whichever thread runs it later
    (the device is set for that call and restored after). `fn` itself when CUDA is not in use."""
    index = _current_cuda_index()
    if index is None:
        return fn

    def on_device(*args: Any, **kwargs: Any) -> T:
        with torch.cuda.device(index):
            return fn(*args, **kwargs)

    return on_device


def _current_cuda_index() -> int | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def _no_device() -> None:
    return None


# ---------------------------------------------------------------- helpers


def _add_done(fut: AnyFuture, callback: Callable[[AnyFuture], None]) -> None:
    fut.add_done_callback(callback)


def _outcome(fut: AnyFuture) -> tuple[bool, Any]:
    """(ok, value or exception) of a completed future of either kind. For a torch Future this is
    `wait()`, which also orders the current CUDA stream after the value's events."""
    try:
        if isinstance(fut, concurrent.futures.Future):
            return True, fut.result(timeout=0)
        return True, fut.wait()
    except BaseException as exc:  # noqa: BLE001 - the exception is the outcome we carry on
        return False, exc


def future_timeout(fut: AnyFuture, timeout: timedelta | float, what: str = "operation",
                   devices: Sequence[torch.device] | None = None) -> torch.futures.Future:
    """A torch Future with `fut`'s outcome, or FTTimeoutError if `timeout` passes first.
    devices: the CUDA devices of the value (default: `fut`'s, see future_devices)."""
    out = device_future(future_devices(fut) if devices is None else devices)

    def land(ok: bool, value: Any) -> None:
        if ok:
            _finish(out, value)
        else:
            _fail(out, value)

    _first_of(fut, _seconds(timeout), what, land)
    return out


def _first_of(fut: AnyFuture, seconds: float, what: str, land: Callable[[bool, Any], None],
              fn: Callable[[Any], Any] | None = None) -> None:
    """Call `land(ok, value)` once: with `fut`'s outcome (`fn(value)` when it succeeded and `fn` is given;
    `fn` runs even after the deadline, as chain's would) or with FTTimeoutError once `seconds` passed."""
    lock = threading.Lock()
    done = [False]

    def once(ok: bool, value: Any) -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        land(ok, value)

    def expire() -> None:
        once(False, FTTimeoutError(f"{what} did not complete within {seconds:.3g}s (timeout); "
                                   f"a peer may be dead or hung"))

    handle = _TIMER.schedule(seconds, expire)

    def on_done(f: AnyFuture) -> None:
        _TIMER.cancel(handle)
        ok, value = _outcome(f)
        if ok and fn is not None:
            try:
                value = fn(value)
            except BaseException as exc:  # noqa: BLE001 - carried to land
                ok, value = False, exc
        once(ok, value)

    _add_done(fut, on_done)


def future_wait(fut: AnyFuture, timeout: timedelta | float, what: str = "operation") -> Any:
    """Block until `fut` completes and return its value (the current CUDA stream ordered after it);
    FTTimeoutError after `timeout`."""
    event = threading.Event()
    _add_done(fut, lambda _f: event.set())
    seconds = _seconds(timeout)
    if not event.wait(seconds):
        raise FTTimeoutError(f"{what} did not complete within {seconds:.3g}s (timeout); a peer may be dead or hung")
    ok, value = _outcome(fut)
    if not ok:
        raise value
    return value


def complete(out: torch.futures.Future | None, value: Any) -> torch.futures.Future:
    """`out` completed with `value` now (a new completed future when `out` is None)."""
    if out is None:
        return completed_future(value)
    if not out.done():
        _finish(out, value)
    return out


def completed_future(value: Any, devices: Sequence[torch.device] | None = None) -> torch.futures.Future:
    """A torch Future that is already done with `value`, ordered after the current stream's work so far
    (devices: default, the value's CUDA devices)."""
    fut = device_future(devices_of(value) if devices is None else devices)
    _finish(fut, value)
    return fut


def failed_future(exc: BaseException) -> torch.futures.Future:
    """A torch Future that is already failed with `exc`."""
    fut = device_future()
    _fail(fut, exc)
    return fut


def chain(fut: AnyFuture, fn: Callable[[Any], Any], devices: Sequence[torch.device] | None = None) -> torch.futures.Future:
    """Eager continuation: a future of `fn(value)` run when `fut` completes (errors propagate).
    On CUDA `fn` runs on a stream ordered after `fut`'s value, and the result is ordered after `fn`'s
    kernels for whoever waits on it. devices: of the result (default: `fut`'s, see future_devices)."""
    out = device_future(future_devices(fut) if devices is None else devices)
    pass_on(fut, out, fn)
    return out


def pass_on(fut: AnyFuture, out: torch.futures.Future, fn: Callable[[Any], Any] | None = None) -> None:
    """Complete `out` (made beforehand, e.g. to be known before `fut` exists) with `fut`'s outcome, or
    with `fn(value)` (an error in it fails `out`); on CUDA ordered as chain's result is."""

    def on_done(f: AnyFuture) -> None:
        ok, value = _outcome(f)
        if ok and fn is not None:
            try:
                value = fn(value)
            except BaseException as exc:  # noqa: BLE001 - carried into the future
                ok, value = False, exc
        if ok:
            _finish(out, value)
        else:
            _fail(out, value)

    _add_done(fut, on_done)


def recover(fut: AnyFuture, default: T, on_error: Callable[[BaseException], None],
            devices: Sequence[torch.device] | None = None) -> torch.futures.Future:
    """A future that never fails: `fut`'s value, or `default` after calling on_error(exception).
    devices: of the value (default: `fut`'s and `default`'s CUDA devices)."""
    out = device_future(_union(future_devices(fut), devices_of(default)) if devices is None else devices)

    def on_done(f: AnyFuture) -> None:
        ok, value = _outcome(f)
        devs = getattr(out, _DEVICES_ATTR, ())
        extra = [d for d in devices_of(value) if d not in devs] if ok and devs else []
        if extra:
            ok, value = False, FTError(f"a future made for {list(devs)} got a value on {extra}; keep the "
                                       "tensors of one collective on the device it was issued from "
                                       "(torch.cuda.set_device)")
        if not ok:
            try:
                on_error(value)
            finally:
                _finish(out, default)
            return
        out.set_result(value)

    _add_done(fut, on_done)
    return out


def settled(fut: AnyFuture, default: T, on_error: Callable[[BaseException], None], timeout: timedelta | float,
            fn: Callable[[Any], Any] | None = None, what: str = "operation",
            out: torch.futures.Future | None = None) -> torch.futures.Future:
    """`recover(future_timeout(chain(fut, fn), timeout), default, on_error)` as one future and one callback
    (every collective of every step goes through it): `fn(value)` (or the value) when `fut` completes
    within `timeout`, else `default` after on_error(exception). `fn` runs when `fut` completes, even
    after the deadline passed, as chain's would. Devices: `fut`'s and `default`'s. `out`: the future to
    complete (made beforehand, e.g. to be known before `fut` exists, as pass_on's), else a new one."""
    if out is None:
        out = device_future(_union(future_devices(fut), devices_of(default)))

    def land(ok: bool, value: Any) -> None:
        devs = getattr(out, _DEVICES_ATTR, ())
        extra = [d for d in devices_of(value) if d not in devs] if ok and devs else []
        if extra:
            ok, value = False, FTError(f"a future made for {list(devs)} got a value on {extra}; keep the "
                                       "tensors of one collective on the device it was issued from "
                                       "(torch.cuda.set_device)")
        if ok:
            out.set_result(value)
            return
        try:
            on_error(value if isinstance(value, Exception) else FTError(f"{type(value).__name__}: {value}"))
        finally:
            _finish(out, default)

    _first_of(fut, _seconds(timeout), what, land, fn)
    return out


@contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta | float) -> Iterator[None]:
    """Run `callback` (e.g. abort a process group) if the block is still running after `timeout`."""
    handle = _TIMER.schedule(_seconds(timeout), callback)
    try:
        yield
    finally:
        _TIMER.cancel(handle)
