"""`ftl launch`: run N replica groups on this machine, restart the ones that die, inject failures.

The process management lives in `ft_core.tools.launcher.Launcher`; this module adds the seeded failure
schedule (`FaultInjector`, also used by `ftl demo` and chaos runs) and the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ft_core.control.lighthouse import LighthouseServer
from ft_core.errors import RPCError
from ft_core.net import check_reachable
from ft_core.tools.launcher import (
    DEFAULT_MAX_RESTARTS,
    LOOPBACK,
    GroupState,
    GroupStatus,
    Launcher,
    LaunchEvent,
    free_port,
    group_env,
)
from ft_core.tools.procs import describe_exit
from ft_core.tools.stop_signals import StopSignals
from ft_core.tools.status import fetch_status

__all__ = [
    "FaultInjector",
    "GroupState",
    "GroupStatus",
    "JobWatch",
    "KillRecord",
    "LaunchEvent",
    "Launcher",
    "StopSignals",
    "choose_victim",
    "describe_exit",
    "finished_job_verdict",
    "free_port",
    "group_env",
    "group_of_replica",
    "main",
    "next_kill_delay",
    "parse_args",
    "quorum_wait_note",
    "start_lighthouse",
    "status_url",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- fault injection

@dataclass(frozen=True)
class KillRecord:
    """One injected failure."""

    index: int  # 1-based
    group: int
    incarnation: int
    time: float  # unix seconds


def next_kill_delay(rng: random.Random, every: float, jitter: float = 0.15) -> float:
    """Seconds until the next kill: `every`, give or take `jitter` (a fraction)."""
    return every * rng.uniform(1.0 - jitter, 1.0 + jitter)


def choose_victim(rng: random.Random, eligible: Sequence[int], running: Sequence[int],
                  min_survivors: int = 1) -> int | None:
    """A random eligible group, or None when killing one would leave fewer than `min_survivors` running."""
    candidates = sorted(set(eligible) & set(running))
    if not candidates or len(running) - 1 < min_survivors:
        return None
    return rng.choice(candidates)


class FaultInjector:
    """SIGKILLs a random running group about every `every` seconds (seeded), at most `max_kills` times.

    Kills only between `arm()` (or the first tick) and `stop_at` (monotonic seconds), never after a
    group has finished, and never the last `min_survivors` running groups. `eligible` narrows the
    candidates (for example to groups known to be training).
    """

    def __init__(self, every: float, *, max_kills: int | None = None, seed: int | None = None,
                 min_survivors: int = 1, jitter: float = 0.15,
                 eligible: Callable[[Launcher], Sequence[int]] | None = None) -> None:
        if every <= 0:
            raise ValueError(f"kill interval must be > 0 seconds (got {every})")
        self.every = every
        self.max_kills = max_kills
        self.min_survivors = min_survivors
        self.jitter = jitter
        self.eligible = eligible
        self.rng = random.Random(seed)
        self.kills: list[KillRecord] = []
        self.next_at: float | None = None
        self.stop_at: float | None = None

    def arm(self, now: float | None = None) -> None:
        """Schedule the first kill about `every` seconds from now."""
        now = time.monotonic() if now is None else now
        self.next_at = now + next_kill_delay(self.rng, self.every, self.jitter)

    @property
    def exhausted(self) -> bool:
        return self.max_kills is not None and len(self.kills) >= self.max_kills

    def tick(self, launcher: Launcher, now: float | None = None) -> KillRecord | None:
        """Kill a group if one is due; a due kill with no candidate waits for one."""
        now = time.monotonic() if now is None else now
        if self.next_at is None:
            self.arm(now)
        assert self.next_at is not None
        if self.exhausted or now < self.next_at or (self.stop_at is not None and now >= self.stop_at):
            return None
        if launcher.any_done():
            return None
        running = launcher.running_groups()
        eligible = self.eligible(launcher) if self.eligible is not None else running
        victim = choose_victim(self.rng, eligible, running, self.min_survivors)
        if victim is None:
            return None
        record = KillRecord(index=len(self.kills) + 1, group=victim,
                            incarnation=launcher.status(victim).incarnation, time=time.time())
        total = f"/{self.max_kills}" if self.max_kills is not None else ""
        launcher.kill_group(victim, f"fault injection {record.index}{total}: SIGKILL")
        self.kills.append(record)
        self.next_at = now + next_kill_delay(self.rng, self.every, self.jitter)
        return record


# --------------------------------------------------------------------------- a job that has finished

def group_of_replica(replica_id: str) -> int | None:
    """The replica group index in a replica id (`3:9f2c...`, `g3`, `replica_group_3`), or None."""
    match = re.search(r"(\d+)$", replica_id.split(":", 1)[0])
    return int(match.group(1)) if match else None


def finished_job_verdict(group: int, step: int | None, final_step: int | None, finished: Sequence[int],
                         live_peer_steps: Sequence[int]) -> str | None:
    """Why `group` must not go on (it would retrain the finished job alone), or None when it may.

    The job finished at `final_step` (groups `finished` exited 0); `group` is at `step`; the other live
    groups are at `live_peer_steps`. One step behind is the normal skew at the end of a run; a live
    peer ahead of `group` is a source it heals from.
    """
    if step is None or final_step is None or final_step - step <= 1:
        return None
    if any(peer > step for peer in live_peer_steps):
        return None
    done = ", ".join(map(str, finished))
    return (f"the job already finished at step {final_step} (group(s) {done}) and group {group} is at step {step} "
            f"with no live peer to heal from: stopped instead of retraining the job alone; resume it from the "
            f"job's last checkpoint or start the whole job again")


def quorum_wait_note(waiting_since: dict[str, float], reason: str, now: float, after_s: float = 5.0) -> str | None:
    """A progress line when some group has been waiting for a quorum `after_s` seconds or more, with the
    lighthouse's own reason; None otherwise. `waiting_since`: replica id -> since when it waits, unbroken."""
    stuck = sorted((since, rid) for rid, since in waiting_since.items() if now - since >= after_s)
    if not stuck:
        return None
    names = ", ".join(f"group {g}" if (g := group_of_replica(rid)) is not None else rid for _, rid in stuck)
    return f"{names} waiting {now - stuck[0][0]:.0f} s for a quorum: {reason}"


class JobWatch:
    """Follows the groups on the lighthouse: stops a group that would retrain a finished job alone, and says
    why a quorum is not forming when groups wait for one.

    `read_status` returns the lighthouse's /status picture. Fed by `tick()` (every poll) and by the
    launcher's events (`on_event`), it fails the group through `Launcher.fail_group`, so the run fails;
    progress lines go to `on_note`.
    """

    def __init__(self, read_status: Callable[[], dict[str, Any]], interval: float = 0.2,
                 on_note: Callable[[str], None] | None = None, note_every_s: float = 10.0,
                 confirm_s: float = 2.0) -> None:
        self.read_status = read_status
        self.interval = interval
        self.on_note = on_note
        self.note_every_s = note_every_s
        self.confirm_s = confirm_s  # a verdict must hold this long (the lighthouse's steps lag a heal by a step)
        self.steps: dict[int, int] = {}  # group -> step of its live incarnation, as last seen
        self.final_steps: dict[int, int] = {}  # group -> its step when it finished
        self.waiting_since: dict[str, float] = {}  # replica id -> since when it waits for a quorum, unbroken
        self._live: set[int] = set()
        self._suspects: dict[int, float] = {}  # group -> since when the verdict holds
        self._next = 0.0
        self._next_note = 0.0

    def observe(self, status: dict[str, Any]) -> None:
        seen: dict[int, int] = {}
        for m in status.get("members", []):
            group = group_of_replica(str(m.get("replica_id", "")))
            if group is None or not m.get("healthy") or m.get("step") is None:
                continue
            seen[group] = min(seen.get(group, m["step"]), m["step"])  # a new incarnation starts lower
        self.steps.update(seen)
        self._live = set(seen)

    def _follow_waiting(self, status: dict[str, Any], now: float) -> None:
        waiting = {str(m["replica_id"]) for m in status.get("members", []) if m.get("waiting") and m.get("healthy")}
        self.waiting_since = {rid: self.waiting_since.get(rid, now) for rid in waiting}
        note = quorum_wait_note(self.waiting_since, str(status.get("reason", "")), now)
        if note is None:
            self._next_note = 0.0
        elif self.on_note is not None and now >= self._next_note:
            self._next_note = now + self.note_every_s
            self.on_note(note)

    def on_event(self, event: LaunchEvent) -> None:
        if event.kind == "done":
            self.final_steps[event.group] = self.steps.get(event.group, 0)
        elif event.kind in ("started", "killed", "died"):
            self.steps.pop(event.group, None)  # a fresh incarnation reports its own step

    def tick(self, launcher: Launcher, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            status = self.read_status()
        except Exception as exc:  # the lighthouse is busy or gone: try again at the next tick
            logger.debug("could not read the lighthouse status: %s", exc)
            return
        self.observe(status)
        self._follow_waiting(status, now)
        if not self.final_steps:
            return
        final = max(self.final_steps.values())
        running = launcher.running_groups()
        for group in running:
            peers = [s for g, s in self.steps.items() if g != group and g in self._live]
            verdict = finished_job_verdict(group, self.steps.get(group) if group in self._live else None, final,
                                           sorted(self.final_steps), peers)
            if verdict is None:
                self._suspects.pop(group, None)
            elif now - self._suspects.setdefault(group, now) >= self.confirm_s:
                launcher.fail_group(group, verdict)
        for group in [g for g in self._suspects if g not in running]:
            del self._suspects[group]


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftl launch",
        description="Run N replica groups of SCRIPT on this machine, with restarts and fault injection.",
        epilog="example: ftl launch --groups 3 --kill-every 10 --max-kills 3 -- train.py --epochs 2")
    p.add_argument("--groups", type=int, required=True, help="number of replica groups")
    p.add_argument("--nproc-per-group", type=int, default=1, help="ranks per group, like torchrun (default 1)")
    p.add_argument("--lighthouse", default=None,
                   help="address of a running lighthouse (default: start one on loopback)")
    p.add_argument("--min-replicas", type=int, default=1, help="embedded lighthouse: smallest quorum (default 1)")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="embedded lighthouse: how long a quorum waits for live groups that have not joined "
                        "(default 1000)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=None, help="embedded lighthouse: heartbeat timeout")
    p.add_argument("--kill-every", type=float, default=None, metavar="SECONDS",
                   help="SIGKILL a random group about every SECONDS (seeded)")
    p.add_argument("--max-kills", type=int, default=None, help="stop injecting after this many kills")
    p.add_argument("--no-restart", action="store_true", help="do not restart groups that die")
    p.add_argument("--restart-delay", type=float, default=1.0,
                   help="seconds before a dead group restarts; doubles with each crash in a row, up to 30 s")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help=f"give up on a group after this many crashes (kills by --kill-every do not count; "
                        f"default {DEFAULT_MAX_RESTARTS})")
    p.add_argument("--spares", action="store_true",
                   help="keep a warm spare per rank (torch and ft_core imported, waiting) so a restart skips the "
                        "imports; costs one idle process per rank")
    p.add_argument("--spare-import", action="append", default=[], metavar="MODULE",
                   help="with --spares: also import MODULE ahead (e.g. lightning); repeatable")
    p.add_argument("--seed", type=int, default=None, help="seed of the fault schedule")
    p.add_argument("--token", default=None, help="shared token for every RPC (default: $FT_TOKEN)")
    p.add_argument("--log-dir", default=None, help="write each group's output to DIR/group<N>.log "
                                                    "instead of prefixing it on the console")
    p.add_argument("--stop-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL at exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS] (or -- -m MODULE [ARGS])")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse `ftl launch` arguments; everything after `--` is the script and its arguments."""
    argv = list(argv)
    parser = build_parser()
    if "--" in argv:
        cut = argv.index("--")
        args = parser.parse_args(argv[:cut])
        args.command = argv[cut + 1:]
    else:
        args = parser.parse_args(argv)
    errors = []
    if args.groups < 1:
        errors.append("--groups must be at least 1")
    if args.nproc_per_group < 1:
        errors.append("--nproc-per-group must be at least 1")
    if args.kill_every is not None and args.kill_every <= 0:
        errors.append("--kill-every must be > 0 seconds")
    if args.max_kills is not None and args.max_kills < 0:
        errors.append("--max-kills must be >= 0")
    if args.max_restarts < 0:
        errors.append("--max-restarts must be >= 0")
    if args.restart_delay < 0:
        errors.append("--restart-delay must be >= 0 seconds")
    if args.spare_import and not args.spares:
        errors.append("--spare-import needs --spares")
    if not args.command:
        errors.append("no script given: put it after `--`, e.g. `ftl launch --groups 2 -- train.py`")
    elif args.command[0] == "-m":
        if len(args.command) < 2:
            errors.append("`-m` needs a module name")
    elif not os.path.isfile(args.command[0]):
        errors.append(f"script {args.command[0]!r} not found (run from its folder or give its path)")
    if errors:
        parser.error("; ".join(errors))
    return args


def start_lighthouse(min_replicas: int, token: str | None, join_timeout_ms: int | None = None,
                     heartbeat_timeout_ms: int | None = None) -> LighthouseServer:
    """An embedded lighthouse on loopback, port chosen by the OS (caller owns `.shutdown()`)."""
    kwargs: dict[str, Any] = {"bind": f"{LOOPBACK}:0", "min_replicas": min_replicas, "token": token}
    if join_timeout_ms is not None:
        kwargs["join_timeout_ms"] = join_timeout_ms
    if heartbeat_timeout_ms is not None:
        kwargs["heartbeat_timeout_ms"] = heartbeat_timeout_ms
    return LighthouseServer(**kwargs)


def status_url(lighthouse: Any) -> str:
    """The lighthouse's HTML status page as a URL."""
    addr = str(lighthouse.http_address())
    return addr if addr.startswith("http") else f"http://{addr}/"


def main(argv: list[str], stop: StopSignals | None = None) -> int:
    """`ftl launch`: exit 0 only when every group finished; 1 when one was lost; 128+N on signal N.

    `stop`: the stop handlers `ftl` installed before importing this module (so a Ctrl-C during the imports is not
    lost); this function installs its own when called without them. Restored on return either way.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if stop is None:  # before anything starts, so Ctrl-C from here on always ends what we start
        stop = StopSignals()
    console = Console(highlight=False)
    lighthouse = None
    try:
        if stop.event.is_set():  # Ctrl-C while Python was still importing us: start nothing
            return stop.exit_code
        args = parse_args(argv)
        token = args.token or os.environ.get("FT_TOKEN") or None
        command = [sys.executable, *args.command]
        if args.lighthouse:
            try:
                address = check_reachable(args.lighthouse, hint="--lighthouse")
            except RPCError as exc:
                console.print(f"[red]ftl launch: error: {escape(str(exc))}[/]", soft_wrap=True)
                return 1
        else:
            lighthouse = start_lighthouse(args.min_replicas, token, args.join_timeout_ms, args.heartbeat_timeout_ms)
            address = lighthouse.address()
            console.print(f"[bold]lighthouse[/] {address}   status page: {status_url(lighthouse)}")
        if stop.event.is_set():
            return stop.exit_code
        colors = ["cyan", "magenta", "green", "yellow", "blue", "red"]

        def on_output(group: int, rank: int, line: str) -> None:
            tag = f"g{group}" if args.nproc_per_group == 1 else f"g{group}r{rank}"
            console.print(f"[{colors[group % len(colors)]}]\\[{tag}][/] {escape(line)}", soft_wrap=True)

        if lighthouse is not None:
            read_status = lighthouse.core.status
        else:
            def read_status() -> dict[str, Any]:
                return fetch_status(address, token, timeout_s=1.0)
        watch = JobWatch(read_status, interval=0.2 if lighthouse is not None else 1.0,
                         on_note=lambda text: console.print(f"[yellow]\\[launch] {escape(text)}[/]", soft_wrap=True))

        def on_event(event: LaunchEvent) -> None:
            watch.on_event(event)
            color = {"killed": "red", "died": "red", "lost": "bold red", "done": "green"}.get(event.kind, "dim")
            console.print(f"[{color}]\\[launch] group {event.group} {event.kind}: {escape(event.detail)}[/]",
                          soft_wrap=True)

        injector = None
        if args.kill_every:
            injector = FaultInjector(args.kill_every, max_kills=args.max_kills, seed=args.seed,
                                     min_survivors=max(1, args.min_replicas))
        launcher = Launcher(command, args.groups, nproc_per_group=args.nproc_per_group, lighthouse=address,
                            token=token, restart=not args.no_restart, restart_delay=args.restart_delay,
                            log_dir=args.log_dir, on_output=None if args.log_dir else on_output,
                            on_event=on_event, stop_grace=args.stop_grace, max_restarts=args.max_restarts,
                            spares=args.spares, spare_imports=args.spare_import)
        with launcher:
            if args.log_dir:
                console.print(f"group output: {os.path.abspath(args.log_dir)}/group<N>.log")
            if stop.event.is_set():  # Ctrl-C since the lighthouse started: start no group
                return stop.exit_code
            launcher.start()
            finished = launcher.run_until_done(stop.event, injector=injector, on_tick=lambda: watch.tick(launcher))
            if not finished:
                console.print("[yellow]\\[launch] stop requested: ending every group[/]")
                launcher.shutdown(grace=0.0 if stop.count > 1 else None)
        table = Table("group", "state", "restarts", "kills", "detail", title="ftl launch")
        for s in launcher.statuses():
            table.add_row(str(s.group), s.state.value, str(s.incarnation), str(s.kills), escape(s.detail))
        console.print(table)
        if not finished:
            return stop.exit_code
        if launcher.succeeded:
            console.print(f"[green]all {args.groups} groups finished[/]")
            return 0
        lost = launcher.lost_groups()
        console.print(f"[bold red]run failed: group(s) {', '.join(map(str, lost))} lost[/]")
        for s in launcher.statuses():
            if s.state == GroupState.LOST:
                console.print(f"[red]  group {s.group}: {escape(s.detail)}[/]", soft_wrap=True)
        return 1
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        stop.restore()
