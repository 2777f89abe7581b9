"""`ftl chaos`: a seeded random fault schedule against a real training job, then a verdict.

The job: a lighthouse child process (`ftl lighthouse`, so it can be killed and restarted on the same
port) and N replica groups of `ft_core.tools.chaos_worker` run by the `Launcher` (restarted when they die).
The schedule (seeded; times depend on the machine) draws faults from:
- kill: SIGKILL a training group at a random point of its step;
- hang: SIGSTOP a group for longer than the timeouts, then SIGCONT it;
- kill_heal_source / kill_heal_receiver: wait for a heal (seen in the workers' logs; a kill is
  injected to provoke one) and SIGKILL its source or its receiver while the checkpoint moves;
- lighthouse: SIGKILL the lighthouse and restart it on the same port after a pause.
Throughout, each group's checkpoint server delays every request and drops some (chaos transport).
The job's configuration is one cell of a matrix chosen by the seed (ft_core.tools.chaos_matrix,
`--matrix list`): ranks per group, quorum mode, init_sync, BatchNorm, two optimizers, MAX/MIN
checks, and faults the workers inject (skipped steps, failed loads and fetches on the healer).
Faults wait until the job has made progress since the last one and leave min_replicas groups up.
After the last fault the job trains `quiet_steps` more steps, the harness writes the exit file and
checks the records (ft_core.tools.chaos_checks) and that no process is left behind.

    ftl chaos --groups 3 --faults 200 --seed 1 --out chaos-run
    ftl chaos --matrix list                  # the cells; --matrix 4,7 limits the seed's choice to them
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass
from typing import Any

from ft_core.tools.chaos_checks import (
    LogTail,
    check_ledger,
    check_run,
    divergent_commits,
    heal_fault_outcomes,
    heal_stats,
    ledger,
    parse_log_name,
    read_run,
    under_replicated_steps,
)
from ft_core.tools.chaos_matrix import (
    FAULT_KINDS,
    HEAL_KINDS,
    ChaosConfig,
    matrix_table,
    parse_matrix,
)

__all__ = ["FAULT_KINDS", "ChaosConfig", "ChaosRun", "main"]
from ft_core.tools.chaos_processes import LighthouseProcess, leftovers
from ft_core.tools.chaos_worker import EXIT_FILE
from ft_core.tools.launcher import GroupState, Launcher, LaunchEvent, StopSignals

logger = logging.getLogger(__name__)

POLL_S = 0.05


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


@dataclass
class _Live:
    """The little the schedule needs to know about one incarnation, updated as its records arrive."""

    last_step: int = 0
    commits: int = 0
    last_commit: float = 0.0
    open_recv: dict[str, Any] | None = None  # a transfer started and not yet finished
    address: str | None = None  # its checkpoint server

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
                self.address = rec.get("address")


@dataclass
class _Stopped:
    group: int
    pids: tuple[int, ...]
    resume_at: float


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
        self.live: dict[tuple[str, int], _Live] = {}
        self.stopped: _Stopped | None = None
        self.exit_seen: dict[str, float] = {}
        self.stranded: list[int] = []  # groups stopped at the end, stranded below the exit step
        self.lighthouse_back_at: float | None = None
        self.armed: tuple[str, float] | None = None  # (kind, armed at) of a heal fault waiting for a heal
        self.bag: list[str] = []  # fault kinds left in this round
        self.target: int | None = None
        self.progress_mark = 0
        self.next_fault_at = 0.0
        self.started = time.monotonic()
        self.lighthouse = LighthouseProcess(cfg, os.path.join(cfg.out, "lighthouse.log"))
        worker = [sys.executable, "-m", "ft_core.tools.chaos_worker", "--out", cfg.out,
                  "--min-replicas", str(cfg.min_replicas), "--timeout", str(cfg.timeout),
                  "--quorum-timeout", str(cfg.quorum_timeout), "--seed", str(cfg.seed),
                  "--step-sleep", str(cfg.step_sleep), "--transport-delay-ms", str(cfg.transport_delay_ms),
                  "--transport-drop", str(cfg.transport_drop), *cfg.cell.worker_args()]
        if cfg.ledger:
            worker += ["--ledger", "--dataset-size", str(cfg.dataset_size)]
        self.launcher = Launcher(worker, cfg.groups, nproc_per_group=cfg.cell.ranks,
                                 lighthouse=self.lighthouse.address, token=cfg.token,
                                 restart=True, restart_delay=cfg.restart_delay, log_dir=os.path.join(cfg.out, "logs"),
                                 on_event=self._on_launch_event, stop_grace=5.0)

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
                self.live.setdefault((where[0], where[2]), _Live()).update(records)

    def _current(self, group: int) -> _Live:
        """What the group's current incarnation has logged so far."""
        return self.live.get((str(group), self.launcher.status(group).incarnation)) or _Live()

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
        self.progress_mark = self.max_step()
        self.next_fault_at = time.monotonic() + self.rng.uniform(0.5, 1.5) * self.cfg.interval
        self.say(f"fault {fault.index}/{self.cfg.faults} [bold]{kind}[/bold] {target} {detail}".rstrip())

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
        for pid in pids:  # the launcher holds these unreaped, so the ids are still its children's
            try:
                os.killpg(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        self.stopped = _Stopped(group, pids, time.monotonic() + hang_s)
        self._record("hang", f"group {group}", f"SIGSTOP for {hang_s:.1f}s", group=group,
                     incarnation=self.launcher.status(group).incarnation)

    def _resume(self) -> None:
        stopped, self.stopped = self.stopped, None
        assert stopped is not None
        if self.launcher.status(stopped.group).pids == stopped.pids:
            for pid in stopped.pids:
                try:
                    os.killpg(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
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
                self.say(f"no heal seen within {self.cfg.heal_wait:.0f}s: {kind} skipped")
                return
            recovering = [g for g in range(self.cfg.groups) if g not in self.up_groups()]
            victim = self._victim() if not recovering and time.monotonic() >= self.next_fault_at else None
            if victim is not None:
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
            return  # only while another group still holds the latest state
        self.armed = None
        self._kill(source, kind, f"sending step {start.get('step')} to group {receiver}", **where)

    def _due(self) -> None:
        """End the faults whose time is up: resume a stopped group, bring the lighthouse back."""
        if self.stopped is not None and time.monotonic() >= self.stopped.resume_at:
            self._resume()
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
        busy = self.stopped is not None or self.lighthouse_back_at is not None
        if busy or time.monotonic() < self.next_fault_at or self.max_step() < self.progress_mark + \
                self.cfg.min_progress_steps:
            return
        if not self.bag:  # every kind once per round, in a seeded random order
            self.bag = list(self.cfg.kinds)
            self.rng.shuffle(self.bag)
        kind = self.bag[0]
        if kind in HEAL_KINDS:
            self.bag.pop(0)
            self.armed = (kind, time.monotonic())
            return
        if kind == "lighthouse":
            if len(self.up_groups()) >= self.cfg.min_replicas:
                self.bag.pop(0)
                self._restart_lighthouse()
            return
        victim = self._victim()
        if victim is None:
            return
        self.bag.pop(0)
        if kind == "kill":
            self._kill(victim, kind)
        else:
            self._hang(victim)

    def _disarm(self) -> None:
        """No new faults: an armed heal fault that has not fired is skipped."""
        if self.armed is not None:
            self.skipped[self.armed[0]] += 1
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

    def _dump_stacks(self) -> None:
        """Every worker prints all its threads' stacks to its group log (SIGUSR1, faulthandler)."""
        for status in self.launcher.statuses():
            for pid in status.pids:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)
        self.say(f"stalled: every worker's stacks are in {os.path.join(self.cfg.out, 'logs')}")

    def _remember_sessions(self) -> None:
        for status in self.launcher.statuses():
            self.sessions.update(status.pids)
        self.sessions.update(self.lighthouse.pids)

    def run(self) -> dict[str, Any]:
        """Run the job under the schedule; returns the summary (also written to OUT/summary.json)."""
        cfg = self.cfg
        deadline = self.started + cfg.duration
        phase = "faults"
        final_deadline: float | None = None
        progress = (0, time.monotonic())  # (highest step, when it was first seen)
        self.say(f"chaos: {cfg.groups} groups, {cfg.faults} faults, seed {cfg.seed}, cell {cfg.cell.name}, "
                 f"min_replicas {cfg.min_replicas}, out {cfg.out}")
        try:
            self.lighthouse.start()
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
                quiet = self.stopped is None and self.lighthouse_back_at is None
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
                elif now - progress[1] > cfg.stall and phase != "exit":
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
            self.launcher.shutdown(grace=5.0)
            self.lighthouse.kill()
            self._remember_sessions()
        return self._verdict()

    def _verdict(self) -> dict[str, Any]:
        cfg = self.cfg
        incarnations = read_run(cfg.out)
        problems = check_run(incarnations, min_replicas=cfg.min_replicas,
                             groups=[str(g) for g in range(cfg.groups)], target=self.target)
        problems += check_ledger(incarnations, cfg.dataset_size) if cfg.ledger else []
        problems += self.unexpected
        problems += [f"group {s.group} ended {s.state.value} ({s.detail}), not done"
                     for s in self.launcher.statuses() if s.state != GroupState.DONE and s.group not in self.stranded]
        problems += [f"process {pid} ({what}) is still running after the run" for pid, what in leftovers(self.sessions)]
        steps = [r for inc in incarnations for r in inc.steps]
        quorum_ids = [q for inc in incarnations for q in inc.quorum_ids()]
        checked = Counter(name for r in steps for name in (r.get("reduce") or {}))
        summary = {
            "ok": not problems,
            "problems": problems,
            "cell": cfg.cell.name,
            "divergent_commits": divergent_commits(incarnations),
            "under_replicated_commits": len(under_replicated_steps(incarnations, cfg.min_replicas)),
            "wrong_reductions": sum(1 for p in problems if p.startswith("wrong reduction")),
            "wedged_groups": sum(1 for p in problems if p.startswith("wedged") or "did not complete: group" in p
                                 or ("ended" in p and "not done" in p)),
            "hangs": sum(1 for p in problems if p.startswith("no progress") or "at its deadline" in p),
            "reductions_checked": dict(checked),
            "ledger": {str(k): v for k, v in ledger(incarnations, cfg.dataset_size).items()} if cfg.ledger else None,
            "faults_injected": len(self.faults),
            "faults_requested": cfg.faults,
            "faults_by_kind": dict(Counter(f.kind for f in self.faults)),
            "faults_skipped": dict(self.skipped),
            "stranded_at_exit": list(self.stranded),
            "target_step": self.target,
            "max_step": max((int(r["step"]) for r in steps), default=0),
            "commits_logged": len(steps),
            "incarnations": len(incarnations),
            "max_quorum_id": max(quorum_ids, default=0),
            "lighthouse_starts": self.lighthouse.starts,
            "transfers": heal_stats(incarnations),
            "heal_faults": heal_fault_outcomes([dataclasses.asdict(f) for f in self.faults], incarnations),
            "seconds": round(time.monotonic() - self.started, 1),
            "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "token"},
            "faults": [dataclasses.asdict(f) for f in self.faults],
        }
        with open(os.path.join(cfg.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def print_summary(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="ftl chaos", show_header=False)
    table.add_row("verdict", "[bold green]PASS[/]" if summary["ok"] else "[bold red]FAIL[/]")
    table.add_row("cell", summary["cell"])
    table.add_row("invariants", f"{summary['divergent_commits']} divergent commits, "
                                f"{summary['under_replicated_commits']} under-replicated commits, {summary['wrong_reductions']} "
                                f"wrong reductions, {summary['wedged_groups']} wedged groups, {summary['hangs']} hangs; "
                                f"reductions checked {json.dumps(summary['reductions_checked'])}")
    table.add_row("faults", f"{summary['faults_injected']} of {summary['faults_requested']} "
                            f"{json.dumps(summary['faults_by_kind'])}")
    if summary["faults_skipped"]:
        table.add_row("skipped", json.dumps(summary["faults_skipped"]))
    t = summary["transfers"]
    table.add_row("heals", f"{t['heals_loaded']} loaded; transfers {t['recv_start']} started, {t['recv_done']} "
                           f"done, {t['recv_failed']} failed; {t['drop']} requests dropped")
    table.add_row("worker faults", f"{t['skip']} skipped steps, {t['load_failed']} failed loads, "
                                   f"{t['recv_injected']} failed fetches (injected)")
    table.add_row("heal faults", json.dumps(summary["heal_faults"]))
    table.add_row("steps", f"max {summary['max_step']} (target {summary['target_step']}), "
                           f"{summary['commits_logged']} commits logged over {summary['incarnations']} processes")
    table.add_row("quorum ids", f"up to {summary['max_quorum_id']}; lighthouse started "
                                f"{summary['lighthouse_starts']} times")
    if summary.get("ledger"):
        rows = summary["ledger"]
        complete = [r for r in rows.values() if r["complete"]]
        table.add_row("data ledger", f"{len(complete)} complete epochs of {len(rows)}: lost "
                                     f"{sum(r['lost'] for r in complete)}, duplicated "
                                     f"{sum(r['duplicated'] for r in rows.values())}, conflicting steps "
                                     f"{sum(r['conflicts'] for r in rows.values())} (per epoch in summary.json)")
    table.add_row("time", f"{summary['seconds']} s")
    console.print(table)
    for problem in summary["problems"][:50]:
        console.print(f"[red]- {problem}[/red]", highlight=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftl chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig(out="")
    p.add_argument("--groups", type=int, default=d.groups, help=f"replica groups (default {d.groups})")
    p.add_argument("--faults", type=int, default=d.faults, help=f"faults to inject (default {d.faults})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the fault schedule")
    p.add_argument("--duration", type=float, default=d.duration,
                   help=f"hard bound of the whole run in seconds (default {d.duration:.0f}); faults stop at 80%%")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas, help="participants needed to commit")
    p.add_argument("--out", default="chaos-run", help="folder for logs and summary.json (default chaos-run)")
    p.add_argument("--interval", type=float, default=d.interval, help="mean seconds between faults")
    p.add_argument("--timeout", type=float, default=d.timeout, help="collective/heal timeout of the workers")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms)
    p.add_argument("--transport-delay-ms", type=float, default=d.transport_delay_ms,
                   help="delay per checkpoint request on every source")
    p.add_argument("--transport-drop", type=float, default=d.transport_drop,
                   help="probability a checkpoint request is dropped")
    p.add_argument("--kinds", default=",".join(d.kinds), help="comma-separated fault kinds to draw from")
    p.add_argument("--quiet-steps", type=int, default=d.quiet_steps, help="steps trained after the last fault")
    p.add_argument("--ledger", action="store_true",
                   help="train on the exactly-once DistributedSampler (ft_core.data) and check its ledger per epoch "
                        "(lost, duplicated samples); default: synthetic batches")
    p.add_argument("--matrix", default="all",
                   help="'list' prints the matrix cells and exits; 'all' (default) or cell indices like 3,5: the "
                        "cells the seed chooses among (seed k runs the k-th of them, modulo their number)")
    return p


def main(argv: list[str]) -> int:
    """`ftl chaos`: exit 0 when every check passed, 1 when one failed, 2 on bad options."""
    from rich.console import Console

    opts = build_parser().parse_args(argv)
    console = Console(highlight=False)
    if opts.matrix.strip() == "list":
        console.print(matrix_table(), highlight=False, markup=False)
        return 0
    try:
        cfg = ChaosConfig(out=os.path.abspath(opts.out), groups=opts.groups, faults=opts.faults, seed=opts.seed,
                          duration=opts.duration, min_replicas=opts.min_replicas, interval=opts.interval,
                          timeout=opts.timeout, heartbeat_timeout_ms=opts.heartbeat_timeout_ms,
                          transport_delay_ms=opts.transport_delay_ms, transport_drop=opts.transport_drop,
                          kinds=tuple(k.strip() for k in opts.kinds.split(",") if k.strip()),
                          quiet_steps=opts.quiet_steps, cells=parse_matrix(opts.matrix), ledger=opts.ledger,
                          token=os.environ.get("FT_TOKEN") or None)
    except ValueError as exc:
        console.print(f"[red]ftl chaos: {exc}[/red]")
        return 2

    with StopSignals() as stop:  # Ctrl-C ends the run early, still with a verdict and no process left
        summary = ChaosRun(cfg, console=console, stop=stop.event).run()
    print_summary(console, summary)
    console.print(f"summary: {os.path.join(cfg.out, 'summary.json')}")
    return 0 if summary["ok"] else 1

