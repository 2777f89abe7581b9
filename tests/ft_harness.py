"""Helpers for tests (and benchmarks) that run replica groups of examples/train_ddp.py as processes.

A `Group` is one replica group: one plain process, or one `torchrun --standalone` with several
ranks. Each incarnation (start or restart) writes its own step log (one JSON line per committed
step: step, time, bitwise digest of model + optimizer) and events file; the test reads them to
check identical state, healing and the survivors' commit gaps.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO_ROOT, "examples", "train_ddp.py")


def repo_module(name: str) -> types.ModuleType:
    """A module of this repository outside the installed packages (examples.train_ddp, benchmarks.heal), whatever
    the working directory: pytest puts only tests/ on sys.path, and the children get REPO_ROOT in PYTHONPATH."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    return importlib.import_module(name)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by SIGKILL
                    pass
    return rows


@dataclass
class Group:
    """One replica group of train_ddp.py; `processes` is the conftest fixture that owns the children."""

    processes: Any
    workdir: str
    group_id: int
    num_groups: int
    lighthouse: str
    nproc: int = 1
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    spawned_at: float = 0.0
    spare: Any = None  # a warm spare the next start() becomes (prepare_spare)

    def path(self, kind: str, incarnation: int | None = None, rank: str = "{rank}") -> str:
        inc = self.incarnation if incarnation is None else incarnation
        return os.path.join(self.workdir, f"g{self.group_id}.i{inc}.r{rank}.{kind}")

    @property
    def kill_file(self) -> str:
        return os.path.join(self.workdir, f"g{self.group_id}.kill")

    @property
    def stop_file(self) -> str:
        return os.path.join(self.workdir, "stop")

    def _env(self) -> dict[str, str]:
        from conftest import child_env

        return child_env(FT_LIGHTHOUSE=self.lighthouse, REPLICA_GROUP_ID=str(self.group_id),
                         NUM_REPLICA_GROUPS=str(self.num_groups), **self.env)

    def prepare_spare(self) -> str:
        """Start a warm spare (ft_core.tools.spares) that the next `start()` becomes, as `ftl launch --spares`
        does; returns the file that appears once its imports are done. One-rank groups only."""
        from ft_core.tools.spares import Spare

        assert self.nproc == 1, "warm spares in the harness are for one-rank groups"
        ready = os.path.join(self.workdir, f"g{self.group_id}.spare.ready")
        if os.path.exists(ready):
            os.remove(ready)
        self.spare = Spare([sys.executable, TRAIN], self._env(), ready_file=ready)
        self.processes.handles.append(self.spare.proc)  # ended with the test's other children
        return ready

    def start(self, extra: list[str] | None = None) -> subprocess.Popen:
        """Start (or restart) the group; a fresh incarnation gets fresh logs and no armed kill. A prepared
        spare becomes it (spawned_at is then its activation)."""
        self.incarnation += 1
        if os.path.exists(self.kill_file):
            os.remove(self.kill_file)
        script = [TRAIN, "--step-log", self.path("steps.jsonl"), "--events", self.path("events.jsonl"),
                  "--digest-out", self.path("digest.json"), "--kill-file", self.kill_file,
                  "--stop-file", self.stop_file, *self.args, *(extra or [])]
        env = self._env()
        if self.nproc > 1:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                    "--max-restarts=0", *script]
        else:
            argv = [sys.executable, *script]
        output = os.path.join(self.workdir, f"g{self.group_id}.i{self.incarnation}.out")
        self.spawned_at = time.time()
        if self.spare is not None:
            spare, self.spare = self.spare, None
            self.proc = spare.activate(argv, env, output=output)
            return self.proc
        log = open(output, "w")
        self.proc = self.processes.spawn(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.proc

    def arm_kill(self, point: str) -> None:
        """SIGKILL the group at the next `point` (forward, allreduce, between_chunks, should_commit, send_checkpoint,
        serve_checkpoint: when a healer's request reaches this source)."""
        with open(self.kill_file + ".tmp", "w") as f:
            f.write(point)
        os.replace(self.kill_file + ".tmp", self.kill_file)

    def kill(self) -> None:
        """SIGKILL every process of the group (its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def commits(self, incarnation: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
        rows = read_jsonl(self.path("steps.jsonl", incarnation, str(rank)))
        return [r for r in rows if r.get("event") == "commit"]

    def all_commits(self, rank: int = 0) -> list[list[dict[str, Any]]]:
        return [self.commits(i, rank) for i in range(1, self.incarnation + 1)]

    def events(self, incarnation: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
        return read_jsonl(self.path("events.jsonl", incarnation, str(rank)))

    def last_step(self) -> int:
        rows = self.commits()
        return rows[-1]["step"] if rows else -1

    def digests(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(glob.glob(self.path("digest.json", rank="*"))):
            with open(path) as f:
                out.append(json.load(f))
        return out

    def output(self) -> str:
        path = os.path.join(self.workdir, f"g{self.group_id}.i{self.incarnation}.out")
        with open(path) as f:
            return f.read()


def wait_until(predicate: Any, timeout: float, what: str, groups: list[Group] | None = None) -> None:
    """Poll `predicate` every 50 ms; on timeout fail with `what` and the groups' output tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for g in groups or []:
            if g.proc is not None and g.proc.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"group {g.group_id} exited with {g.proc.returncode} while waiting for "
                                     f"{what}:\n{g.output()[-3000:]}")
        time.sleep(0.05)
    tail = 40_000 if dump_stacks(groups or []) else 2000  # the stacks too
    tails = "\n".join(f"--- group {g.group_id} ---\n{g.output()[-tail:]}" for g in groups or [])
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def dump_stacks(groups: list[Group]) -> bool:
    """Have every live worker of `groups` print all its threads' stacks to its output (SIGUSR1: train_ddp.py's
    faulthandler), so a stall that fails a test says where each group waits; True if any was asked."""
    asked = False
    for g in groups:
        if g.proc is None or g.proc.poll() is not None:
            continue
        # a plain group is the worker itself; torchrun's workers are its children (torchrun dies of SIGUSR1)
        pids = [g.proc.pid] if g.nproc == 1 else child_pids(g.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGUSR1)
                asked = True
            except ProcessLookupError:
                pass
    if asked:
        time.sleep(1.0)
    return asked


def child_pids(pid: int) -> list[int]:
    """The children of live process `pid`, started by any of its threads (Linux /proc; none elsewhere)."""
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass  # that thread ended
    return found


def healthy_members(lighthouse: Any, prefix: str) -> set[str]:
    """The replica ids starting with `prefix` that an in-process LighthouseServer sees heartbeat."""
    return {m["replica_id"] for m in lighthouse.core.status()["members"]
            if m["replica_id"].startswith(prefix) and m.get("healthy")}


def stop_all(groups: list[Group], extra_steps: int = 3, timeout: float = 60) -> int:
    """Ask every group to stop at (highest committed step + extra_steps); wait for clean exits."""
    target = max(g.last_step() for g in groups) + extra_steps
    path = groups[0].stop_file
    with open(path + ".tmp", "w") as f:
        f.write(str(target))
    os.replace(path + ".tmp", path)
    for g in groups:
        code = g.wait_exit(timeout)
        assert code == 0, f"group {g.group_id} exited with {code}:\n{g.output()[-3000:]}"
    return target


def commit_gaps(commits: list[dict[str, Any]]) -> float:
    """Longest time between consecutive commits of one incarnation (0 with fewer than two)."""
    times = [c["time"] for c in commits]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def check_step_digests(groups: list[Group], ranks: int = 1) -> dict[int, str]:
    """Every (group, rank, incarnation) that committed step s has the same digest for s."""
    by_step: dict[int, tuple[str, str]] = {}
    for g in groups:
        for rank in range(ranks):
            for inc, rows in enumerate(g.all_commits(rank), start=1):
                for row in rows:
                    who = f"group {g.group_id} rank {rank} incarnation {inc}"
                    assert "digest" in row, f"{who} logs no digests (it ran with --no-step-digest)"
                    seen = by_step.setdefault(row["step"], (row["digest"], who))
                    assert seen[0] == row["digest"], (f"step {row['step']} differs: {seen[1]} has {seen[0][:12]}, "
                                                      f"{who} has {row['digest'][:12]}")
    return {step: d for step, (d, _) in by_step.items()}
