"""Waits of the quorum thread that a PeerLost notice ends (ft_core.redo.on_peer_lost): a heal's fetch from its
source (ft_core.healing) and a process group's configure (ft_core.process_groups). While the quorum thread
works on quorum Q, a notice that a member of Q is lost cancels the wait of Q in flight, and any that starts
before that run of the thread ends (`forget`): the member will never answer, and the survivors' next quorum
may need us (more than half of the healthy replicas, lighthouse rule 4).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ft_core.errors import FTError

__all__ = ["Attempt", "QuorumCancels"]


class Attempt:
    """One wait in a quorum: why it was cancelled (None while it goes on); a cancel sets `stop` (the waits it
    runs check it) and `wake` (its caller stops waiting)."""

    error: type[FTError] = FTError  # what check() raises

    def __init__(self, quorum_id: int | None) -> None:
        self.quorum_id = quorum_id
        self.reason: str | None = None
        self.stop = threading.Event()
        self.wake = threading.Event()
        self._lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        """Never blocks (called on a notice thread); the first reason stays."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.stop.set()
        self.wake.set()

    def check(self) -> None:
        if self.reason is not None:
            raise self.error(self.reason)


A = TypeVar("A", bound=Attempt)


class QuorumCancels(Generic[A]):
    """The notices heard while the quorum thread works, by quorum id, and the attempt in flight. A notice is
    a key (what was lost); `describe(attempt, key)` turns it into the attempt's reason."""

    def __init__(self, describe: Callable[[A, str], str] = lambda attempt, key: key) -> None:
        self._describe = describe
        self._lock = threading.Lock()
        self._pending: list[tuple[int, str]] = []
        self._current: A | None = None

    def cancel(self, quorum_id: int, key: str) -> None:
        """Cancel the attempt of quorum `quorum_id` in flight, and any that begins before `forget`."""
        with self._lock:
            self._pending.append((quorum_id, key))
            current = self._current
        if current is not None and current.quorum_id == quorum_id:
            current.cancel(self._describe(current, key))

    def forget(self, quorum_id: int, key: str) -> None:
        """The quorum thread's run that heard this notice ended: later attempts are not concerned."""
        with self._lock:
            if (quorum_id, key) in self._pending:
                self._pending.remove((quorum_id, key))

    def cancel_current(self, reason: str) -> None:
        with self._lock:
            current = self._current
        if current is not None:
            current.cancel(reason)

    def begin(self, attempt: A) -> A:
        """`attempt` is in flight now (cancelled at once if a notice of its quorum is pending)."""
        with self._lock:
            self._current = attempt
            keys = [key for qid, key in self._pending if qid == attempt.quorum_id]
        if keys:
            attempt.cancel(self._describe(attempt, keys[0]))
        return attempt

    def end(self, attempt: A) -> None:
        with self._lock:
            if self._current is attempt:
                self._current = None
