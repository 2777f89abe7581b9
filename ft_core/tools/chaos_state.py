"""What a chaos run keeps about its faults and its groups while it runs (ft_core.tools.chaos)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Fault:
    """One injected fault, as the summary reports it."""

    index: int
    kind: str
    time: float
    target: str
    detail: str = ""
    group: int | None = None  # the group killed or stopped, and its incarnation then
    incarnation: int | None = None
    receiver: tuple[int, int] | None = None  # heal faults: (group, incarnation) of the healing group
    step: int | None = None  # heal faults: the step being transferred
    pair: tuple[int, int] | None = None  # partition: the two groups blocked from each other
    end: float | None = None  # network faults: when the link came back / the block was lifted


@dataclass
class Live:
    """The little the schedule needs to know about one incarnation, updated as its records arrive."""

    last_step: int = 0
    commits: int = 0
    last_commit: float = 0.0
    open_recv: dict[str, Any] | None = None  # a transfer started and not yet finished
    address: str | None = None  # its checkpoint server
    ready_at: float = 0.0  # when it started (its "ready" record)

    def update(self, records: list[dict[str, Any]]) -> None:
        for rec in records:
            kind = rec.get("kind")
            if kind == "step":
                self.last_step, self.last_commit = int(rec["step"]), float(rec["time"])
                self.commits += 1
            elif kind == "recv_start":
                self.open_recv = rec
            elif kind in ("recv_done", "recv_failed"):
                self.open_recv = None
            elif kind == "ready":
                self.address, self.ready_at = rec.get("address"), float(rec["time"])


@dataclass
class Stopped:
    group: int
    pids: tuple[int, ...]
    resume_at: float
