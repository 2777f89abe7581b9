"""Chaos: seeded fault schedules against a real job (lighthouse child process, 3 replica groups of
ft_core.tools.chaos_worker under the Launcher), then the checks of ft_core.tools.chaos_checks.

The bounded variant runs in CI (one fault of each kind); the long one (`ftl chaos`, 200 faults) is
marked slow and runs only with FT_RUN_SLOW=1. The rules themselves are table-tested here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ft_core.tools.chaos import FAULT_KINDS, ChaosConfig, ChaosRun
from ft_core.tools.chaos_processes import leftovers
from ft_core.tools.chaos_checks import (Incarnation, LogTail, check_completion, check_digests, check_min_replicas,
                                  check_monotonic, format_steps, heal_fault_outcomes)


def step(n: int, digest: str = "d", participants: int = 2, t: float = 0.0) -> dict:
    return {"kind": "step", "step": n, "digest": f"{digest}{n}", "participants": participants, "time": t}


def quorum(qid: int) -> dict:
    return {"kind": "event", "event": {"type": "quorum", "quorum_id": qid}}


def inc(group: str, number: int, *records: dict) -> Incarnation:
    return Incarnation(group, number, list(records))


# ------------------------------------------------------------------ the rules, as tables

@pytest.mark.parametrize("incarnations, expected", [
    ([inc("0", 0, step(1), step(2)), inc("1", 0, step(1), step(2))], []),
    ([inc("0", 0, step(1), step(2)), inc("1", 0, step(2, "x"))], ["step(s) 2"]),
    ([inc("0", 0, step(1), step(2), step(3)), inc("0", 1, step(2, "x"), step(3, "x"))], ["step(s) 2..3"]),
    ([inc("0", 0, step(5)), inc("1", 3, step(5))], []),  # a restarted group that healed agrees
])
def test_digests_must_agree_for_every_committed_step(incarnations, expected):
    problems = check_digests(incarnations)
    assert len(problems) == len(expected)
    for problem, fragment in zip(problems, expected):
        assert fragment in problem and "divergence" in problem


@pytest.mark.parametrize("records, problem", [
    ([step(1), step(2), step(3)], None),
    ([step(1), step(3), step(2)], "committed step 2 after step 3"),
    ([step(1), step(1)], "committed step 1 after step 1"),
    ([quorum(1), quorum(4), quorum(4), quorum(9)], None),  # a restarted lighthouse continues above
    ([quorum(5), quorum(2)], "quorum id went backward from 5 to 2"),
])
def test_steps_strictly_increase_and_quorum_ids_never_go_back(records, problem):
    problems = check_monotonic([inc("0", 0, *records)])
    assert problems == [] if problem is None else (len(problems) == 1 and problem in problems[0])


@pytest.mark.parametrize("participants, min_replicas, bad", [(2, 2, False), (3, 2, False), (1, 2, True),
                                                             (None, 1, True)])
def test_no_step_commits_below_min_replicas(participants, min_replicas, bad):
    record = step(1)
    record["participants"] = participants
    assert bool(check_min_replicas([inc("0", 0, record)], min_replicas)) is bad


@pytest.mark.parametrize("steps_by_group, target, missing", [
    ({"0": [10], "1": [10], "2": [12]}, 10, []),
    ({"0": [10], "1": [9], "2": [12]}, 10, ["group 1"]),
    ({"0": [10], "1": [], "2": [12]}, 10, ["group 1"]),
    ({"0": [10], "1": [10], "2": [10]}, None, ["never reached"]),
])
def test_training_completes_when_every_group_reaches_the_target(steps_by_group, target, missing):
    incs = [inc(g, 0, *[step(n) for n in steps]) for g, steps in steps_by_group.items()]
    problems = check_completion(incs, steps_by_group, target)
    assert len(problems) == len(missing)
    for problem, fragment in zip(problems, missing):
        assert fragment in problem


def test_format_steps_and_heal_outcomes():
    assert format_steps([9, 3, 4, 5]) == "3..5, 9"
    receiver = inc("1", 2, {"kind": "recv_start", "step": 7, "time": 10.0})
    healed = inc("2", 1, {"kind": "recv_start", "step": 7, "time": 10.0},
                 {"kind": "recv_failed", "step": 7, "time": 10.5})
    faults = [{"kind": "kill_heal_receiver", "receiver": (1, 2), "step": 7, "time": 10.1},
              {"kind": "kill_heal_source", "receiver": (2, 1), "step": 7, "time": 10.2}]
    assert heal_fault_outcomes(faults, [receiver, healed]) == {"kill_heal_receiver": {"mid_transfer": 1},
                                                              "kill_heal_source": {"transfer_failed": 1}}


def test_log_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "g0.i0.jsonl"
    tail = LogTail(str(path))
    assert tail.read() == []
    path.write_bytes(b'{"kind": "step", "step": 1}\n{"kind": "st')
    assert tail.read() == [{"kind": "step", "step": 1}]
    with open(path, "ab") as f:
        f.write(b'ep", "step": 2}\n')
    assert tail.read() == [{"kind": "step", "step": 2}]


def test_leftover_sweep_finds_a_process_of_the_runs_sessions(processes):
    proc = processes.python("-c", "import time; time.sleep(60)")  # its own session, id = its pid
    assert (proc.pid, "python") in [(pid, name[:6]) for pid, name in leftovers({proc.pid})]
    proc.kill()
    proc.wait(timeout=10)
    assert leftovers({proc.pid}) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"groups": 2}, "--groups must be >= 3"),
    ({"min_replicas": 3}, "--min-replicas"),
    ({"kinds": ("kill", "meteor")}, "unknown fault kinds ['meteor']"),
    ({"faults": -1}, "--faults"),
])
def test_bad_chaos_settings_are_refused_with_the_fix(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ChaosConfig(out=str(tmp_path), **kwargs)


# ------------------------------------------------------------------ real runs

def bounded_config(out: str) -> ChaosConfig:
    """Every kind of fault on 3 groups, tight timeouts: about a minute on two busy cores.

    8 faults: the first round of 5 kinds plus up to one kill per heal fault injected to provoke its heal.
    """
    return ChaosConfig(out=out, groups=3, faults=len(FAULT_KINDS) + 3, seed=3, duration=230.0, min_replicas=2,
                       timeout=3.0, quorum_timeout=10.0, heartbeat_timeout_ms=2000, join_timeout_ms=1000,
                       interval=1.0, min_progress_steps=3, transport_delay_ms=300.0, transport_drop=0.1,
                       quiet_steps=10, heal_wait=60.0, stall=90.0)


@pytest.mark.timeout(290)
def test_bounded_chaos_run_keeps_every_promise(tmp_path):
    summary = ChaosRun(bounded_config(str(tmp_path))).run()
    report = json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1)[:6000]
    assert summary["ok"], report
    assert summary["faults_injected"] == len(FAULT_KINDS) + 3, report
    assert set(summary["faults_by_kind"]) == set(FAULT_KINDS), report
    assert summary["lighthouse_starts"] >= 2, report
    assert summary["transfers"]["heals_loaded"] >= 1, report
    assert summary["max_step"] >= summary["target_step"] > 0, report


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
@pytest.mark.skipif(os.environ.get("FT_RUN_SLOW") != "1", reason="long chaos run: set FT_RUN_SLOW=1")
def test_long_chaos_run_of_200_faults(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ft_core", "chaos", "--groups", "3", "--faults", "200",
                           "--seed", "1", "--out", str(out)], capture_output=True, text=True, timeout=4 * 3600)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-5000:]
    assert summary["faults_injected"] >= 200
