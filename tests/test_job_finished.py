"""A replica group that comes back after the job finished is refused, never retrains it alone; a group
waiting for a quorum says why it is not forming. Real lighthouse, real manager servers, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
from conftest import REPO_ROOT, child_env, run_calls

from ft_core.control.job_end import (
    FinishedGroup,
    job_finished_error,
    late_group_problem,
)
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.manager_server import ManagerClient, ManagerServer
from ft_core.control.types import QuorumMember
from ft_core.errors import JobFinishedError, QuorumError
from ft_core.tools.status import finished_line

WORKER = os.path.join(REPO_ROOT, "tests", "_job_end_worker.py")
FINISHED = {"replica_group_1:7": FinishedGroup("replica_group_1:7", 20, 9, 0)}


def member(step: int, last_quorum_id: int = 0, rid: str = "replica_group_0:8") -> QuorumMember:
    return QuorumMember(replica_id=rid, step=step, last_quorum_id=last_quorum_id)


@pytest.mark.parametrize("joiner, finished, live, refused", [
    (member(0), FINISHED, {}, True),  # restarted after the end: alone at step 0
    (member(15, last_quorum_id=4), FINISHED, {}, True),  # long gone, far behind, nobody to heal from
    (member(19, last_quorum_id=9), FINISHED, {}, False),  # in the finished group's last quorum: one step late
    (member(20), FINISHED, {}, False),  # resumed from the final checkpoint
    (member(0), FINISHED, {"replica_group_2:1": 20}, False),  # a live group at the end: heals from it
    (member(0), FINISHED, {"replica_group_2:1": 12}, True),  # a live group as far behind is no source
    (member(0), FINISHED, {"replica_group_0:old": 20}, True),  # its own old incarnation is no source
    (member(0), {}, {}, False),  # nothing finished
])
def test_late_group_rule(joiner, finished, live, refused):
    problem = late_group_problem(joiner, finished, live)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"replica group replica_group_0: the job finished at step 20 (group replica_group_1) "
                                  f"while this group was at step {joiner.step}")
        error = job_finished_error(problem)
        assert (error.finished_step, error.step, error.finished_groups) == (20, joiner.step, ("replica_group_1",))
        assert isinstance(error, QuorumError) and "start a new job" in str(error)


@pytest.mark.timeout(60)
def test_every_rank_of_a_late_group_gets_job_finished_error_from_its_quorum():
    with LighthouseServer(min_replicas=2, join_timeout_ms=100, http_bind=None) as lighthouse:
        with LighthouseClient(lighthouse.address()) as client:
            assert client.finished("replica_group_1:1", 20, 5) == [lighthouse.address()]
        assert [f["step"] for f in lighthouse.core.status()["finished"]] == [20]
        with ManagerServer("replica_group_0:2", lighthouse.address(), world_size=2) as server, \
                ManagerClient(server.address()) as rank1:
            results = run_calls([lambda: server.quorum_local(0, 3, "", False, timedelta(seconds=30)),
                                 lambda: rank1.quorum(1, 3, "", False, timedelta(seconds=30))])
    for error, _ in results:  # rank 0 in process, rank 1 over gRPC: the same typed error, not a timeout
        assert isinstance(error, JobFinishedError), error
        assert (error.finished_step, error.step) == (20, 3)
        assert str(error).startswith("replica group replica_group_0: the job finished at step 20")


@pytest.mark.timeout(60)
def test_the_finished_notice_reaches_every_lighthouse_address_a_standby_too():
    with LighthouseServer(http_bind=None) as primary, LighthouseServer(http_bind=None) as standby:
        with LighthouseClient(f"{primary.address()},{standby.address()}") as client:
            assert client.finished("replica_group_1:1", 7, 2) == [primary.address(), standby.address()]
        for lighthouse in (primary, standby):
            assert [(f["replica_id"], f["step"]) for f in lighthouse.core.status()["finished"]] == \
                [("replica_group_1:1", 7)]


def _spawn(processes, lighthouse: LighthouseServer, group: int, *args: str) -> subprocess.Popen:
    return processes.spawn([sys.executable, WORKER, "--group", str(group), *args],
                           env=child_env(FT_LIGHTHOUSE=lighthouse.address()),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(110)
def test_a_group_restarted_after_the_other_finished_exits_with_the_reason_instead_of_retraining(processes):
    # The lighthouse runs on its own (no ftl launch): only the engine can know the job has finished. Group 0
    # is gone (lost earlier, not restarted yet) while group 1 trains to the end; then group 0 comes back.
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        g1 = _spawn(processes, lighthouse, 1, "--steps", "8")
        out1 = g1.communicate(timeout=60)[0]
        assert g1.returncode == 0 and "done at step 8" in out1, out1[-3000:]
        final = 8
        shown = finished_line(lighthouse.core.status())  # what `ftl status` prints under its table
        assert shown.startswith("finished: replica_group_1:") and f" at step {final} " in shown, shown
        restarted = _spawn(processes, lighthouse, 0, "--steps", "8")
        out0 = restarted.communicate(timeout=50)[0]  # its quorum timeout is 60 s: only the refusal ends it sooner
        assert restarted.returncode == 1, out0[-3000:]
        assert f"JobFinishedError: replica group replica_group_0: the job finished at step {final} (group " \
               f"replica_group_1) while this group was at step 0" in out0, out0[-3000:]
        assert "committed step" not in out0 and "done at step" not in out0, out0[-3000:]
        # Resumed from the job's final checkpoint it may go on (here: three more steps of its own).
        resumed = _spawn(processes, lighthouse, 0, "--steps", str(final + 3), "--start-step", str(final))
        out = resumed.communicate(timeout=50)[0]
        assert resumed.returncode == 0 and f"done at step {final + 3}" in out, out[-3000:]


@pytest.mark.timeout(90)
def test_a_group_waiting_alone_for_min_replicas_logs_the_lighthouses_reason_then_times_out_with_it(processes):
    with LighthouseServer(min_replicas=2, join_timeout_ms=500) as lighthouse:
        proc = _spawn(processes, lighthouse, 0, "--steps", "5", "--quorum-timeout", "12")
        out = proc.communicate(timeout=80)[0]
    assert proc.returncode == 1, out[-3000:]
    notes = [line for line in out.splitlines() if "ft_core.control.quorum_wait" in line]
    assert notes, out[-3000:]
    assert "replica group replica_group_0:" in notes[0] and "waiting 5 s for a quorum: New quorum not ready, only " \
           "have 1 participants, need min_replicas 2." in notes[0], notes
    error = out.strip().splitlines()[-1]  # the quorum's timeout, with the lighthouse's last reason
    assert error.startswith("ft_core.errors.FTTimeoutError: ") and "the lighthouse said: New quorum not ready, " \
           "only have 1 participants, need min_replicas 2." in error, out[-3000:]


@pytest.mark.timeout(110)
def test_a_lightning_group_started_after_the_fit_of_the_other_ended_is_refused(processes, tmp_path):
    # The Lightning strategy tells the lighthouse at the end of fit (on_train_end); no ftl launch.
    worker = os.path.join(REPO_ROOT, "tests", "_lightning_parity_worker.py")
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        def fit(group: int) -> subprocess.Popen:
            env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                            FT_RESTART_COUNT="0")
            return processes.spawn([sys.executable, worker, "--out", str(tmp_path), "--events",
                                    str(tmp_path / f"g{group}.jsonl"), "--epochs", "1"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = fit(0)
        out = first.communicate(timeout=80)[0]
        assert first.returncode == 0, out[-3000:]
        [done] = lighthouse.core.status()["finished"]
        late = fit(1)
        out = late.communicate(timeout=80)[0]
    assert late.returncode != 0, out[-3000:]
    assert f"JobFinishedError: replica group replica_group_1: the job finished at step {done['step']} (group " \
           f"replica_group_0) while this group was at step 0" in out, out[-3000:]


def test_the_integrations_console_shows_the_quorum_wait_line():
    from ft_lightning._events import describe

    event = {"type": "quorum_wait", "replica_id": "0:ab", "group_rank": 0, "seconds": 5.02,
             "reason": "New quorum not ready, only have 1 participants, need min_replicas 2."}
    assert describe(event, None) == "waiting 5 s for a quorum: New quorum not ready, only have 1 participants, " \
                                    "need min_replicas 2."
