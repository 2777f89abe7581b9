"""The Manager's structured events as one readable line each, for the user's console.

The Manager logs every quorum, heal, commit and error on the logger "ft_core.events" with the
fields in `record.ft_event` (see `Manager._emit`); the routine ones (a quorum that changed nothing, a
committed step) at DEBUG, so the console, which listens at INFO, costs no record per step. `describe` turns one event into a line (or None
when it is routine: a quorum with the same members, a committed step); `EventLines` remembers the
last quorum so a heal names its source group and a membership change names who left or joined;
`ConsoleEvents` is the logging handler the integrations attach (`attach_console()`), writing to
stderr as `ft: ...`. A failed step's cause is cut down to what happened (`short_cause`: Gloo's
"Connection closed by peer [...]" without its boilerplate).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Mapping
from typing import IO, Any

EVENTS_LOGGER = "ft_core.events"


def _group_name(replica_id: str) -> str:
    """`3:9f2c...` or `replica_group_3:9f2c...` -> `3` (the replica group), any other id as it is."""
    name = replica_id.split(":", 1)[0] if ":" in replica_id else replica_id
    return name.removeprefix("replica_group_") or name


_GLOO_PEER = re.compile(r"\[[^\]]*gloo/transport/[^\]]*\]\s*(?P<what>[^.]*?\[[^\]]+\][^.]*)\.")


def short_cause(message: str) -> str:
    """A failed step's cause without Gloo's boilerplate: `ProcessGroupError: ... [.../pair.cc:553] Connection
    closed by peer [127.0.0.1]:17314. This is typically caused by ... GLHF!` -> `a peer's connection broke
    (Connection closed by peer [127.0.0.1]:17314)`."""
    match = _GLOO_PEER.search(message)
    if match:
        return f"a peer's connection broke ({match.group('what').strip()})"
    return message


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def describe(event: Mapping[str, Any], previous_members: list[str] | None) -> str | None:
    """One line for `event`, or None when there is nothing to tell. `previous_members`: the replica ids of
    the last quorum this group saw (None before its first)."""
    kind = event.get("type")
    step = event.get("step")
    if kind == "quorum":
        members = [str(r) for r in event.get("replica_ids") or []]
        if previous_members is not None and sorted(members) == sorted(previous_members) and not event.get("heal"):
            return None
        names = ", ".join(_group_name(r) for r in members)
        line = (f"quorum {event.get('quorum_id')}: {event.get('num_participants')} participating of "
                f"{len(members)} group(s) [{names}], max step {event.get('max_step')}, "
                f"took {float(event.get('seconds') or 0.0):.2f} s")
        if previous_members is not None:
            left = [_group_name(r) for r in previous_members if r not in members]
            joined = [_group_name(r) for r in members if r not in previous_members]
            changes = ([f"lost {', '.join(left)}"] if left else []) + ([f"joined {', '.join(joined)}"] if joined else [])
            if changes:
                line = f"membership changed ({'; '.join(changes)}): {line}"
        if event.get("heal"):
            line += f"; this group heals to step {event.get('max_step')}"
        return line
    if kind == "heal":
        step = event.get("healed_step", step)
        source = event.get("source_replica_rank")
        if previous_members is not None and isinstance(source, int) and 0 <= source < len(previous_members):
            source = f"group {_group_name(previous_members[source])}"
        else:
            source = f"replica rank {source}"
        seconds = float(event.get("seconds") or 0.0)
        nbytes = float(event.get("nbytes") or 0)
        rate = f", {_size(nbytes / seconds)}/s" if seconds > 0 else ""
        return f"healed from {source} at step {step} in {seconds:.2f} s ({_size(nbytes)}{rate})"
    if kind == "error":
        return f"step {step} failed, it will not commit: {short_cause(str(event.get('message')))}"
    if kind == "commit" and not event.get("committed"):
        return f"step {step} not committed ({event.get('num_participants')} participating)"
    if kind == "quorum_wait":  # from the manager server, while the lighthouse issues no quorum
        return f"waiting {float(event.get('seconds') or 0.0):.0f} s for a quorum: {event.get('reason')}"
    return None


class EventLines:
    """Renders a stream of one group's events, remembering the last quorum's members."""

    def __init__(self) -> None:
        self.members: list[str] | None = None
        self._errored_step: Any = None
        self._heal_to: Any = None  # the step this group heals to, from its last quorum

    def line(self, event: Mapping[str, Any]) -> str | None:
        kind = event.get("type")
        if kind == "commit" and not event.get("committed") and event.get("step") == self._errored_step:
            return None  # the error line already said why this step failed
        if kind == "heal" and self._heal_to is not None:
            event = {**event, "step": self._heal_to}  # the Manager adopts the healed step later, at commit
        text = describe(event, self.members)
        if kind == "quorum":
            self.members = [str(r) for r in event.get("replica_ids") or []]
            self._heal_to = event.get("max_step") if event.get("heal") else None
        elif kind == "error":
            self._errored_step = event.get("step")
        return text


class ConsoleEvents(logging.Handler):
    """A logging handler for "ft_core.events": one `ft: ...` line per membership change, heal and failed step."""

    def __init__(self, stream: IO[str] | None = None, prefix: str = "ft: ") -> None:
        super().__init__(level=logging.INFO)
        self.stream = stream
        self.prefix = prefix
        self._lines: dict[tuple[Any, Any], EventLines] = {}

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if not isinstance(event, Mapping) or event.get("group_rank", 0) != 0:
            return  # one line per replica group, from its rank 0
        key = (event.get("replica_id"), event.get("group_rank"))
        text = self._lines.setdefault(key, EventLines()).line(event)
        if text is None:
            return
        try:
            stream = self.stream or sys.stderr
            stream.write(f"{self.prefix}{text}\n")
            stream.flush()
        except Exception:  # a closed console must not break training
            self.handleError(record)


def attach_console(stream: IO[str] | None = None) -> ConsoleEvents:
    """Show the Manager's events on the console (idempotent: one handler per process)."""
    events = logging.getLogger(EVENTS_LOGGER)
    for handler in events.handlers:
        if isinstance(handler, ConsoleEvents):
            return handler
    handler = ConsoleEvents(stream)
    events.addHandler(handler)
    if events.getEffectiveLevel() > logging.INFO:  # INFO, never DEBUG: routine per-step events stay unbuilt
        # The user did not ask for these records; raise them for us only, not for their own handlers.
        events.setLevel(logging.INFO)
        events.propagate = False
    return handler

