"""Cancellable configure: the blocking backend construction runs on its own thread, and the caller waits for
it or for a cancellation (ft_core.redo.on_peer_lost: the lighthouse says a member of the quorum being
configured is lost, so that member will never arrive at the rendezvous).

Without it the quorum thread sits in the backend's rendezvous until the collective timeout, and the
survivors' next quorum waits as long. `CancellableStore` lets a cancel end the construction itself (a
rendezvous wait checks the cancel), so no thread is left behind; a construction that ends anyway after it
was abandoned has its backend discarded, never installed.
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ft_core.cancels import Attempt
from ft_core.errors import FTTimeoutError, ProcessGroupError

__all__ = ["CancellableStore", "ConfigureAttempt", "run_attempt"]

# How often a rendezvous wait asks the store again (it starts at the low end and backs off).
POLL_S = (0.001, 0.01)

_RUNNING: dict[threading.Thread, float] = {}  # construction threads -> when they must have ended (monotonic)
_RUNNING_LOCK = threading.Lock()


def _let_running_end() -> None:
    """At exit, wait for the backend constructions still running, each at most until its bound. One that came
    back from C++ into a finalizing interpreter would be ended with pthread_exit, whose unwinding through
    torch's C++ frames aborts the process (SIGABRT, "terminate called without an active exception": a group
    that exited 2 s after abandoning a configure, `ftl chaos` cell c2, 2026-12-07)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for thread, end_by in running:
        thread.join(max(0.0, end_by - time.monotonic()))


atexit.register(_let_running_end)


class ConfigureAttempt(Attempt):
    """One configure: its quorum, why it was cancelled (None while it goes on), and its construction."""

    error = ProcessGroupError

    def __init__(self, quorum_id: int | None) -> None:
        super().__init__(quorum_id)
        self._finished = False
        self._abandoned = False
        self._result: Any = None
        self._error: BaseException | None = None


def run_attempt(attempt: ConfigureAttempt, thread_name: str, build: Callable[[], Any], discard: Callable[[Any], None],
                deadline_s: float) -> Any:
    """Run `build` on a thread of its own; its result, or its error. A cancel (or `deadline_s` passing first)
    raises at once instead, and abandons the construction: if it returns a backend later, `discard` gets it
    on that thread (never the caller)."""

    def body() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = build()
        except BaseException as exc:  # handed to the caller, or dropped with the abandoned attempt
            error = exc
        with attempt._lock:
            attempt._finished = True
            abandoned = attempt._abandoned
            if not abandoned:
                attempt._result, attempt._error = result, error
        attempt.wake.set()
        try:
            if abandoned and result is not None:
                discard(result)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(threading.current_thread(), None)

    if attempt.reason is None:
        thread = threading.Thread(target=body, name=thread_name, daemon=True)
        with _RUNNING_LOCK:  # an abandoned construction ends on its own within its timeouts (< deadline_s)
            _RUNNING[thread] = time.monotonic() + 2 * deadline_s
        thread.start()
    else:
        attempt.wake.set()  # cancelled before it began: build nothing
        with attempt._lock:
            attempt._finished = True
    attempt.wake.wait(deadline_s)
    with attempt._lock:
        if attempt._finished and attempt.reason is None:
            if attempt._error is not None:
                raise attempt._error
            # the backend is the caller's now (the attempt holds no reference: its store refers to the attempt)
            result, attempt._result = attempt._result, None
            return result
        if attempt._finished and attempt._result is not None:
            result, attempt._result = attempt._result, None
        else:
            attempt._abandoned, result = True, None
        reason = attempt.reason
    attempt.stop.set()
    if result is not None:
        discard(result)  # it came up just as it was cancelled: never installed
    if reason is not None:
        raise ProcessGroupError(reason)
    raise FTTimeoutError(f"{thread_name} did not end within {deadline_s:.1f}s")


class CancellableStore(dist.Store):
    """A store for a backend's rendezvous whose waits end when the attempt is cancelled (the backend's
    constructor then fails at once and its thread ends). Waits poll `check`: a blocking wait on the inner
    store could not be woken, and TCPStore logs every timed-out slice of a sliced one. Until `take_exchanged`,
    it keeps the values set and got (the addresses the rendezvous published, which tell the backend's sockets)."""

    def __init__(self, inner: dist.Store, attempt: ConfigureAttempt, timeout: timedelta) -> None:
        super().__init__()
        self._inner = inner
        self._attempt = attempt
        self._timeout = timeout
        self._exchanged: list[bytes] | None = []

    def take_exchanged(self) -> list[bytes]:
        """The values the rendezvous set and got so far; recording stops (the backend may keep the store)."""
        values, self._exchanged = self._exchanged or [], None
        return values

    def set(self, key: str, value: Any) -> None:
        self._attempt.check()
        self._inner.set(key, value)
        if self._exchanged is not None:
            self._exchanged.append(value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._inner.get(key)
        if self._exchanged is not None:
            self._exchanged.append(bytes(value))
        return value

    def add(self, key: str, value: int) -> int:
        self._attempt.check()
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = POLL_S[0]
        while not self._inner.check(keys):
            self._attempt.check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(f"wait for {keys} timed out after {limit:.1f}s")
            self._attempt.stop.wait(min(pause, remaining))
            pause = min(pause * 2, POLL_S[1])
        self._attempt.check()
