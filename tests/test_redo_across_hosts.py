"""No lost step for the survivors across machines: the redo tests' three groups of the core API
(tests/_redo_worker.py, tests/test_redo_step.py) each on a simulated host of its own, the lighthouse on a
fourth (network namespaces on a private bridge, tests/netns.py). Every address the groups advertise
comes from the route toward the lighthouse; Gloo, the heartbeat streams and the heal cross the bridge.

- A group SIGKILLed mid-reduction: the survivors redo the step without it (docs/guarantees.md "Redone
  steps"), as on loopback.
- A group killed between DDP's two chunks (slow tier): the first chunk stands, the second is redone.
- A group lost after the step's reductions completed: the survivors keep the values they hold and commit
  the step with 3 participants (the kept-values rule, 19182c5), as on loopback. With BatchNorm, the first
  participant lost before the buffers' sync: the survivors redo only the sync (2 participants).
- Groups of two ranks (each group's store served on its own host): a group lost after the gradients'
  reductions is kept by both ranks of each survivor (the kept-values rule); lost before the loss's
  reduction, with FT_REDO_STEP=1 and copies, each survivor group redoes the step at the vote.
- A host cut while its group's reduction is awaited: nothing resets a connection, the survivors' reduction
  waits until the lighthouse's heartbeat deadline (2 s) expires the cut group and the notice of its loss
  aborts it; they redo the step without it and lose none. The cut group, its host restored, fails that
  step, rejoins, heals and ends identical. Loopback cannot test this: a dead process's sockets are reset.

Skipped where namespaces cannot be made (not root, no `ip netns`). Two variants run only in the slow tier
(FT_RUN_SLOW=1; ~50 s each, to keep the suite within 15 minutes): the mid-reduction kill with copies kept
and the two-rank kept values, each also tested on loopback (tests/test_redo_step.py), and each beside a
variant here that runs in every suite.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from conftest import child_env
from test_push_failures import lighthouse_on_host_0
from test_redo_step import (
    SURVIVORS,
    TWO_CHUNKS,
    VICTIM,
    Job,
    assert_buffers_sync_redone,
    assert_first_chunk_kept_second_redone,
    assert_identical,
    assert_kept_with_the_dead_group_s_contribution,
    assert_no_step_lost,
    assert_reduced_is_the_participants_mean,
    assert_two_ranks_failed_or_redid,
    assert_two_ranks_kept,
    disarm,
    kill_and_restart,
    start_and_arm,
    stop_job,
)


class OnHost:
    """Spawns a group inside its simulated host, with no fault-tolerance variable but those the job sets."""

    def __init__(self, hosts: Any, host: Any, job_env: dict[str, str]) -> None:
        self.hosts, self.host, self.keep = hosts, host, {"FT_LIGHTHOUSE", *job_env}

    def spawn(self, args: list[str], *, env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
        clean = {k: v for k, v in env.items()
                 if k in self.keep or not (k.startswith(("FT_", "TORCHFT_")) or k.endswith("_SOCKET_IFNAME"))}
        return self.hosts.spawn(self.host, args, env=clean, **kwargs)


# A group's TCPStore for its ranks, served inside its host (its loopback is the host's own): the port goes to a file.
SERVE_STORE = """import os, sys, time
from datetime import timedelta
from ft_core.stores import own_store
store = own_store("127.0.0.1", timedelta(seconds=30))
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(store.port))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def store_on_host(hosts: Any, host: Any, workdir: str) -> Any:
    """What serves each new incarnation of a group a store on `host`: g -> its address there."""
    served = [0]

    def serve(g: int) -> str:
        served[0] += 1
        portfile = os.path.join(workdir, f"store.g{g}.{served[0]}.port")
        hosts.python(host, "-c", SERVE_STORE, portfile, env=child_env())
        deadline = time.monotonic() + 30
        while not os.path.exists(portfile):
            assert time.monotonic() < deadline, f"no store served on {host} within 30 s"
            time.sleep(0.05)
        with open(portfile) as f:
            return f"127.0.0.1:{f.read()}"
    return serve


def job_on_hosts(simulated_hosts: Any, tmp_path: Any, env: dict[str, str], extra: list[str] | None = None,
                 ranks: int = 1):
    """(hosts, job): the lighthouse on h0 (heartbeat deadline 2 s), group g (all its ranks) on h(g+1)."""
    hosts = simulated_hosts(4)
    lighthouse = lighthouse_on_host_0(hosts, tmp_path)
    stores = [store_on_host(hosts, hosts[1 + g], str(tmp_path)) for g in range(3)]
    job = Job(None, str(tmp_path), lighthouse, env, extra or [], ranks,
              place=lambda g: OnHost(hosts, hosts[1 + g], env), serve_store=lambda g: stores[g](g))
    return hosts, job


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env", [{}, pytest.param({"FT_REDO_COPY": "1"}, marks=pytest.mark.slow)],
                         ids=["inputs-rebuilt-from-grads", "copies-kept"])
def test_on_simulated_hosts_a_group_killed_mid_reduction_costs_the_survivors_no_step(simulated_hosts, tmp_path,
                                                                                    env) -> None:
    _, job = job_on_hosts(simulated_hosts, tmp_path, env)
    kill_step = kill_and_restart(job, "allreduce", hold=False)
    assert_no_step_lost(job, kill_step)
    assert_reduced_is_the_participants_mean(job, kill_step)
    assert_identical(job)


@pytest.mark.timeout(150)
@pytest.mark.slow  # ~15 s; on loopback in every suite, and the survivors' agreement crosses the bridge below too
def test_on_simulated_hosts_a_group_killed_between_two_ddp_chunks_costs_the_survivors_no_step(simulated_hosts,
                                                                                             tmp_path) -> None:
    """The first chunk, delivered everywhere, stands; the survivors agree across the bridge to redo the second."""
    _, job = job_on_hosts(simulated_hosts, tmp_path, {}, TWO_CHUNKS)
    assert_first_chunk_kept_second_redone(job, kill_and_restart(job, "second-allreduce", hold=False))


@pytest.mark.timeout(150)
def test_on_simulated_hosts_a_group_lost_after_the_step_s_reductions_completed_costs_the_survivors_no_step(
        simulated_hosts, tmp_path) -> None:
    _, job = job_on_hosts(simulated_hosts, tmp_path, {})
    assert_kept_with_the_dead_group_s_contribution(job, kill_and_restart(job, "reduced", hold=False, hold_vote=True))


@pytest.mark.timeout(150)
def test_on_simulated_hosts_the_first_participant_lost_before_the_buffers_sync_costs_the_survivors_no_step(
        simulated_hosts, tmp_path) -> None:
    """BatchNorm, default mode: the group whose buffers everyone takes is lost after the gradients' reductions
    and before the buffers' sync. The survivors agree across the bridge to replay only the sync, in which the
    first survivor now sends its buffers, and commit the step."""
    _, job = job_on_hosts(simulated_hosts, tmp_path, {}, ["--batchnorm", "--sort-first", str(VICTIM)])
    assert_buffers_sync_redone(job, kill_and_restart(job, "reduced", hold=False, hold_vote=True), kept=True)


@pytest.mark.timeout(150)
@pytest.mark.slow  # ~45 s each; on loopback in every suite: tests/test_redo_step.py's groups of two ranks
@pytest.mark.parametrize("env", [{}, {"FT_REDO_STEP": "1", "FT_REDO_COPY": "1"}], ids=["kept", "redo-at-vote"])
def test_on_simulated_hosts_groups_of_two_ranks_keep_or_redo_a_step_whose_peer_was_lost(simulated_hosts, tmp_path,
                                                                                        env) -> None:
    """kept: the loss lands after the gradients' reductions and before the vote; both ranks of each survivor
    keep the values (3 participants). redo-at-vote: it lands before the loop's loss reduction
    (--read-reduced), so the step cannot keep its values; every survivor rank redoes it at the vote."""
    _, job = job_on_hosts(simulated_hosts, tmp_path, env, ["--read-reduced"] if env else [], ranks=2)
    kill_step = kill_and_restart(job, "reduced", hold=False, hold_vote=True)
    if env:
        assert_two_ranks_failed_or_redid(job, kill_step, redo=True)
    else:
        assert_two_ranks_kept(job, kill_step)


@pytest.mark.timeout(150)
def test_a_host_cut_while_the_survivors_await_its_reduction_costs_them_no_step(simulated_hosts, tmp_path) -> None:
    hosts, job = job_on_hosts(simulated_hosts, tmp_path, {})
    victim_host = hosts[1 + VICTIM]
    start_and_arm(job, "stall", hold=False)
    stalled = os.path.join(job.workdir, f"g{VICTIM}.stalled")
    job.wait(lambda: os.path.exists(stalled), 60, "group 2 to stall before its reduction")
    with open(stalled) as f:
        cut_step = int(f.read())
    hosts.cut(victim_host)
    try:
        job.wait(lambda: all(any(r["step"] >= cut_step for r in job.steps(g)) for g in SURVIVORS), 60,
                 "the survivors' vote on the step of the cut")
    finally:
        hosts.restore(victim_host)
        disarm(job)  # group 2 issues its reduction now, into a process group its peers have left
    before = len(job.committed(VICTIM))
    job.wait(lambda: len(job.committed(VICTIM)) >= before + 2, 90, "the cut group rejoining, healing and committing")
    stop_job(job)
    at_cut = [r for r in job.steps(VICTIM) if r["step"] == cut_step]  # then the heal's row: from cut_step on
    assert at_cut and not at_cut[0]["committed"], (at_cut, job.output(VICTIM))
    assert any(e["type"] == "heal" for e in job.events(VICTIM)), f"group 2 rejoined without healing\n" \
                                                                  f"{job.output(VICTIM)}"
    assert_no_step_lost(job, cut_step)
    assert_reduced_is_the_participants_mean(job, cut_step)
    assert_identical(job)
