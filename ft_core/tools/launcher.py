"""The Launcher: start, watch, kill and restart N replica groups of processes on this machine.

It owns every process it starts. Each rank runs in its own session, so SIGKILL to its process
group also takes whatever the rank spawned. A rank is never reaped before its process group has
been signalled: while we hold it unreaped its pid, and so its process group id, cannot be reused
by another process, which makes every signal we send land on our own processes.

A group that crashes on its own (not killed by us) restarts with exponential backoff and is given up
on (lost, naming its last output) after `max_restarts` crashes, so a script that always fails does
not restart forever. A group whose rank died of `JobFinishedError` (the lighthouse refused it: the job
had finished ahead of it) is lost at once, not restarted: a restart would be refused again.

Used by `ftl launch` (ft_core/tools/launch_command.py), `ftl demo` and chaos runs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any, Protocol

from ft_core.errors import JobFinishedError
from ft_core.tools.ports import LOOPBACK, free_port
from ft_core.tools.procs import describe_exit, exit_status, signal_group
from ft_core.tools.spares import Spare, spare_argv

logger = logging.getLogger(__name__)

DEFAULT_RES_OPTIONS = "timeout:1 attempts:1"
DEFAULT_MAX_RESTARTS = 10  # crashes of one group before it is given up on (kills by the launcher do not count)
MAX_RESTART_DELAY_S = 30.0
STABLE_RUN_S = 30.0  # an incarnation that ran this long before crashing starts the backoff over
SPARE_DELAY_S = 10.0  # a group's spares start this long after its incarnation, not competing with its start
_REFUSED = f"{JobFinishedError.__name__}: "  # how the engine's "the job finished ahead of you" ends a script


class FailureSource(Protocol):
    """Anything that may kill groups on a schedule (ft_core.tools.launch_command.FaultInjector, a chaos plan)."""

    def tick(self, launcher: Launcher, now: float | None = None) -> Any: ...


class GroupState(str, Enum):
    """Where a replica group is in its life, as the launcher sees it."""

    PENDING = "pending"  # not started yet
    RUNNING = "running"
    RESTARTING = "restarting"  # died; a fresh incarnation starts after the restart delay
    DONE = "done"  # every rank exited 0
    LOST = "lost"  # died and will not be restarted
    STOPPED = "stopped"  # ended by the launcher (shutdown or stop_group)


@dataclass(frozen=True)
class LaunchEvent:
    """Something that happened to a replica group; `kind` is started|killed|died|restarting|done|lost|stopped."""

    kind: str
    group: int
    incarnation: int
    time: float  # unix seconds
    detail: str = ""


@dataclass(frozen=True)
class GroupStatus:
    """A snapshot of one replica group for displays and summaries."""

    group: int
    state: GroupState
    incarnation: int  # 0 for the first start, +1 per restart
    kills: int  # SIGKILLs by the launcher (fault injection or kill_group)
    deaths: int  # every unplanned end: kills and crashes
    detail: str
    pids: tuple[int, ...]
    crashes: int = 0  # deaths the launcher did not cause
    spare_pids: tuple[int, ...] = ()  # its warm spares, waiting to become its next incarnation


@dataclass
class _Incarnation:
    number: int
    ranks: list[subprocess.Popen]
    master_port: int
    readers: list[threading.Thread] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)


@dataclass
class _Group:
    index: int
    state: GroupState = GroupState.PENDING
    incarnation: _Incarnation | None = None
    next_incarnation: int = 0
    restart_at: float = 0.0
    kills: int = 0
    deaths: int = 0
    crashes: int = 0  # deaths the launcher did not cause (counted against max_restarts)
    crash_streak: int = 0  # crashes in a row, each soon after its start (drives the backoff)
    started_at: float = 0.0
    last_line: str = ""  # the last non-empty line the group printed (for "died" details)
    refusal: str = ""  # the JobFinishedError line a rank printed: the job finished ahead of this incarnation
    detail: str = ""
    spares: list[Spare] = field(default_factory=list)  # one per rank, waiting to become the next incarnation
    spare_at: float = 0.0  # when to start them
    spares_off: str = ""  # why this group gets no more spares (one died before it was used)


def restart_delay_after(base: float, crash_streak: int, cap: float = MAX_RESTART_DELAY_S) -> float:
    """Seconds before restarting a group: `base` after a kill (streak 0) or a first crash; then doubling
    from max(base, 0.5 s) with each further crash in a row, at most `cap` (but never below `base`)."""
    if crash_streak <= 1:
        return base
    return max(base, min(cap, max(base, 0.5) * 2.0 ** (crash_streak - 1)))


def _log_tail(path: str, nbytes: int) -> list[str]:
    """The lines of the last `nbytes` of a rank's log file; none if it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - nbytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def group_env(base: Mapping[str, str], *, group: int, num_groups: int, rank: int, nproc_per_group: int,
              master_port: int, lighthouse: str | None, token: str | None, restart_count: int) -> dict[str, str]:
    """The environment of one rank of one replica group (torchrun's names plus ours)."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("RES_OPTIONS", DEFAULT_RES_OPTIONS)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({
        "REPLICA_GROUP_ID": str(group),
        "NUM_REPLICA_GROUPS": str(num_groups),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc_per_group),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc_per_group),
        "GROUP_RANK": "0",
        "FT_RESTART_COUNT": str(restart_count),
    })
    metrics_port = env.get("FT_METRICS_PORT", "").strip()
    if metrics_port.isdigit() and int(metrics_port) > 0:  # one /metrics port per group: PORT, PORT+1, ...
        env["FT_METRICS_PORT"] = str(int(metrics_port) + group)
    if lighthouse:
        env["FT_LIGHTHOUSE"] = lighthouse
    if token:
        env["FT_TOKEN"] = token
    return env


class Launcher:
    """Starts, watches, kills and restarts N replica groups of `nproc_per_group` ranks running `command`.

    Drive it with `poll()` (reaps exits, restarts due groups, returns events) or `run_until_done()`.
    Every process it starts is ended by `shutdown()` (also on `__exit__`).
    """

    def __init__(self, command: Sequence[str], num_groups: int, *, nproc_per_group: int = 1,
                 lighthouse: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None,
                 restart: bool = True, restart_delay: float = 1.0, log_dir: str | None = None,
                 on_output: Callable[[int, int, str], None] | None = None,
                 on_event: Callable[[LaunchEvent], None] | None = None, stop_grace: float = 5.0,
                 max_restarts: int | None = DEFAULT_MAX_RESTARTS, spares: bool = False,
                 spare_imports: Sequence[str] = (), spare_delay: float = SPARE_DELAY_S) -> None:
        if not command:
            raise ValueError("Launcher needs a command to run, e.g. [sys.executable, 'train.py']")
        if num_groups < 1 or nproc_per_group < 1:
            raise ValueError(f"need at least one group of one rank (got groups={num_groups}, "
                             f"nproc_per_group={nproc_per_group})")
        if spares:
            spare_argv(command, spare_imports)  # ValueError now, not at the first restart
        self.command = list(command)
        self.spares = spares
        self.spare_imports = tuple(spare_imports)
        self.spare_delay = spare_delay
        self.num_groups = num_groups
        self.nproc_per_group = nproc_per_group
        self.lighthouse = lighthouse
        self.token = token
        self.base_env = dict(os.environ if env is None else env)
        self.restart = restart
        self.restart_delay = restart_delay
        self.max_restarts = max_restarts
        self.log_dir = log_dir
        self.on_output = on_output
        self.on_event = on_event
        self.stop_grace = stop_grace
        self.events: list[LaunchEvent] = []
        self._groups = [_Group(i) for i in range(num_groups)]
        self._lock = threading.RLock()
        self._closed = False
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    # ----------------------------------------------------------------- queries

    def status(self, group: int) -> GroupStatus:
        g = self._groups[group]
        inc = g.incarnation
        return GroupStatus(group=g.index, state=g.state, incarnation=max(0, g.next_incarnation - 1),
                           kills=g.kills, deaths=g.deaths, detail=g.detail,
                           pids=tuple(p.pid for p in inc.ranks) if inc else (), crashes=g.crashes,
                           spare_pids=tuple(s.proc.pid for s in g.spares))

    def statuses(self) -> list[GroupStatus]:
        return [self.status(i) for i in range(self.num_groups)]

    def running_groups(self) -> list[int]:
        return [g.index for g in self._groups if g.state == GroupState.RUNNING]

    def lost_groups(self) -> list[int]:
        return [g.index for g in self._groups if g.state == GroupState.LOST]

    def any_done(self) -> bool:
        return any(g.state == GroupState.DONE for g in self._groups)

    @property
    def finished(self) -> bool:
        """True when no group is running or waiting to restart."""
        return all(g.state in (GroupState.DONE, GroupState.LOST, GroupState.STOPPED) for g in self._groups)

    @property
    def succeeded(self) -> bool:
        return all(g.state == GroupState.DONE for g in self._groups)

    def log_path(self, group: int, rank: int = 0) -> str | None:
        """Where a rank's output goes when the launcher writes logs to a folder."""
        if not self.log_dir:
            return None
        name = f"group{group}.log" if self.nproc_per_group == 1 else f"group{group}.rank{rank}.log"
        return os.path.join(self.log_dir, name)

    # ----------------------------------------------------------------- actions

    def start(self) -> None:
        """Start every group that has not started yet."""
        for g in self._groups:
            if g.state == GroupState.PENDING:
                self.start_group(g.index)

    def start_group(self, group: int) -> None:
        """Start a fresh incarnation of `group` (no-op while it runs)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("Launcher is shut down; create a new one to start groups")
            g = self._groups[group]
            if g.state == GroupState.RUNNING:
                return
            number = g.next_incarnation
            g.next_incarnation += 1
            inc = _Incarnation(number=number, ranks=[], master_port=free_port())
            g.incarnation = inc
            g.state = GroupState.RUNNING
            g.detail = ""
            g.last_line = ""
            g.refusal = ""
            g.started_at = time.monotonic()
            g.spare_at = g.started_at + self.spare_delay
            warm = self._take_spares(g)
            try:
                for rank in range(self.nproc_per_group):
                    self._spawn_rank(g, inc, rank, warm[rank] if warm else None)
            except OSError as exc:
                self._end_incarnation(g, signal.SIGKILL)
                for spare in warm[len(inc.ranks):]:  # the ranks after the one that failed never took theirs
                    spare.dismiss()
                g.state = GroupState.LOST
                g.detail = f"could not start {self.command[0]!r}: {exc}"
                self._emit("lost", g, g.detail)
                return
            pids = ",".join(str(p.pid) for p in inc.ranks)
            source = ", from warm spares" if warm else ""
            self._emit("started", g, f"pid {pids}, MASTER_PORT {inc.master_port}{source}")

    def kill_group(self, group: int, reason: str = "killed") -> bool:
        """SIGKILL every process of `group` at once (a machine dying); it restarts unless restart=False."""
        with self._lock:
            g = self._groups[group]
            if g.state != GroupState.RUNNING or g.incarnation is None:
                return False
            self._end_incarnation(g, signal.SIGKILL)
            g.kills += 1
            self._emit("killed", g, reason)
            self._after_death(g, reason, crashed=False)
            return True

    def fail_group(self, group: int, reason: str, grace: float | None = None) -> None:
        """End `group` (SIGTERM, then SIGKILL) and mark it lost for `reason`: the run then fails."""
        self._end_group(group, grace, GroupState.LOST, reason, "lost")

    def stop_group(self, group: int, grace: float | None = None) -> None:
        """End `group` gently (SIGTERM, then SIGKILL after `grace` s); it is not restarted."""
        self._end_group(group, grace, GroupState.STOPPED, "stopped by the launcher", "stopped")

    def _end_group(self, group: int, grace: float | None, state: GroupState, detail: str, event: str) -> None:
        """End a group still alive (SIGTERM, then SIGKILL after `grace` s) and leave it in `state`."""
        with self._lock:
            g = self._groups[group]
            if g.state in (GroupState.DONE, GroupState.LOST, GroupState.STOPPED):
                return
            if g.state == GroupState.RUNNING and g.incarnation is not None:
                self._terminate([g], self.stop_grace if grace is None else grace)
            g.state = state
            g.detail = detail
            self._emit(event, g, detail)

    def poll(self) -> list[LaunchEvent]:
        """Reap ended groups, restart those that are due; return the events since the last poll."""
        with self._lock:
            first = len(self.events)
            now = time.monotonic()
            for g in self._groups:
                if g.state == GroupState.RUNNING:
                    self._check(g)
                elif g.state == GroupState.RESTARTING and now >= g.restart_at and not self._closed:
                    if self.any_done():
                        g.state = GroupState.LOST
                        g.detail += "; not restarted: other groups already finished"
                        self._emit("lost", g, g.detail)
                    else:
                        self.start_group(g.index)
                if self.spares:
                    self._tend_spares(g, now)
            return self.events[first:]

    def run_until_done(self, stop: threading.Event | None = None, *, injector: FailureSource | None = None,
                       on_tick: Callable[[], None] | None = None, interval: float = 0.1) -> bool:
        """Poll until every group is done or lost (True) or `stop` is set (False)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            self.poll()
            if injector is not None:
                injector.tick(self)
            if on_tick is not None:
                on_tick()
            if self.finished:
                return True
            stop.wait(interval)
        return False

    def shutdown(self, grace: float | None = None) -> None:
        """End every process this launcher started: SIGTERM, then SIGKILL after `grace` s. Idempotent."""
        with self._lock:
            self._closed = True
            live = [g for g in self._groups if g.state == GroupState.RUNNING and g.incarnation is not None]
            self._terminate(live, self.stop_grace if grace is None else grace)
            for g in self._groups:
                self._dismiss_spares(g)
                if g.state in (GroupState.RUNNING, GroupState.RESTARTING, GroupState.PENDING):
                    g.state = GroupState.STOPPED
                    g.detail = (g.detail + "; " if g.detail else "") + "stopped at shutdown"
                    self._emit("stopped", g, "stopped at shutdown")

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- internals

    def _spawn_rank(self, g: _Group, inc: _Incarnation, rank: int, spare: Spare | None = None) -> None:
        env = self._rank_env(g, rank, inc.master_port, inc.number)
        stdout: Any = None
        path = self.log_path(g.index, rank)
        if path:
            log = open(path, "ab")  # noqa: SIM115 - owned by the incarnation, closed when it ends
            log.write(f"===== group {g.index} rank {rank} incarnation {inc.number} "
                      f"started {time.strftime('%H:%M:%S')}{' (warm spare)' if spare else ''} =====\n".encode())
            log.flush()
            inc.logs.append(log)
            stdout = log
        elif self.on_output is not None:
            stdout = subprocess.PIPE
        proc = None
        if spare is not None:  # its output already goes where this rank's goes
            try:
                proc = spare.activate(self.command, env)
            except OSError as exc:
                logger.warning("group %d rank %d: %s; starting it cold", g.index, rank, exc)
                spare.dismiss()
        if proc is None:
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                                    stderr=subprocess.STDOUT if stdout is not None else None,
                                    start_new_session=True)
        inc.ranks.append(proc)
        if stdout is subprocess.PIPE:
            reader = threading.Thread(target=self._pump, args=(g.index, rank, proc.stdout),
                                      name=f"ftl-launch-output-g{g.index}r{rank}", daemon=True)
            reader.start()
            inc.readers.append(reader)

    def _rank_env(self, g: _Group, rank: int, master_port: int, incarnation: int) -> dict[str, str]:
        return group_env(self.base_env, group=g.index, num_groups=self.num_groups, rank=rank,
                         nproc_per_group=self.nproc_per_group, master_port=master_port,
                         lighthouse=self.lighthouse, token=self.token, restart_count=incarnation)

    def _take_spares(self, g: _Group) -> list[Spare]:
        """The group's spares for its new incarnation if every rank has a live one (else none: all start cold)."""
        spares, g.spares = g.spares, []
        if spares and all(s.alive() for s in spares):
            return spares
        for spare in spares:
            spare.dismiss()
        return []

    def _tend_spares(self, g: _Group, now: float) -> None:
        """Start a running group's spares when due; drop them when it is over or one of them died."""
        if self._closed or g.state in (GroupState.DONE, GroupState.LOST, GroupState.STOPPED):
            self._dismiss_spares(g)
        elif g.spares:
            dead = next((s for s in g.spares if not s.alive()), None)
            if dead is not None:  # an import failed, or the OOM killer: do not keep starting them
                self._dismiss_spares(g)
                g.spares_off = (f"a warm spare ended before it was used ({describe_exit(exit_status(dead.proc))}, "
                                f"see the group's output); this group restarts cold from now on")
                self._emit("spare", g, g.spares_off)
        elif g.state == GroupState.RUNNING and not g.spares_off and now >= g.spare_at:
            try:
                for rank in range(self.nproc_per_group):
                    g.spares.append(self._start_spare(g, rank))
            except OSError as exc:
                self._dismiss_spares(g)
                g.spares_off = f"could not start a warm spare: {exc}; this group restarts cold"
                self._emit("spare", g, g.spares_off)

    def _start_spare(self, g: _Group, rank: int) -> Spare:
        env = self._rank_env(g, rank, 0, g.next_incarnation)  # the port and count come with the activation
        path = self.log_path(g.index, rank)
        if path:
            with open(path, "ab") as log:  # the spare keeps its own copy
                return Spare(self.command, env, stdout=log, imports=self.spare_imports)
        return Spare(self.command, env, stdout=subprocess.PIPE if self.on_output is not None else None,
                     imports=self.spare_imports)

    def _dismiss_spares(self, g: _Group) -> None:
        for spare in g.spares:
            spare.dismiss()
        g.spares = []

    def _pump(self, group: int, rank: int, stream: IO[bytes]) -> None:
        assert self.on_output is not None
        with stream:
            for raw in stream:
                line = raw.decode("utf-8", "replace")
                text = line.strip()
                if text:
                    self._groups[group].last_line = text
                    if _REFUSED in text:
                        self._groups[group].refusal = text
                try:
                    self.on_output(group, rank, line.rstrip("\r\n"))
                except Exception:  # a broken display must not stop the drain (the child would block)
                    logger.exception("output callback failed for group %d rank %d", group, rank)

    def _check(self, g: _Group) -> None:
        assert g.incarnation is not None
        codes = [exit_status(p) for p in g.incarnation.ranks]
        failed = [(rank, c) for rank, c in enumerate(codes) if c is not None and c != 0]
        if failed:
            rank, code = failed[0]
            what = describe_exit(code) if self.nproc_per_group == 1 else f"rank {rank} {describe_exit(code)}"
            self._end_incarnation(g, signal.SIGKILL)  # one rank down = the whole group down
            last = self._last_output(g, rank)
            if last and code is not None and code > 0:
                what += f" (last output: {last[:300]})"
            self._emit("died", g, what)
            refusal = self._refusal(g, rank)
            if refusal:  # restarting it would be refused again: the job is over
                g.deaths += 1
                g.crashes += 1
                g.state = GroupState.LOST
                g.detail = f"refused, not restarted: {refusal}"
                self._emit("lost", g, g.detail)
                return
            self._after_death(g, what, crashed=True)
        elif all(c == 0 for c in codes):
            self._end_incarnation(g, signal.SIGKILL)  # also ends anything the ranks left behind
            g.state = GroupState.DONE
            g.detail = "finished"
            self._emit("done", g, "all ranks exited 0")

    def _last_output(self, g: _Group, rank: int) -> str:
        """The last non-empty line a crashed rank printed: from its log file, else from the output pump."""
        path = self.log_path(g.index, rank)
        if not path:
            return g.last_line
        lines = [line.strip() for line in _log_tail(path, 4096) if line.strip()]
        return lines[-1] if lines and not lines[-1].startswith("=====") else ""

    def _refusal(self, g: _Group, rank: int) -> str:
        """The JobFinishedError a crashed rank printed (from its log's tail, else from its output), without the type."""
        text = g.refusal
        path = self.log_path(g.index, rank)
        if path:
            text = next((line for line in reversed(_log_tail(path, 16384)) if _REFUSED in line), "")
        return text.split(_REFUSED, 1)[1].strip() if _REFUSED in text else ""

    def _after_death(self, g: _Group, what: str, crashed: bool) -> None:
        g.deaths += 1
        if crashed:
            g.crashes += 1
            quick = time.monotonic() - g.started_at < STABLE_RUN_S
            g.crash_streak = g.crash_streak + 1 if quick else 1
        else:
            g.crash_streak = 0
        if self.restart and not self._closed and crashed and self.max_restarts is not None \
                and g.crashes > self.max_restarts:
            g.state = GroupState.LOST
            g.detail = (f"{what}; keeps crashing: {g.crashes} crashes, not restarted past --max-restarts "
                        f"{self.max_restarts} (read its output for the cause)")
            self._emit("lost", g, g.detail)
        elif self.restart and not self._closed:
            delay = restart_delay_after(self.restart_delay, g.crash_streak)
            g.state = GroupState.RESTARTING
            g.restart_at = time.monotonic() + delay
            g.detail = what
            streak = f" (crash {g.crash_streak} in a row)" if g.crash_streak > 1 else ""
            self._emit("restarting", g, f"{what}; restarting in {delay:g}s{streak}")
        else:
            g.state = GroupState.LOST
            g.detail = f"{what}; not restarted (--no-restart)" if not self.restart else what
            self._emit("lost", g, g.detail)

    def _end_incarnation(self, g: _Group, sig: int) -> None:
        """Signal every rank's process group with `sig`, then reap the ranks and close their outputs."""
        inc = g.incarnation
        if inc is None:
            return
        for proc in inc.ranks:
            signal_group(proc, sig)
        for proc in inc.ranks:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel: SIGKILL is still on its way
                logger.error("group %d pid %d did not end 10 s after SIGKILL", g.index, proc.pid)
        for reader in inc.readers:
            reader.join(timeout=2)
        for log in inc.logs:
            log.close()
        inc.logs.clear()

    def _terminate(self, groups: list[_Group], grace: float) -> None:
        """SIGTERM the groups, wait up to `grace` s for them to exit, then SIGKILL whatever is left."""
        for g in groups:
            for proc in g.incarnation.ranks if g.incarnation else ():
                signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, grace)
        while time.monotonic() < deadline:
            if all(exit_status(p) is not None for g in groups for p in (g.incarnation.ranks if g.incarnation else ())):
                break
            time.sleep(0.05)
        for g in groups:
            self._end_incarnation(g, signal.SIGKILL)

    def _emit(self, kind: str, g: _Group, detail: str) -> None:
        event = LaunchEvent(kind=kind, group=g.index, incarnation=max(0, g.next_incarnation - 1),
                            time=time.time(), detail=detail)
        self.events.append(event)
        logger.info("group %d %s: %s", g.index, kind, detail)
        if self.on_event is not None:
            self.on_event(event)
