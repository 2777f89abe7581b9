"""`ftl chaos`: a seeded random fault schedule against a real training job, then a verdict.

The job: a lighthouse child process (`ftl lighthouse`, so it can be killed and restarted on the same
port) and N replica groups of `ft_core.tools.chaos_worker` run by the `Launcher` (restarted when they die).
The schedule (seeded; times depend on the machine) draws faults from:
- kill: SIGKILL a training group at a random point of its step;
- hang: SIGSTOP a group for longer than the timeouts, then SIGCONT it;
- kill_heal_source / kill_heal_receiver: wait for a heal (seen in the workers' logs; a kill is
  injected to provoke one) and SIGKILL its source or its receiver while the checkpoint moves;
- lighthouse: SIGKILL the lighthouse and restart it on the same port after a pause.
With --network (ft_core.tools.chaos_network) the groups and two lighthouses (primary + standby) run on
simulated hosts, and the schedule also cuts a group's host, blocks two groups from each other, and cuts
a lighthouse's host.
Throughout, each group's checkpoint server delays every request and drops some (chaos transport).
The job's configuration is one cell of a matrix chosen by the seed (ft_core.tools.chaos_matrix,
`--matrix list`): ranks per group, quorum mode, init_sync, BatchNorm, two optimizers, MAX/MIN
checks, and faults the workers inject (skipped steps, failed loads and fetches on the healer).
Faults wait until the job has made progress since the last one and leave min_replicas groups up.
After the last fault the job trains `quiet_steps` more steps, the harness writes the exit file and
checks the records (ft_core.tools.chaos_checks) and that no process is left behind.

    ftl chaos --groups 3 --faults 200 --seed 1 --out chaos-run
    ftl chaos --matrix list                  # the cells; --matrix 4,7 limits the seed's choice to them
    ftl chaos --network --faults 20          # as root: network faults too (ft_core.tools.chaos_network)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ft_core.tools.chaos_checks import (
    LogTail,
    check_ledger,
    check_run,
    network_fault_outcomes,
    parse_log_name,
    read_run,
)
from ft_core.tools.chaos_matrix import (
    FAULT_KINDS,
    HEAL_FAULT_SLOTS,
    HEAL_KINDS,
    NETWORK_KINDS,
    ChaosConfig,
    draw_kind,
    matrix_table,
    parse_matrix,
    provoke_due,
)
from ft_core.tools.chaos_network import (
    LIGHTHOUSE_HOSTS,
    Network,
    durations,
    graces,
    network_unavailable,
)
from ft_core.tools.chaos_processes import LighthouseProcess, leftovers
from ft_core.tools.chaos_report import build_parser, print_summary, summarize
from ft_core.tools.chaos_state import Fault, Live, Stopped
from ft_core.tools.chaos_worker import EXIT_FILE
from ft_core.tools.launcher import GroupState, Launcher, LaunchEvent
from ft_core.tools.stop_signals import StopSignals
from ft_core.tools.netns import NetnsError

__all__ = ["FAULT_KINDS", "NETWORK_KINDS", "ChaosConfig", "ChaosRun", "main"]

logger = logging.getLogger(__name__)

POLL_S = 0.05
EXIT_SKIPPED = 3  # `--network` where simulated hosts cannot be made (not root, no `ip netns`, no nft)


def _send(kill: Callable[[int, int], None], pids: Iterable[int], sig: int) -> None:
    """`kill(pid, sig)` (os.kill or os.killpg) for each pid; one that has already ended is skipped."""
    for pid in pids:
        try:
            kill(pid, sig)
        except ProcessLookupError:
            pass


class ChaosRun:
    """Drives one run: the job, the fault schedule, the final phase and the verdict (`run()`)."""

    def __init__(self, cfg: ChaosConfig, *, console: Any = None, stop: threading.Event | None = None) -> None:
        self.cfg = cfg = dataclasses.replace(cfg, token=cfg.token or secrets.token_hex(16))
        os.makedirs(cfg.out, exist_ok=True)
        for name in os.listdir(cfg.out):
            if name.endswith(".jsonl") or name in (EXIT_FILE, EXIT_FILE + ".tmp", "summary.json"):
                os.remove(os.path.join(cfg.out, name))
        self.console = console
        self.stop = stop or threading.Event()
        self.rng = random.Random(cfg.seed)
        self.faults: list[Fault] = []
        self.skipped: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.sessions: set[int] = set()
        self.tails: dict[str, LogTail] = {}
        self.live: dict[tuple[str, int], Live] = {}
        self.stopped: Stopped | None = None
        self.exit_seen: dict[str, float] = {}
        self.stranded: list[int] = []  # groups stopped at the end, stranded below the exit step
        self.lighthouse_back_at: float | None = None
        self.armed: tuple[str, float] | None = None  # (kind, armed at) of a heal fault waiting for a heal
        self.provoked_at: float | None = None  # when the armed heal fault last killed a group to provoke its heal
        self.heal_miss = ""  # why the armed heal fault did not fire at the last heal it saw (for its skip)
        self.bag: list[str] = []  # fault kinds left in this round
        self.target: int | None = None
        self.progress_mark = 0
        self.next_fault_at = 0.0
        self.started = time.monotonic()
        self.network = Network(cfg.groups, self.rng) if cfg.network else None
        self.net_fault: Fault | None = None  # the network fault in force
        if self.network is None:
            self.lighthouses = [LighthouseProcess(cfg, os.path.join(cfg.out, "lighthouse.log"))]
        else:  # a primary and a standby, each on a host of its own; groups get both addresses
            self.lighthouses = [LighthouseProcess(cfg, os.path.join(cfg.out, f"lighthouse.{name}.log"),
                                                  host=self.network.address(name), prefix=self.network.prefix(name))
                                for name in LIGHTHOUSE_HOSTS]
            for lighthouse in self.lighthouses:  # they ask each other, so they never split the job (docs/chaos.md gap 4)
                lighthouse.peers = [lh.address for lh in self.lighthouses]
        self.lighthouse = self.lighthouses[0]  # the one the `lighthouse` fault kills and restarts
        worker = [sys.executable, "-m", "ft_core.tools.chaos_worker", "--out", cfg.out,
                  "--min-replicas", str(cfg.min_replicas), "--timeout", str(cfg.timeout),
                  "--quorum-timeout", str(cfg.quorum_timeout), "--seed", str(cfg.seed),
                  "--step-sleep", str(cfg.step_sleep), "--transport-delay-ms", str(cfg.transport_delay_ms),
                  "--transport-drop", str(cfg.transport_drop), *cfg.cell.worker_args()]
        if cfg.ledger:
            worker += ["--ledger", "--dataset-size", str(cfg.dataset_size)]
        if self.network is not None:
            worker = self.network.worker_command(worker)
        self.launcher = Launcher(worker, cfg.groups, nproc_per_group=cfg.cell.ranks,
                                 lighthouse=",".join(lh.address for lh in self.lighthouses), token=cfg.token,
                                 restart=True, restart_delay=cfg.restart_delay, log_dir=os.path.join(cfg.out, "logs"),
                                 on_event=self._on_launch_event, stop_grace=5.0, spares=cfg.spares)

    def say(self, message: str) -> None:
        logger.info(message)
        if self.console is not None:
            self.console.print(f"[dim]{time.monotonic() - self.started:7.1f}s[/dim] {message}", highlight=False)

    def _on_launch_event(self, event: LaunchEvent) -> None:
        if event.kind == "died":
            self.unexpected.append(f"group {event.group} incarnation {event.incarnation} died on its own: "
                                   f"{event.detail}")
            self.say(f"[red]group {event.group} died on its own: {event.detail}[/red]")

    def _read_logs(self) -> None:
        for name in os.listdir(self.cfg.out):
            if name.endswith(".jsonl") and name not in self.tails:
                self.tails[name] = LogTail(os.path.join(self.cfg.out, name))
        for name, tail in self.tails.items():
            records = tail.read()
            where = parse_log_name(name)
            if records and where is not None and where[1] == 0:  # the schedule follows each group's rank 0
                self.live.setdefault((where[0], where[2]), Live()).update(records)

    def _current(self, group: int) -> Live:
        """What the group's current incarnation has logged so far."""
        return self.live.get((str(group), self.launcher.status(group).incarnation)) or Live()

    def max_step(self) -> int:
        return max((live.last_step for live in self.live.values()), default=0)

    def _up(self, group: int, now_unix: float) -> bool:
        """Training right now: running, not stopped, committed in this incarnation within 10 s."""
        if self.launcher.status(group).state != GroupState.RUNNING:
            return False
        if self.stopped is not None and self.stopped.group == group:
            return False
        live = self._current(group)
        return live.commits > 0 and now_unix - live.last_commit < 10.0

    def up_groups(self) -> list[int]:
        now = time.time()
        return [g for g in range(self.cfg.groups) if self._up(g, now)]

    def _heal_in_progress(self) -> tuple[int, dict[str, Any]] | None:
        """(receiver group, its recv_start record) of a transfer running now, if any."""
        for g in range(self.cfg.groups):
            start = self._current(g).open_recv
            if start is not None and self.launcher.status(g).state == GroupState.RUNNING \
                    and time.time() - float(start["time"]) < self.cfg.timeout:
                return g, start
        return None

    def _group_at(self, address: str) -> int | None:
        """The running group whose checkpoint server is at `address` (from its "ready" record)."""
        for g in range(self.cfg.groups):
            if self._current(g).address == address:
                return g
        return None

    def _record(self, kind: str, target: str, detail: str = "", **where: Any) -> None:
        fault = Fault(len(self.faults) + 1, kind, time.time(), target, detail, **where)
        self.faults.append(fault)
        self._pause_faults()
        self.say(f"fault {fault.index}/{self.cfg.faults} [bold]{kind}[/bold] {target} {detail}".rstrip())

    def _pause_faults(self) -> None:
        """The next fault waits for progress and a seeded pause from now."""
        self.progress_mark = self.max_step()
        self.next_fault_at = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.cfg.interval

    def up_to_date(self) -> list[int]:
        """Up groups at the highest step any up group has logged: the holders of the latest state."""
        up = self.up_groups()
        top = max((self._current(g).last_step for g in up), default=0)
        return [g for g in up if self._current(g).last_step >= top]

    def _victim(self) -> int | None:
        """A group to kill or stop such that min_replicas up-to-date groups remain: the latest state
        always survives (losing every copy of it is not a fault the system can mask) and training goes on."""
        holders = self.up_to_date()
        if len(holders) - 1 < self.cfg.min_replicas:
            return None
        return self.rng.choice(holders)

    def _kill(self, group: int, kind: str, detail: str = "", **where: Any) -> None:
        step = self._current(group).last_step
        incarnation = self.launcher.status(group).incarnation
        self.launcher.kill_group(group, f"chaos {kind}")
        self._record(kind, f"group {group}", f"(at step {step}) {detail}".strip(), group=group,
                     incarnation=incarnation, **where)

    def _hang(self, group: int) -> None:
        pids = self.launcher.status(group).pids
        hang_s = self.rng.uniform(1.2, 2.0) * max(self.cfg.timeout, self.cfg.heartbeat_timeout_ms / 1000.0)
        _send(os.killpg, pids, signal.SIGSTOP)  # the launcher holds these unreaped: the ids are still its children's
        self.stopped = Stopped(group, pids, time.monotonic() + hang_s)
        self._record("hang", f"group {group}", f"SIGSTOP for {hang_s:.1f}s", group=group,
                     incarnation=self.launcher.status(group).incarnation)

    def _resume(self) -> None:
        stopped, self.stopped = self.stopped, None
        assert stopped is not None
        if self.launcher.status(stopped.group).pids == stopped.pids:
            _send(os.killpg, stopped.pids, signal.SIGCONT)
        self.say(f"group {stopped.group} resumed (SIGCONT)")

    def _restart_lighthouse(self) -> None:
        pause = self.rng.uniform(0.2, 2.0)
        self.lighthouse.kill()
        self.lighthouse_back_at = time.monotonic() + pause
        self._record("lighthouse", f"lighthouse {self.lighthouse.address}", f"down for {pause:.1f}s")

    def _fire_heal_fault(self) -> None:
        """An armed heal fault: kill the receiver or the source of a transfer in progress, if any."""
        assert self.armed is not None
        kind, armed_at = self.armed
        healing = self._heal_in_progress()
        if healing is None:
            if time.monotonic() - armed_at > self.cfg.heal_wait:
                self.skipped[kind] += 1
                self.armed = None
                seen = f" (the last heal seen: {self.heal_miss})" if self.heal_miss else ""
                self.say(f"no heal to fault within {self.cfg.heal_wait:.0f}s: {kind} skipped{seen}")
                return
            recovering = [g for g in range(self.cfg.groups) if g not in self.up_groups()]
            # the provoking kill leaves the heal fault its own slot of the budget: a kill that took the last
            # one would end the faults phase, and with it this armed fault, before the heal it provoked
            room = self.cfg.faults - len(self.faults) >= HEAL_FAULT_SLOTS
            now = time.monotonic()
            due = provoke_due(now, self.provoked_at, self.cfg.heal_wait) and now >= self.next_fault_at
            victim = self._victim() if room and due and not recovering else None
            if victim is not None:
                self.provoked_at = now
                self._kill(victim, "kill", "to provoke a heal")
            return
        receiver, start = healing
        where = {"receiver": (receiver, self.launcher.status(receiver).incarnation), "step": start.get("step")}
        if kind == "kill_heal_receiver":
            self.armed = None
            self._kill(receiver, kind, f"receiving step {start.get('step')} from {start.get('source')}", **where)
            return
        source = self._group_at(str(start.get("source")))
        holders = self.up_to_date()
        if source is None or source == receiver or source not in holders or len(holders) < 2:
            self.heal_miss = (f"group {receiver} receiving step {start.get('step')} from {start.get('source')} "
                              f"(group {source}), up-to-date groups {holders}")
            return  # only while another group still holds the latest state
        self.armed = None
        self._kill(source, kind, f"sending step {start.get('step')} to group {receiver}", **where)

    def _due(self) -> None:
        """End the faults whose time is up: resume a stopped group, bring the lighthouse back, lift a
        network fault."""
        if self.stopped is not None and time.monotonic() >= self.stopped.resume_at:
            self._resume()
        if self.network is not None and self.net_fault is not None:
            fault, end = self.net_fault, time.time()
            if self.network.due(time.monotonic()) is not None:
                fault.end, self.net_fault = end, None
                self._pause_faults()  # as from any other fault's start
                self.say(f"{fault.kind} {fault.target} lifted after {end - fault.time:.1f}s")
        if self.lighthouse_back_at is not None and time.monotonic() >= self.lighthouse_back_at:
            self.lighthouse.start()
            self.lighthouse_back_at = None
            self.say(f"lighthouse restarted on {self.lighthouse.address}")

    def _inject(self) -> None:
        """Take the next fault kind from the bag and inject it (or arm it) when the schedule allows."""
        if len(self.faults) >= self.cfg.faults:
            return
        if self.armed is not None:
            self._fire_heal_fault()
            return
        busy = self.stopped is not None or self.lighthouse_back_at is not None or self.net_fault is not None
        if busy or time.monotonic() < self.next_fault_at or self.max_step() < self.progress_mark + \
                self.cfg.min_progress_steps:
            return
        if not self.bag:  # every kind once per round, in a seeded random order (or as given: ordered)
            self.bag = list(self.cfg.kinds)
            if not self.cfg.ordered:
                self.rng.shuffle(self.bag)
        kind = draw_kind(self.bag, self.cfg.faults - len(self.faults))
        if kind in HEAL_KINDS:
            self.bag.pop(0)
            self.armed, self.heal_miss, self.provoked_at = (kind, time.monotonic()), "", None
            return
        if kind == "lighthouse":
            if len(self.up_groups()) >= self.cfg.min_replicas:
                self.bag.pop(0)
                self._restart_lighthouse()
            return
        if kind in NETWORK_KINDS:
            if self._network_fault(kind):
                self.bag.pop(0)
            return
        victim = self._victim()
        if victim is None:
            return
        self.bag.pop(0)
        if kind == "kill":
            self._kill(victim, kind)
        else:
            self._hang(victim)

    def _network_fault(self, kind: str) -> bool:
        """Inject a network fault if the schedule allows it now (the same rules as kills: the latest state
        and training survive it); True when injected."""
        assert self.network is not None
        seconds = durations(self.cfg, self.rng)[kind]
        now = time.monotonic()
        if kind == "host_cut":
            victim = self._victim()
            if victim is None:
                return False
            self.network.cut_group(victim, seconds, now)
            self._record(kind, f"group {victim}", f"(at step {self._current(victim).last_step}) link down for "
                         f"{seconds:.1f}s", group=victim, incarnation=self.launcher.status(victim).incarnation)
        elif kind == "partition":
            up = self.up_groups()
            since = max((f.end or f.time for f in self.faults), default=0.0)
            if len(up) < self.cfg.groups or any(self._current(g).last_commit <= since for g in up):
                return False  # every group training (and back since the last fault): the rest make min_replicas
            a, b = sorted(self.rng.sample(up, 2))
            self.network.block(a, b, seconds, now)
            self._record(kind, f"groups {a} and {b}", f"blocked from each other for {seconds:.1f}s", pair=(a, b))
        else:
            if len(self.up_groups()) < self.cfg.min_replicas:
                return False
            name = self.network.cut_lighthouse(seconds, now)
            self._record(kind, f"lighthouse host {name}", f"link down for {seconds:.1f}s")
        self.net_fault = self.faults[-1]
        return True

    def _disarm(self) -> None:
        """No new faults: an armed heal fault that has not fired is skipped."""
        if self.armed is not None:
            self.skipped[self.armed[0]] += 1
            self.say(f"{self.armed[0]} found no heal to fault before the faults phase ended: skipped")
            self.armed = None

    def _converged(self) -> bool:
        """Every group trains, at the same step give or take two."""
        up = self.up_groups()
        if len(up) != self.cfg.groups:
            return False
        steps = [self._current(g).last_step for g in up]
        return max(steps) - min(steps) <= 2

    def _release_stranded(self) -> None:
        """Stop a group (past its target) whose last step failed as its peers committed it and exited: it
        waits for a quorum that cannot form (the run's end, not an engine fault; reported as stranded)."""
        statuses = self.launcher.statuses()
        running = [s for s in statuses if s.state == GroupState.RUNNING]
        if not running or len(running) == len(statuses) or any(s.state not in (GroupState.DONE, GroupState.RUNNING)
                                                               for s in statuses):
            return
        done_at = self.exit_seen.setdefault("others_done", time.monotonic())
        if time.monotonic() - done_at < 2 * self.cfg.timeout + 5:
            return
        for s in running:
            if self._current(s.group).last_step >= (self.target or 0):
                self.launcher.stop_group(s.group, grace=5.0)
                self.stranded.append(s.group)
                self.say(f"group {s.group} stranded below the exit step after its peers exited: stopped")

    def _wedged(self, now_unix: float) -> str | None:
        """A group that runs, free of any fault, yet committed nothing for `stall` seconds while the others
        went on (e.g. waiting alone on a lighthouse the others left): why the run must end now."""
        hit = self.stopped.group if self.stopped is not None else None
        if self.net_fault is not None and self.net_fault.group is not None:
            hit = self.net_fault.group
        for g in range(self.cfg.groups):
            live = self._current(g)
            if self.launcher.status(g).state != GroupState.RUNNING or g == hit or not live.ready_at:
                continue
            since = max([live.last_commit, live.ready_at] + [f.end or f.time for f in self.faults if f.group == g])
            if now_unix - since > self.cfg.stall and self.max_step() > live.last_step:
                return (f"wedged: group {g} (incarnation {self.launcher.status(g).incarnation}) committed nothing for "
                        f"{now_unix - since:.0f}s, last at step {live.last_step}, while the others went on to step "
                        f"{self.max_step()}; its log (with its stacks) is in {os.path.join(self.cfg.out, 'logs')}")
        return None

    def _dump_stacks(self) -> None:
        """Every worker prints all its threads' stacks to its group log (SIGUSR1, faulthandler)."""
        for status in self.launcher.statuses():
            _send(os.kill, status.pids, signal.SIGUSR1)
        time.sleep(1.0)
        self.say(f"stalled: every worker's stacks are in {os.path.join(self.cfg.out, 'logs')}")

    def _remember_sessions(self) -> None:
        for status in self.launcher.statuses():
            self.sessions.update(status.pids)
        for lighthouse in self.lighthouses:
            self.sessions.update(lighthouse.pids)

    def run(self) -> dict[str, Any]:
        """Run the job under the schedule; returns the summary (also written to OUT/summary.json)."""
        cfg = self.cfg
        deadline = self.started + cfg.duration
        phase = "faults"
        final_deadline: float | None = None
        progress = (0, time.monotonic())  # (highest step, when it was first seen)
        self.say(f"chaos: {cfg.groups} groups, {cfg.faults} faults, seed {cfg.seed}, cell {cfg.cell.name}, "
                 f"min_replicas {cfg.min_replicas}, out {cfg.out}")
        if self.network is not None:
            try:
                self.network.create()  # removes whatever it made when it fails
            except NetnsError as exc:
                self.unexpected.append(f"cannot make the simulated hosts: {exc}")
                return self._verdict()
        try:
            for lighthouse in self.lighthouses:
                lighthouse.start()
            self.launcher.start()
            self.next_fault_at = time.monotonic() + cfg.interval
            while True:
                self.launcher.poll()
                self._remember_sessions()
                self._read_logs()
                now = time.monotonic()
                self._due()
                if phase == "faults":
                    out_of_time = now > self.started + 0.8 * cfg.duration
                    if len(self.faults) >= cfg.faults or out_of_time:
                        self._disarm()
                        phase = "converge"
                        self.say(f"{len(self.faults)} faults injected; letting the job converge")
                    else:
                        self._inject()
                quiet = self.stopped is None and self.lighthouse_back_at is None and self.net_fault is None
                if phase == "converge" and quiet and self._converged():
                    self.target = self.max_step() + cfg.quiet_steps
                    phase = "train"
                    self.say(f"converged at step {self.max_step()}; training to step {self.target}")
                if phase == "train" and all(self._current(g).last_step >= (self.target or 0)
                                            for g in range(cfg.groups)):
                    last = self.max_step() + 5  # every group stops after committing this same step
                    with open(os.path.join(cfg.out, EXIT_FILE + ".tmp"), "w") as f:
                        f.write(str(last))
                    os.replace(os.path.join(cfg.out, EXIT_FILE + ".tmp"), os.path.join(cfg.out, EXIT_FILE))
                    phase = "exit"
                    final_deadline = now + cfg.quorum_timeout + 3 * cfg.timeout + 30
                    self.say(f"every group reached step {self.target}; asking them to exit after step {last}")
                if phase == "exit" and self.launcher.finished:
                    break
                if phase == "exit":
                    self._release_stranded()
                if self.max_step() > progress[0]:
                    progress = (self.max_step(), now)
                wedged = self._wedged(time.time()) if phase != "exit" else None
                if wedged is not None:
                    self._dump_stacks()
                    self.unexpected.append(wedged)
                    break
                if now - progress[1] > cfg.stall and phase != "exit":
                    self._dump_stacks()
                    self.unexpected.append(f"no progress: the highest committed step stayed {progress[0]} for "
                                           f"{cfg.stall:.0f}s (phase {phase!r}); see the workers' logs (with their "
                                           f"stacks at the stall) in {cfg.out}")
                    break
                if self.stop.is_set():
                    self.unexpected.append(f"interrupted by a signal in phase {phase!r}")
                    break
                if now > deadline or (final_deadline is not None and now > final_deadline):
                    self.unexpected.append(f"run stopped in phase {phase!r} at its deadline "
                                           f"({cfg.duration:.0f}s, or the exit grace)")
                    break
                time.sleep(POLL_S)
        finally:
            if self.stopped is not None:
                self._resume()
            if self.net_fault is not None:
                self.net_fault.end, self.net_fault = time.time(), None
            self.launcher.shutdown(grace=5.0)
            for lighthouse in self.lighthouses:
                lighthouse.kill()
            self._remember_sessions()
            if self.network is not None:  # every namespace, link and nft rule goes, whatever happened
                self.unexpected += [f"simulated hosts: {problem}" for problem in self.network.close()]
        return self._verdict()

    def _verdict(self) -> dict[str, Any]:
        cfg = self.cfg
        incarnations = read_run(cfg.out)
        problems = check_run(incarnations, min_replicas=cfg.min_replicas,
                             groups=[str(g) for g in range(cfg.groups)], target=self.target)
        problems += check_ledger(incarnations, cfg.dataset_size) if cfg.ledger else []
        network = [dataclasses.asdict(f) for f in self.faults if f.kind in NETWORK_KINDS]
        outcomes = network_fault_outcomes(incarnations, network, graces(cfg))
        problems += [p for o in outcomes for p in o["problems"]]
        problems += self.unexpected
        problems += [f"group {s.group} ended {s.state.value} ({s.detail}), not done"
                     for s in self.launcher.statuses() if s.state != GroupState.DONE and s.group not in self.stranded]
        problems += [f"process {pid} ({what}) is still running after the run" for pid, what in leftovers(self.sessions, cfg.token)]
        summary = summarize(self, incarnations, problems, outcomes)
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def main(argv: list[str]) -> int:
    """`ftl chaos`: exit 0 when every check passed, 1 when one failed, 2 on bad options, 3 when --network
    cannot run here (not root, no `ip netns` or nft)."""
    from rich.console import Console

    opts = build_parser(__doc__).parse_args(argv)
    console = Console(highlight=False)
    if opts.matrix.strip() == "list":
        console.print(matrix_table(), highlight=False, markup=False)
        return 0
    kinds = FAULT_KINDS + (NETWORK_KINDS if opts.network else ()) if opts.kinds is None else \
        tuple(k.strip() for k in opts.kinds.split(",") if k.strip())
    try:
        cfg = ChaosConfig(out=os.path.abspath(opts.out), groups=opts.groups, faults=opts.faults, seed=opts.seed,
                          duration=opts.duration, min_replicas=opts.min_replicas, interval=opts.interval,
                          timeout=opts.timeout, heartbeat_timeout_ms=opts.heartbeat_timeout_ms,
                          transport_delay_ms=opts.transport_delay_ms, transport_drop=opts.transport_drop,
                          kinds=kinds, network=opts.network, spares=opts.spares,
                          quiet_steps=opts.quiet_steps, cells=parse_matrix(opts.matrix), ledger=opts.ledger,
                          token=os.environ.get("FT_TOKEN") or None)
    except ValueError as exc:
        console.print(f"[red]ftl chaos: {exc}[/red]")
        return 2
    if opts.network:
        reason = network_unavailable()
        if reason is not None:
            console.print(f"[yellow]ftl chaos --network: skipped: {reason}[/yellow]")
            return EXIT_SKIPPED

    with StopSignals() as stop:  # Ctrl-C ends the run early, still with a verdict and no process left
        summary = ChaosRun(cfg, console=console, stop=stop.event).run()
    print_summary(console, summary)
    console.print(f"summary: {os.path.join(cfg.out, 'summary.json')}")
    return 0 if summary["ok"] else 1

