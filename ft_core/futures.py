"""Deadlines for futures, served by one named timer thread.

`future_timeout(fut, timeout)` returns a future that completes with `fut`'s value, or fails with
FTTimeoutError when the deadline passes first. All deadlines share one daemon thread ("ft-timer")
that sleeps on a heap of deadlines, so arming a timeout costs a heap push, not a thread;
`stop_timer_if_idle()` ends that thread (Manager.shutdown calls it).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, TypeVar, Union

import torch

from ft_core.errors import FTTimeoutError

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

    def schedule(self, delay_s: float, callback: Callable[[], None]) -> int:
        with self._cond:
            handle = next(self._seq)
            heapq.heappush(self._heap, (time.monotonic() + max(delay_s, 0.0), handle))
            self._live[handle] = callback
            self._stopping = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ft-timer", daemon=True)
                self._thread.start()
            self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
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
                    return None
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait <= 0:
                    return self._live.pop(heapq.heappop(self._heap)[1])
                self._cond.wait(wait)

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


def _add_done(fut: AnyFuture, callback: Callable[[AnyFuture], None]) -> None:
    fut.add_done_callback(callback)


def _outcome(fut: AnyFuture) -> tuple[bool, Any]:
    """(ok, value or exception) of a completed future of either kind."""
    try:
        if isinstance(fut, concurrent.futures.Future):
            return True, fut.result(timeout=0)
        return True, fut.value()
    except BaseException as exc:  # noqa: BLE001 - the exception is the outcome we carry on
        return False, exc


def future_timeout(fut: AnyFuture, timeout: timedelta | float, what: str = "operation") -> torch.futures.Future:
    """A torch Future with `fut`'s outcome, or FTTimeoutError if `timeout` passes first."""
    out: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()
    done = [False]
    seconds = _seconds(timeout)

    def finish(ok: bool, value: Any) -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        if ok:
            out.set_result(value)
        else:
            out.set_exception(value)

    def expire() -> None:
        finish(False, FTTimeoutError(f"{what} did not complete within {seconds:.3g}s (timeout); "
                                     f"a peer may be dead or hung"))

    handle = _TIMER.schedule(seconds, expire)

    def on_done(f: AnyFuture) -> None:
        _TIMER.cancel(handle)
        finish(*_outcome(f))

    _add_done(fut, on_done)
    return out


def future_wait(fut: AnyFuture, timeout: timedelta | float, what: str = "operation") -> Any:
    """Block until `fut` completes and return its value; FTTimeoutError after `timeout`."""
    event = threading.Event()
    _add_done(fut, lambda _f: event.set())
    seconds = _seconds(timeout)
    if not event.wait(seconds):
        raise FTTimeoutError(f"{what} did not complete within {seconds:.3g}s (timeout); a peer may be dead or hung")
    ok, value = _outcome(fut)
    if not ok:
        raise value
    return value


def completed_future(value: Any) -> torch.futures.Future:
    """A torch Future that is already done with `value`."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def failed_future(exc: BaseException) -> torch.futures.Future:
    """A torch Future that is already failed with `exc`."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(exc)
    return fut


def chain(fut: AnyFuture, fn: Callable[[Any], Any]) -> torch.futures.Future:
    """Eager continuation: a future of `fn(value)` run when `fut` completes (errors propagate)."""
    out: torch.futures.Future = torch.futures.Future()

    def on_done(f: AnyFuture) -> None:
        ok, value = _outcome(f)
        if not ok:
            out.set_exception(value)
            return
        try:
            result = fn(value)
        except BaseException as exc:  # noqa: BLE001 - carried into the future
            out.set_exception(exc)
            return
        out.set_result(result)

    _add_done(fut, on_done)
    return out


def recover(fut: AnyFuture, default: T, on_error: Callable[[BaseException], None]) -> torch.futures.Future:
    """A future that never fails: `fut`'s value, or `default` after calling on_error(exception)."""
    out: torch.futures.Future = torch.futures.Future()

    def on_done(f: AnyFuture) -> None:
        ok, value = _outcome(f)
        if not ok:
            try:
                on_error(value)
            finally:
                out.set_result(default)
            return
        out.set_result(value)

    _add_done(fut, on_done)
    return out


@contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta | float) -> Iterator[None]:
    """Run `callback` (e.g. abort a process group) if the block is still running after `timeout`."""
    handle = _TIMER.schedule(_seconds(timeout), callback)
    try:
        yield
    finally:
        _TIMER.cancel(handle)
