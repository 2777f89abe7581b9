"""Progress lines while a replica group waits for a quorum, with the lighthouse's own reason.

Outside `ftl launch` a script would otherwise see nothing until its quorum timeout. While one of the
manager server's lighthouse long polls runs longer than `NOTE_EVERY_S`, a named thread asks the
lighthouse why no quorum is issued (the reason `ftl status` shows, e.g. "New quorum not ready, only
have 1 participants, need min_replicas 2.") and logs it at INFO, at most once every `NOTE_EVERY_S`,
on this module's logger and on "ft_core.events" (type "quorum_wait", shown by the integrations'
console). A round costs two attribute writes; the thread sleeps while no round is waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
events = logging.getLogger("ft_core.events")

NOTE_EVERY_S = 5.0  # first line after this long waiting, then one per this long
_IDLE_S = 0.5  # how often the thread looks at a round in progress


class QuorumWaitNotes:
    """Logs why a quorum is not forming while a round waits; `begin()`/`end()` around the long poll, `close()` at the end."""

    def __init__(self, replica_id: str, fetch_reason: Callable[[], str], every_s: float = NOTE_EVERY_S) -> None:
        self.replica_id = replica_id
        self._fetch_reason = fetch_reason
        self._every_s = every_s
        self._since: float | None = None  # when the round in progress started waiting
        self.last_reason = ""  # the lighthouse's reason at the last note of the round in progress (for its timeout)
        self._next_note = 0.0
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def begin(self) -> None:
        """A lighthouse long poll starts (the thread is started on the first one)."""
        now = time.monotonic()
        self._next_note = now + self._every_s
        self.last_reason = ""
        self._since = now
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._closed.is_set():
                    self._thread = threading.Thread(target=self._run, name=f"ft-quorum-wait[{self.replica_id}]",
                                                    daemon=True)
                    self._thread.start()

    def end(self) -> None:
        self._since = None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (bounded: a status call in flight has its own short deadline). Idempotent."""
        self._closed.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("%s did not stop within %.1f s (a lighthouse status call still in flight)",
                               thread.name, timeout_s)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(_IDLE_S)
            since = self._since
            if since is None or time.monotonic() < self._next_note or self._closed.is_set():
                continue
            try:
                reason = self._fetch_reason()
            except Exception as exc:  # a busy or unreachable lighthouse: say so, the long poll goes on
                reason = f"the lighthouse did not say why ({type(exc).__name__}: {exc})"
            if self._since != since:
                continue  # the round ended meanwhile
            waited = time.monotonic() - since
            self.last_reason = reason
            self._next_note = time.monotonic() + self._every_s
            logger.info("replica group %s waiting %.0f s for a quorum: %s", self.replica_id, waited, reason,
                        extra={"replica_id": self.replica_id, "event": "quorum_wait"})
            if events.isEnabledFor(logging.INFO):
                events.info("[%s] quorum_wait %.0f s: %s", self.replica_id, waited, reason,
                            extra={"ft_event": {"type": "quorum_wait", "replica_id": self.replica_id,
                                                "group_rank": 0, "time": time.time(), "seconds": waited,
                                                "reason": reason}})
