"""`ftl demo`: the whole story on one machine. Three replica groups train a small language model on
CPU, one of them is SIGKILLed every ~10 s, it restarts, heals from a live peer and trains on; at the
end every group holds bit-identical weights, and OUT/report.png shows it.

The driver runs the launcher in-process and follows the groups through the JSONL files they write
(ft_lightning/demo/train.py); it never touches their training.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ft_core.tools.launch_command import (
    FaultInjector,
    GroupState,
    Launcher,
    LaunchEvent,
    StopSignals,
    start_lighthouse,
    status_url,
)
from ft_lightning.demo.display import DemoView, GroupRow, LiveDisplay
from ft_lightning.demo.report import (
    GroupSeries,
    build_report,
    failure_outcomes,
    is_recovery_heal,
    load_series,
    parse_lines,
    step_times,
    write_report,
)

STARTUP_TIMEOUT_S = 240.0  # first commit; three cold Lightning imports on two busy cores take a while
CONVERGE_TIMEOUT_S = 60.0  # after time is up: wait this long for every group to be training again
FINISH_TIMEOUT_S = 60.0  # after the stop step is set: wait this long for every group to exit
CRASH_LOOP = 3  # a group that dies this many times in a row without training (not killed by us) aborts the demo


STALL_S = 2.5  # a training group that has not committed for this long is shown as waiting


def group_state(launch_state: GroupState, series: GroupSeries, incarnation: int, now: float | None = None) -> str:
    """What the table calls a group: starting / training / waiting / healing / dead / restarting / done / lost.

    `waiting`: it trained in this incarnation but has not committed for STALL_S seconds (at `now`,
    unix time), e.g. while the survivors of a failure agree on a new quorum.
    """
    if launch_state == GroupState.RESTARTING:
        return "dead"
    if launch_state != GroupState.RUNNING:
        return {GroupState.PENDING: "starting"}.get(launch_state, launch_state.value)
    if series.incarnation != incarnation or (series.last_quorum is None and not series.trained_since_start):
        return "starting" if incarnation == 0 else "restarting"
    if series.healing:
        return "healing"
    if not series.trained_since_start:
        return "starting" if incarnation == 0 else "restarting"
    if now is not None and series.time and now - series.time[-1] > STALL_S:
        return "waiting"
    return "training"


def stop_margin(steps: Sequence[tuple[int, float]], now: float, window_s: float = 5.0) -> int:
    """How many steps ahead to put the common stop step: ~2 s of progress, at least 5 steps.

    Every group reads the stop file each step, so it only has to be ahead of the fastest one.
    """
    recent = [s for s, t in steps if t >= now - window_s]
    rate = (len(recent) / window_s) if recent else 0.0
    return max(5, math.ceil(rate * 2.0))


class JsonlTail:
    """Reads the records appended to a JSONL file since the last call (whole lines only)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.partial = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data.decode("utf-8", "replace")).split("\n")
        self.partial = lines.pop()
        return parse_lines(lines)


class DemoRun:
    """The demo's state machine: starting -> training (with failures) -> converging -> finishing -> over."""

    def __init__(self, args: argparse.Namespace, launcher: Launcher, display: LiveDisplay | None,
                 groups_dir: str, stop_file: str) -> None:
        self.args = args
        self.launcher = launcher
        self.display = display
        self.stop_file = stop_file
        self.series = {g: GroupSeries(g) for g in range(args.groups)}
        self.tails = {g: JsonlTail(os.path.join(groups_dir, f"{g}.jsonl")) for g in range(args.groups)}
        self.injector = (FaultInjector(args.kill_every, seed=args.seed, eligible=self._trainers)
                         if args.kill_every and args.kill_every > 0 else None)
        self.kills: list[dict[str, Any]] = []
        self.t0 = time.time()
        self.phase = "starting"
        self.train_start: float | None = None
        self.warmup_s = 0.0
        self.deadline = 0.0  # monotonic; meaning depends on the phase
        self.target_step: int | None = None
        self.failure: str | None = None
        self._crash_streak = {g: 0 for g in range(args.groups)}
        self._start_mono = time.monotonic()

    # ------------------------------------------------------------------ helpers

    def note(self, text: str, style: str = "") -> None:
        line = f"{time.time() - self.t0:6.1f}s  {text}"
        if self.display is not None:
            self.display.note(line, style)
        else:
            print(line, flush=True)

    def _trainers(self, launcher: Launcher) -> list[int]:
        """Groups worth killing: training now, with at least one other group training to carry on."""
        now = time.time()
        training = [g for g in launcher.running_groups()
                    if group_state(GroupState.RUNNING, self.series[g], launcher.status(g).incarnation, now)
                    == "training"]
        return training if len(training) >= 2 else []

    def on_event(self, event: LaunchEvent) -> None:
        """Launcher events become lines above the table."""
        if event.kind == "killed":
            self.note(f"group {event.group}: {event.detail}", "bold red")
        elif event.kind == "died":
            self.note(f"group {event.group} died ({event.detail})", "red")
            if not self.series[event.group].trained_since_start:
                self._crash_streak[event.group] += 1
        elif event.kind == "started" and event.incarnation > 0:
            self.note(f"group {event.group} restarted (incarnation {event.incarnation})", "yellow")
        elif event.kind == "lost":
            self.note(f"group {event.group} lost: {event.detail}", "bold red")

    def _ingest(self) -> None:
        for g, tail in self.tails.items():
            for rec in tail.read():
                s = self.series[g]
                s.add(rec)
                if rec.get("event") == "heal":
                    secs = rec.get("seconds")
                    took = f" in {secs:.2f}s" if isinstance(secs, (int, float)) else ""
                    if is_recovery_heal(s.heals[-1]):
                        self.note(f"group {g} healed from a live peer: state of step {rec.get('step')} "
                                  f"loaded{took}", "cyan")
                    elif rec.get("step"):
                        self.note(f"group {g} started late and caught up with its peers at step "
                                  f"{rec.get('step')}{took}", "dim")
                    else:
                        self.note(f"group {g} copied the initial weights of a peer{took}", "dim")
                elif rec.get("event") == "commit" and rec.get("committed"):
                    self._crash_streak[g] = 0

    def view(self) -> DemoView:
        outcomes = failure_outcomes(self.series, self.kills)
        rows = []
        now = time.time()
        for g, s in self.series.items():
            st = self.launcher.status(g)
            mine = [o for o in outcomes if o["group"] == g]
            state = group_state(st.state, s, st.incarnation, now)
            if state == "waiting" and self.target_step is not None and (s.last_step or 0) >= self.target_step:
                state = "stopping"
            current = state not in ("dead", "restarting", "starting", "lost")  # old quorum values mean nothing now
            rows.append(GroupRow(
                group=g, state=state, step=s.last_step,
                loss=s.last_loss,
                quorum_id=s.quorum_id[-1] if s.quorum_id and current else None,
                participants=s.num_participants[-1] if s.num_participants and current else None,
                restarts=st.incarnation, failures=len(mine), survived=sum(1 for o in mine if o["survived"])))
        steps = [s.last_step for s in self.series.values() if s.last_step is not None]
        phase = self.phase if self.target_step is None else f"{self.phase} (stop at step {self.target_step})"
        return DemoView(elapsed_s=time.time() - self.t0, phase=phase, kills=len(self.kills),
                        steps_committed=max(steps, default=0),
                        heals=sum(1 for s in self.series.values() for h in s.heals if is_recovery_heal(h)), rows=rows)

    # ------------------------------------------------------------------ the state machine

    def tick(self) -> bool:
        """Advance one step; True when the run is over."""
        self._ingest()
        now = time.monotonic()
        for g, streak in self._crash_streak.items():
            if streak >= CRASH_LOOP:
                return self._fail(f"group {g} keeps crashing before it trains; see {self.args.log_dir}/group{g}.log")
        if self.launcher.finished and self.phase != "finishing":
            return self._fail("every group ended before the demo asked them to")
        if self.phase == "starting":
            if any(s.step for s in self.series.values()):
                self.train_start = time.time()
                self.warmup_s = now - self._start_mono
                self.phase = "training"
                self.deadline = now + self.args.duration
                self.note(f"training started after {self.warmup_s:.1f}s of start-up; {self.args.duration:g}s to go")
                if self.injector is not None:
                    self.injector.arm(now)
            elif now - self._start_mono > STARTUP_TIMEOUT_S:
                return self._fail(f"no group committed a step in {STARTUP_TIMEOUT_S:.0f}s; "
                                  f"see the logs in {self.args.log_dir}")
        elif self.phase == "training":
            if self.injector is not None:
                self.injector.stop_at = self.deadline - self._kill_tail()
                record = self.injector.tick(self.launcher, now)
                if record is not None:
                    self.kills.append({"index": record.index, "group": record.group,
                                       "incarnation": record.incarnation, "time": record.time})
            if now >= self.deadline:
                self.phase = "converging"
                self.deadline = now + CONVERGE_TIMEOUT_S
                self.note("time is up: waiting for every group to be training, then stopping all at one step")
        elif self.phase == "converging":
            states = [r.state for r in self.view().rows]
            if all(s in ("training", "waiting") for s in states) or now >= self.deadline:
                if now >= self.deadline:
                    self.note(f"not every group came back within {CONVERGE_TIMEOUT_S:.0f}s: {states}", "red")
                self._write_stop_step()
                self.phase = "finishing"
                self.deadline = now + FINISH_TIMEOUT_S
        elif self.phase == "finishing":
            if self.launcher.finished:
                self.phase = "over"
                return True
            if now >= self.deadline:
                return self._fail(f"groups still running {FINISH_TIMEOUT_S:.0f}s after the stop step; ending them")
        if self.display is not None:
            self.display.update(self.view())
        return False

    def _kill_tail(self) -> float:
        """No failure in the last seconds of training: the last victim needs them to come back and heal.

        As long as a restart has taken so far (twice the start-up before the first one), within
        [5 s, duration / 3].
        """
        back = [o["recovery_s"] for o in failure_outcomes(self.series, self.kills) if o["recovery_s"] is not None]
        estimate = max(back) if back else 2 * self.warmup_s
        return min(max(estimate, 5.0), self.args.duration / 3)

    def _write_stop_step(self) -> None:
        steps = step_times(self.series)
        current = steps[-1][0] if steps else 0
        self.target_step = current + stop_margin(steps, time.time())
        tmp = self.stop_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(self.target_step))
        os.replace(tmp, self.stop_file)  # readers see the whole number or nothing
        self.note(f"every group stops at committed step {self.target_step}")

    def _fail(self, why: str) -> bool:
        self.failure = why
        self.note(why, "bold red")
        self.phase = "over"
        return True


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ftl demo", description="Train with 3 replica groups on CPU while one is "
                                "killed every ~10 s; watch them heal; get a report with a plot.")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of training, start-up excluded (60)")
    p.add_argument("--groups", type=int, default=3, help="replica groups (3)")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between failures, 0 for none (10)")
    p.add_argument("--out", default="ftl-demo", help="report folder (./ftl-demo)")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure schedule and the data (0)")
    args = p.parse_args(list(argv))
    if args.groups < 2:
        p.error("--groups must be at least 2: a failure needs a survivor to heal from")
    if args.duration <= 0 or args.kill_every < 0:
        p.error("--duration must be > 0 and --kill-every >= 0")
    return args


def _prepare_out(out: str) -> tuple[str, str, str]:
    groups_dir, logs_dir = os.path.join(out, "groups"), os.path.join(out, "logs")
    for d in (groups_dir, logs_dir):
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):  # a previous run's files would mix into this one's series
            if name.endswith((".jsonl", ".log")):
                os.remove(os.path.join(d, name))
    for name in ("stop_step", "report.json", "report.png"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    return groups_dir, logs_dir, os.path.join(out, "stop_step")


def main(argv: list[str]) -> int:
    """`ftl demo`: exit 0 when every failure was survived and every group ended with identical weights."""
    from rich.console import Console
    from rich.table import Table

    stop = StopSignals()
    console = Console(highlight=False)
    lighthouse = None
    try:
        args = parse_args(argv)
        out = os.path.abspath(args.out)
        groups_dir, logs_dir, stop_file = _prepare_out(out)
        args.log_dir = logs_dir
        lighthouse = start_lighthouse(min_replicas=1, token=os.environ.get("FT_TOKEN") or None, join_timeout_ms=1000)
        console.print(f"[bold]ftl demo[/]: {args.groups} replica groups train a character-level language model on "
                      f"Python's own docs for {args.duration:g}s; a group is SIGKILLed every ~{args.kill_every:g}s.")
        console.print(f"lighthouse {lighthouse.address()}  status page {status_url(lighthouse)}  "
                      f"logs {logs_dir}")
        command = [sys.executable, "-m", "ft_lightning.demo.train", "--events", groups_dir,
                   "--stop-file", stop_file, "--seed", str(args.seed)]
        launcher = Launcher(command, args.groups, lighthouse=lighthouse.address(),
                            token=os.environ.get("FT_TOKEN") or None, restart_delay=1.0, log_dir=logs_dir)
        display = LiveDisplay(console)
        run = DemoRun(args, launcher, display, groups_dir, stop_file)
        launcher.on_event = run.on_event
        interrupted = False
        with launcher, display:
            launcher.start()
            display.start(run.view())
            while True:
                launcher.poll()
                if run.tick():
                    break
                if stop.event.wait(0.25):
                    interrupted = True
                    run.note("interrupted: ending every group", "yellow")
                    break
            display.update(run.view())
            display.stop()
            console.print()
            launcher.shutdown(grace=0.0 if interrupted else None)
        series = load_series(groups_dir, args.groups)  # from the files, start to end
        report = build_report(series, run.kills, started_at=run.t0, duration_s=args.duration,
                              kill_every=args.kill_every or None, seed=args.seed,
                              ok_launch=launcher.succeeded and run.failure is None and not interrupted)
        json_path, png_path = write_report(report, out)
        _summary(console, Table, report, series, json_path, png_path, interrupted)
        if interrupted:
            return stop.exit_code
        return 0 if report["success"] else 1
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        stop.restore()


def _summary(console: Any, table_cls: Any, report: dict[str, Any], series: dict[int, GroupSeries],
             json_path: str, png_path: str, interrupted: bool) -> None:
    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}s"

    t = table_cls(title="ftl demo: summary", show_header=False)
    t.add_row("steps committed", str(report["steps_committed"]))
    t.add_row("failures injected", str(report["failures_injected"]))
    injected = report["failures_injected"]
    t.add_row("failures survived", f"{report['failures_survived']} of {injected}" if injected else "-")
    t.add_row("heals", str(report["heals"]))
    heal, back = report["heal_time_s"], report["recovery_time_s"]
    t.add_row("time to heal (p50 / max)", f"{secs(heal['p50'])} / {secs(heal['max'])}")
    t.add_row("kill to training again (p50 / max)", f"{secs(back['p50'])} / {secs(back['max'])}")
    t.add_row("longest commit gap", secs(report["longest_commit_gap_s"]))
    t.add_row("final weights", report["weights"])
    console.print(t)
    for note in report["failure_notes"]:
        console.print(f"[yellow]{note}[/]")
    sample = next((s.end.get("sample") for s in series.values() if s.end and s.end.get("sample")), None)
    if sample:
        console.print("[dim]the model now writes:[/]", repr(sample))
    verdict = ("[yellow]interrupted[/] (partial)" if interrupted
               else "[bold green]success[/]" if report["success"] else "[bold red]failed[/]")
    console.print(f"{verdict}: report {json_path}, plot {png_path}")
