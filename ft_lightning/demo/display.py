"""The demo's live view: one row per replica group, refreshed a few times a second (rich Live)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_STYLE = {
    "starting": "yellow", "training": "bold green", "waiting": "magenta", "healing": "bold cyan",
    "dead": "bold red", "restarting": "yellow", "stopping": "green", "done": "green", "lost": "red",
    "stopped": "dim",
}


@dataclass(frozen=True)
class GroupRow:
    """What the table shows for one replica group."""

    group: int
    state: str
    step: int | None
    loss: float | None
    quorum_id: int | None
    participants: int | None
    restarts: int
    failures: int  # times the demo killed this group (its own crashes are not counted)
    survived: int  # ... and it trained again afterwards


@dataclass(frozen=True)
class DemoView:
    """Everything on screen at one moment."""

    elapsed_s: float
    phase: str
    kills: int
    steps_committed: int
    heals: int
    rows: list[GroupRow] = field(default_factory=list)


def render(view: DemoView) -> RenderableType:
    """The table plus a one-line header."""
    header = Text.assemble(("ftl demo", "bold"), "  ", (f"{view.elapsed_s:5.1f}s", "bold"), "  ",
                           (view.phase, "italic"), "   failures injected ", (str(view.kills), "bold red"),
                           "   steps committed ", (str(view.steps_committed), "bold"),
                           "   heals ", (str(view.heals), "bold cyan"))
    table = Table(expand=False, show_edge=True, pad_edge=True)
    for name, justify in (("group", "right"), ("state", "left"), ("step", "right"), ("loss", "right"),
                          ("quorum", "right"), ("in quorum", "right"), ("restarts", "right"),
                          ("killed", "right"), ("came back", "right")):
        table.add_column(name, justify=justify)
    for r in view.rows:
        table.add_row(
            str(r.group),
            Text(r.state, style=STATE_STYLE.get(r.state, "")),
            "-" if r.step is None else str(r.step),
            "-" if r.loss is None else f"{r.loss:.3f}",
            "-" if r.quorum_id is None else str(r.quorum_id),
            "-" if r.participants is None else str(r.participants),
            str(r.restarts),
            str(r.failures),
            str(r.survived),
        )
    return Group(header, table)


class LiveDisplay:
    """Owns the rich Live region; `note()` prints a line above it (kills, restarts, heals)."""

    def __init__(self, console: Console | None = None, refresh_per_second: float = 4.0) -> None:
        self.console = console or Console(highlight=False)
        self._live = Live(console=self.console, refresh_per_second=refresh_per_second, transient=False,
                          auto_refresh=True)
        self._started = False

    def start(self, view: DemoView) -> None:
        self._live.update(render(view))
        self._live.start()
        self._started = True

    def update(self, view: DemoView) -> None:
        self._live.update(render(view))

    def note(self, line: str, style: str = "") -> None:
        self.console.print(Text(line, style=style))

    def stop(self) -> None:
        if self._started:
            self._live.stop()
            self._started = False

    def __enter__(self) -> LiveDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
