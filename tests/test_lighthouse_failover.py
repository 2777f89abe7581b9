"""Lighthouse failover with real processes: two `ftl lighthouse` processes (active + standby), two
replica groups of ft_core.tools.chaos_worker given both addresses. SIGKILL the active lighthouse: no
committed step is lost, quorum ids never go backward, training resumes within 2x heartbeat timeout."""

from __future__ import annotations

import os
import socket
import time

import pytest
from conftest import child_env

from ft_core.tools.chaos_checks import check_digests, check_monotonic, read_run
from ft_core.tools.launcher import free_port

HEARTBEAT_TIMEOUT_S = 3.0


TOKEN = "failover-secret"


def start_lighthouse(processes, port: int, log) -> object:
    return processes.python("-m", "ft_core", "lighthouse", "--bind", f"127.0.0.1:{port}", "--http-bind", "off",
                            "--min-replicas", "2", "--join-timeout-ms", "1000",
                            "--heartbeat-timeout-ms", str(int(HEARTBEAT_TIMEOUT_S * 1000)),
                            env=child_env(FT_TOKEN=TOKEN), stdout=log, stderr=log)


def wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"lighthouse on port {port} did not listen within {timeout}s")


def steps(out: str) -> dict[str, list[dict]]:
    return {inc.group: inc.steps for inc in read_run(out)}


def wait_for(predicate, timeout: float, what: str, out: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    last = {g: (rows[-1]["step"] if rows else None) for g, rows in steps(out).items()}
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last steps {last}")


@pytest.mark.timeout(180)
def test_killing_the_active_lighthouse_fails_over_to_the_standby(processes, tmp_path):
    out = str(tmp_path)
    ports = [free_port(), free_port()]
    log = open(tmp_path / "lighthouses.log", "wb")
    active = start_lighthouse(processes, ports[0], log)
    start_lighthouse(processes, ports[1], log)
    for port in ports:
        wait_listening(port, 60)
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    workers = []
    for group in range(2):
        env = child_env(FT_LIGHTHOUSE=addresses, REPLICA_GROUP_ID=str(group), FT_RESTART_COUNT="0", FT_TOKEN=TOKEN)
        with open(tmp_path / f"worker{group}.log", "wb") as wlog:
            workers.append(processes.python("-m", "ft_core.tools.chaos_worker", "--out", out, "--min-replicas", "2",
                                            "--timeout", "5", "--quorum-timeout", "30", "--step-sleep", "0.05",
                                            env=env, stdout=wlog, stderr=wlog))
    wait_for(lambda: len(steps(out)) == 2 and all(len(rows) >= 10 for rows in steps(out).values()), 120,
             "both groups to commit 10 steps", out)

    active.kill()  # SIGKILL: no goodbye to anyone
    active.wait(timeout=10)
    killed_at = time.time()
    before = {g: rows[-1]["step"] for g, rows in steps(out).items()}
    wait_for(lambda: all(rows[-1]["step"] >= before[g] + 10 for g, rows in steps(out).items()), 90,
             "both groups to commit 10 more steps through the standby", out)

    with open(os.path.join(out, "exit"), "w") as f:
        f.write(str(max(rows[-1]["step"] for rows in steps(out).values()) + 5))
    for proc in workers:
        assert proc.wait(timeout=60) == 0
    incarnations = read_run(out)
    assert check_digests(incarnations) == []
    assert check_monotonic(incarnations) == []  # steps strictly increase, quorum ids never go back
    for inc in incarnations:
        numbers = [r["step"] for r in inc.steps]
        assert numbers == list(range(1, len(numbers) + 1)), f"group {inc.group} lost or skipped a step: {numbers}"
        resumed = min(r["time"] for r in inc.steps if r["time"] > killed_at)
        last_before = max(r["time"] for r in inc.steps if r["time"] <= killed_at)
        assert resumed - last_before < 2 * HEARTBEAT_TIMEOUT_S, (
            f"group {inc.group}: no commit for {resumed - last_before:.2f}s across the failover "
            f"(bound {2 * HEARTBEAT_TIMEOUT_S}s)")
        ids = inc.quorum_ids()
        assert ids and ids[-1] > ids[0], f"group {inc.group}: the standby did not issue a newer quorum id: {ids}"
