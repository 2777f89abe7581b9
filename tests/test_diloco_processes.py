"""DiLoCo and Streaming DiLoCo across three replica groups as real processes (tests/_diloco_worker.py) on
loopback with Gloo: SIGKILL during inner steps, during a sync (pseudo-gradient allreduce in
flight) and during a heal; each killed group restarts from a fresh model, joins between syncs and
heals; at the end every group holds bitwise-identical global parameters and outer optimizer state."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import pytest
from conftest import child_env

from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_diloco_worker.py")


class Worker:
    def __init__(self, processes: Any, workdir: str, gid: int, lighthouse: str) -> None:
        self.processes, self.workdir, self.gid, self.lighthouse = processes, workdir, gid, lighthouse
        self.incarnation = 0
        self.proc: subprocess.Popen | None = None

    def file(self, kind: str, incarnation: int | None = None) -> str:
        return os.path.join(self.workdir, f"g{self.gid}.i{incarnation or self.incarnation}.{kind}")

    @property
    def kill_file(self) -> str:
        return os.path.join(self.workdir, f"g{self.gid}.kill")

    fragments = 2
    local_sgd = False

    def start(self, arm: str | None = None) -> None:
        self.incarnation += 1
        if os.path.exists(self.kill_file):
            os.remove(self.kill_file)
        if arm:
            self.arm(arm)
        out = open(self.file("out"), "w")
        self.proc = self.processes.python(
            WORKER, "--lighthouse", self.lighthouse, "--replica-id", f"g{self.gid}", "--log", self.file("log"),
            "--final", self.file("final.json"), "--kill-file", self.kill_file,
            "--stop-file", os.path.join(self.workdir, "stop"), "--fragments", str(self.fragments),
            *(["--local-sgd"] if self.local_sgd else []), env=child_env(),
            stdout=out, stderr=subprocess.STDOUT)

    def arm(self, point: str) -> None:
        with open(self.kill_file + ".tmp", "w") as f:
            f.write(point)
        os.replace(self.kill_file + ".tmp", self.kill_file)

    def syncs(self) -> list[dict[str, Any]]:
        try:
            with open(self.file("log")) as f:
                return [json.loads(line) for line in f if line.strip().endswith("}")]
        except FileNotFoundError:
            return []

    def commits(self) -> int:
        return sum(1 for row in self.syncs() if row["committed"])

    def step(self) -> int:
        rows = self.syncs()
        return rows[-1]["step"] if rows else -1

    def output(self) -> str:
        with open(self.file("out")) as f:
            return f.read()

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)


def wait_until(predicate: Any, timeout: float, what: str, workers: list[Worker]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for w in workers:
            code = w.proc.poll() if w.proc else None
            if code not in (None, 0, -9):
                raise AssertionError(f"group {w.gid} exited with {code} waiting for {what}:\n{w.output()[-3000:]}")
        time.sleep(0.05)
    tails = "\n".join(f"--- g{w.gid} ---\n{w.output()[-2000:]}" for w in workers)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def kill_and_check(worker: Worker, point: str, workers: list[Worker]) -> None:
    assert worker.wait_exit(40) == -9, worker.output()[-3000:]
    assert f"SIGKILL during {point}" in worker.output()


def kill_and_rejoin(worker: Worker, point: str, workers: list[Worker]) -> None:
    """SIGKILL `worker` at `point`, restart it, and wait until it healed and synced twice."""
    worker.arm(point)
    kill_and_check(worker, point, workers)
    worker.start()
    wait_until(lambda: worker.commits() >= 2, 40, f"g{worker.gid} to heal and sync", workers)


def stop_all(workers: list[Worker], workdir: str) -> tuple[int, list[dict[str, Any]]]:
    """Every group stops after the sync that reaches 4 steps past the furthest, exits cleanly and ends at that
    step with the same state as the others: (that step, each group's final state)."""
    target = max(w.step() for w in workers) + 4
    with open(os.path.join(workdir, "stop.tmp"), "w") as f:
        f.write(str(target))
    os.replace(os.path.join(workdir, "stop.tmp"), os.path.join(workdir, "stop"))
    finals = []
    for w in workers:
        assert w.wait_exit(40) == 0, w.output()[-3000:]
        with open(w.file("final.json")) as f:
            finals.append(json.load(f))
    assert [f["step"] for f in finals] == [target] * len(workers)
    assert all(f == finals[0] for f in finals[1:])
    return target, finals


@pytest.mark.timeout(110)
@pytest.mark.parametrize("fragments", [2, pytest.param(1, marks=pytest.mark.slow)], ids=["streaming", "plain"])
def test_diloco_survives_sigkills_and_heals_identical(processes, tmp_path, fragments):
    with LighthouseServer(min_replicas=2, join_timeout_ms=1000) as lighthouse:
        workers = [Worker(processes, str(tmp_path), g, lighthouse.address()) for g in range(3)]
        for w in workers:
            w.fragments = fragments
        for w in workers:
            w.start()
        wait_until(lambda: all(w.commits() >= 2 for w in workers), 60, "every group syncing", workers)
        g0, g1, g2 = workers

        # g1 dies between syncs; its next incarnation is killed while healing; the third heals
        g1.arm("inner")
        kill_and_check(g1, "inner", workers)
        g1.start(arm="heal")
        kill_and_check(g1, "heal", workers)
        g1.start()
        wait_until(lambda: g1.commits() >= 2, 40, "g1 to heal and sync", workers)

        # g2 dies with its pseudo-gradient allreduce in flight: that sync does not commit anywhere
        kill_and_rejoin(g2, "sync", workers)
        target, finals = stop_all(workers, str(tmp_path))
    assert sorted(finals[0]["fragments"]) == [f"StreamingDiLoCoFragment_{i}" for i in range(fragments)]
    assert finals[0]["fragments"]["StreamingDiLoCoFragment_0"]["outer_optimizer"], "outer momentum is empty"
    # the survivor (never killed) committed nearly every sync itself (it may heal after a sync that
    # failed only on its side)
    assert sum(row["committed"] for row in g0.syncs()) >= target // 2


@pytest.mark.timeout(110)
@pytest.mark.parametrize("local_sgd", [False, True], ids=["streaming-diloco", "local-sgd"])
def test_a_group_killed_mid_sync_costs_the_survivors_no_sync(processes, tmp_path, local_sgd):
    """3 groups: g2 is SIGKILLed instead of issuing its first reduction of a sync all three take part in
    (DiLoCo's pseudo-gradients, LocalSGD's parameters), while the survivors' reductions of it are in flight.
    Both keep each input they send (`keep_input`), so the survivors redo the reduction without g2 and commit
    that sync: one replayed redo each and no sync left uncommitted. g2 restarts and heals; at the end all
    three hold identical state (DiLoCo: global copies and outer optimizer state; LocalSGD: the model). Until
    2026-12-07 nothing kept the inputs (DiLoCo's local parameters had moved on), so the survivors lost the
    sync unless FT_REDO_COPY=1."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=1000) as lighthouse:
        workers = [Worker(processes, str(tmp_path), g, lighthouse.address()) for g in range(3)]
        for w in workers:
            w.local_sgd = local_sgd
            w.start()
        wait_until(lambda: all(w.commits() >= 2 for w in workers), 60, "every group syncing", workers)
        g0, g1, g2 = workers
        kill_and_rejoin(g2, "reduction", workers)
        stop_all(workers, str(tmp_path))
    for w in (g0, g1):
        out = w.output()
        redos = [json.loads(line[len("redo "):]) for line in out.splitlines() if line.startswith("redo {")]
        assert [r["outcome"] for r in redos] == ["replayed"], out[-3000:]
        assert "not committed" not in out, out[-3000:]
        assert all(row["committed"] for row in w.syncs()), w.syncs()
