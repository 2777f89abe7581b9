"""Ctrl-C and friends as a stop request for `ftl` commands that own child processes."""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopSignals:
    """Turns SIGINT/SIGTERM/SIGHUP into a stop request (a flag, so no spawn is ever interrupted halfway).

    Installed only from the main thread; `restore()` puts the previous handlers back.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.received is None:
            self.received = signum
        self.event.set()

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports it (130 for Ctrl-C)."""
        return 128 + (self.received or signal.SIGINT)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
