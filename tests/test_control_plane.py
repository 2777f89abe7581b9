"""Control-plane acceptance: real lighthouses and manager servers on loopback, group ranks driven
by client threads, real child processes killed and frozen (issue 2, DESIGN.md sections 4-6, 12)."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import pytest
from conftest import run_calls

from ft_core.errors import FTError, FTTimeoutError, RPCError
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_server import ManagerClient, ManagerServer, QuorumResult
from ft_core.control.manager_server_config import restarted_incarnation

ROUND_TIMEOUT = timedelta(seconds=5)
SLACK_S = 1.0  # scheduling slack on a busy 2-core machine, on top of every bound the spec states


class Group:
    """One replica group: its manager server and a client per group rank."""

    def __init__(self, replica_id: str, lighthouse_addr: str, world_size: int = 2, **kwargs: Any) -> None:
        self.server = ManagerServer(replica_id, lighthouse_addr, store_addr=f"store-of-{replica_id}",
                                    world_size=world_size, **kwargs)
        self.clients = [ManagerClient(self.server.address()) for _ in range(world_size)]

    @property
    def replica_id(self) -> str:
        return self.server.replica_id

    def calls(self, step: int, timeout: timedelta = ROUND_TIMEOUT) -> list[Callable[[], Any]]:
        return [lambda r=r: client.quorum(r, step, f"{self.replica_id}/{r}", False, timeout)
                for r, client in enumerate(self.clients)]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.shutdown()




def quorum_round(groups: list[Group], steps: dict[str, int]) -> dict[str, list[QuorumResult]]:
    """Every rank of every group calls Quorum at once; the plans per group, by group rank."""
    calls, owners = [], []
    for group in groups:
        for call in group.calls(steps[group.replica_id]):
            calls.append(call)
            owners.append(group.replica_id)
    results: dict[str, list[QuorumResult]] = {g.replica_id: [] for g in groups}
    for owner, (value, _) in zip(owners, run_calls(calls)):
        assert isinstance(value, QuorumResult), f"{owner}: {value!r}"
        results[owner].append(value)
    return results


def one_id(results: dict[str, list[QuorumResult]]) -> int:
    ids = {r.quorum_id for plans in results.values() for r in plans}
    assert len(ids) == 1, ids
    return ids.pop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as resources:
        yield resources


def start_groups(stack: ExitStack, lighthouse_addr: str, names: list[str], wait_connected: bool = True,
                 **kwargs: Any) -> list[Group]:
    """Replica groups whose heartbeat streams are open (a group the lighthouse does not hear yet is no member)."""
    groups = [Group(name, lighthouse_addr, **kwargs) for name in names]
    for group in groups:
        stack.callback(group.close)
    for group in groups if wait_connected else ():
        group.server.wait_heartbeat_connected(10)
    return groups


def rounds_until(groups: list[Group], steps: dict[str, int], want: Callable[[list[str]], bool],
                 limit_s: float = 15.0) -> dict[str, list[QuorumResult]]:
    """Each group calls Quorum again as soon as its last call returned (like a training loop) until every
    group holds a quorum whose membership satisfies `want`; a joiner's call waits while the others step."""
    deadline = time.monotonic() + limit_s
    latest: dict[str, list[QuorumResult]] = {}
    pending: dict[str, list[futures.Future]] = {}
    ranks = sum(len(g.clients) for g in groups)
    with futures.ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="test-rank") as pool:
        while True:
            for group in groups:
                rid = group.replica_id
                satisfied = rid in latest and want(latest[rid][0].replica_ids)
                if rid not in pending and not satisfied:
                    pending[rid] = [pool.submit(call) for call in group.calls(steps[rid])]
            if not pending:
                break
            assert time.monotonic() < deadline, f"membership never reached the wanted state; last {latest}"
            futures.wait([f for fs in pending.values() for f in fs], timeout=0.5,
                         return_when=futures.FIRST_COMPLETED)
            for rid, fs in list(pending.items()):
                if all(f.done() for f in fs):
                    del pending[rid]
                    latest[rid] = [f.result() for f in fs]  # a failed call fails the test here
    one_id(latest)
    return latest


@pytest.mark.timeout(60)
def test_three_groups_steady_then_one_dies_and_rejoins_behind_and_heals(stack: ExitStack) -> None:
    heartbeat_timeout_s, tick_s = 1.0, 0.1
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=2, join_timeout_ms=60_000, quorum_tick_ms=100,
                                                      heartbeat_timeout_ms=1000, http_bind=None))
    a, b, c = start_groups(stack, lighthouse.address(), ["group_a", "group_b", "group_c"])
    steps = {"group_a": 0, "group_b": 0, "group_c": 0}
    results = rounds_until([a, b, c], steps, lambda ids: len(ids) == 3)
    steady_id = one_id(results)

    for _ in range(3):  # steady state: steps move, membership does not, so the quorum id stays
        steps = {k: v + 1 for k, v in steps.items()}
        results = quorum_round([a, b, c], steps)
        assert one_id(results) == steady_id
        assert not any(r.heal for plans in results.values() for r in plans)

    c.close()  # its heartbeats stop: the lighthouse must drop it
    gone_at = time.monotonic()
    steps = {"group_a": steps["group_a"] + 1, "group_b": steps["group_b"] + 1}
    results = quorum_round([a, b], steps)
    assert time.monotonic() - gone_at < heartbeat_timeout_s + tick_s + SLACK_S
    assert results["group_a"][0].replica_ids == ["group_a", "group_b"]
    shrunk_id = one_id(results)
    assert shrunk_id > steady_id

    # The restarted group comes back with a fresh name and an old step: it heals from an up-to-date group.
    c2 = start_groups(stack, lighthouse.address(), ["group_c2"])[0]
    max_step = steps["group_a"]
    results = rounds_until([a, b, c2], {**steps, "group_c2": 1}, lambda ids: "group_c2" in ids)
    rejoined_id = one_id(results)
    assert rejoined_id > shrunk_id
    servers = {"group_a": a.server.address(), "group_b": b.server.address()}
    for group_rank, plan in enumerate(results["group_c2"]):
        assert plan.heal and plan.max_step == max_step and plan.max_replica_rank is None
        source = plan.replica_ids[plan.recover_src_replica_rank]
        assert source in servers
        assert plan.recover_src_manager_address == servers[source]
        source_plan = results[source][group_rank]
        assert source_plan.recover_dst_replica_ranks == [plan.replica_rank]
        assert not source_plan.heal
    # Group rank 0 and 1 spread over both up-to-date groups.
    assert {p.recover_src_replica_rank for p in results["group_c2"]} == {0, 1}

    # Healed (now at max_step): same membership, same id, nobody heals.
    steps = {"group_a": max_step + 1, "group_b": max_step + 1, "group_c2": max_step + 1}
    results = quorum_round([a, b, c2], steps)
    assert one_id(results) == rejoined_id
    assert not any(r.heal or r.recover_dst_replica_ranks for plans in results.values() for r in plans)


@pytest.mark.timeout(60)
def test_lighthouse_down_every_rank_fails_within_its_timeout_and_at_once(stack: ExitStack) -> None:
    lighthouse = LighthouseServer(min_replicas=1, join_timeout_ms=100, http_bind=None)
    stack.callback(lighthouse.shutdown)
    group = start_groups(stack, lighthouse.address(), ["group_a"])[0]
    quorum_round([group], {"group_a": 0})
    lighthouse.shutdown()

    timeout = timedelta(seconds=2)
    started = time.monotonic()
    outcomes = run_calls(group.calls(1, timeout))
    for err, ended in outcomes:
        assert isinstance(err, FTError), err
        assert "lighthouse" in str(err)
        assert ended - started <= timeout.total_seconds() + SLACK_S
    ends = [ended for _, ended in outcomes]
    assert max(ends) - min(ends) < 0.3, "every rank of the group must get the lighthouse error at once"


@pytest.mark.timeout(60)
def test_lighthouse_down_with_retries_answers_every_rank_before_its_deadline(stack: ExitStack) -> None:
    dead = f"127.0.0.1:{free_port()}"
    group = start_groups(stack, dead, ["group_a"], quorum_retries=2, connect_timeout=timedelta(seconds=0.3))[0]
    timeout = timedelta(seconds=8)
    started = time.monotonic()
    outcomes = run_calls(group.calls(0, timeout))
    for err, ended in outcomes:
        assert isinstance(err, RPCError) and not isinstance(err, FTTimeoutError), err
        assert "after 3 attempt(s)" in str(err) and dead in str(err)
        assert ended - started < timeout.total_seconds() - 2, "the error must not wait for the ranks' deadline"
    ends = [ended for _, ended in outcomes]
    assert max(ends) - min(ends) < 0.3


@pytest.mark.timeout(60)
def test_lighthouse_restarted_on_the_same_address_managers_reconnect_and_ids_keep_increasing(
        stack: ExitStack) -> None:
    settings = dict(min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=2000, http_bind=None)
    first = LighthouseServer(**settings)
    stack.callback(first.shutdown)
    port = first.address().rsplit(":", 1)[1]
    a, b = start_groups(stack, first.address(), ["group_a", "group_b"], world_size=1)
    steps = {"group_a": 0, "group_b": 0}
    before = one_id(quorum_round([a, b], steps))
    first.shutdown()

    second = stack.enter_context(LighthouseServer(bind=f"127.0.0.1:{port}", **settings))
    after = one_id(rounds_until([a, b], steps, lambda ids: len(ids) == 2))
    assert after > before, "a restarted lighthouse must not reuse quorum ids the managers saw"
    assert one_id(quorum_round([a, b], steps)) >= after
    assert a.server.last_quorum_id() >= after
    assert second.address().endswith(f":{port}")


@pytest.mark.timeout(60)
def test_a_restarted_lighthouse_waits_for_a_member_of_the_managers_last_quorum_before_going_on(
        stack: ExitStack, caplog: pytest.LogCaptureFixture) -> None:
    """Rule 10 end to end: the managers report their last quorum's members, so a lighthouse restarted while
    group_a is gone first waits for group_a (one heartbeat timeout), then goes on with the others."""
    caplog.set_level(logging.DEBUG, logger="ft_core.control.lighthouse")
    settings = dict(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=2000, http_bind=None)
    first = LighthouseServer(**settings)
    stack.callback(first.shutdown)
    port = first.address().rsplit(":", 1)[1]
    a, b, c = start_groups(stack, first.address(), ["group_a", "group_b", "group_c"], world_size=1)
    before = one_id(quorum_round([a, b, c], {"group_a": 0, "group_b": 0, "group_c": 0}))
    a.close()
    first.shutdown()

    stack.enter_context(LighthouseServer(bind=f"127.0.0.1:{port}", **settings))
    results = rounds_until([b, c], {"group_b": 1, "group_c": 1}, lambda ids: ids == ["group_b", "group_c"])
    assert one_id(results) > before
    statuses = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quorum status:")]
    assert any(f"waiting for group_a (quorum {before}" in s for s in statuses), \
        "the restarted lighthouse issued without waiting for group_a of the managers' last quorum"


STEP_HOLDER = """
import sys, time
from datetime import timedelta
from ft_core.errors import FTError
from ft_core.control.manager_server import ManagerServer

server = ManagerServer(sys.argv[2], sys.argv[1], world_size=1)
assert server.wait_heartbeat_connected(20), "heartbeat stream never connected"
shown = None
while True:  # a group that has committed step 7 and asks for its next quorum, again and again
    try:
        ids = server.quorum_local(0, 7, "", False, timedelta(seconds=5)).replica_ids
    except FTError:
        time.sleep(0.05)
        continue
    if ids != shown:
        print(" ".join(ids), flush=True)
        shown = ids
"""


@pytest.mark.timeout(60)
def test_a_group_restarted_with_the_lighthouse_heals_from_the_job_instead_of_training_its_steps_again(
        stack: ExitStack, processes: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Rule 12 end to end, as ftl chaos found it (c1, seed 36301, min_replicas 1): the lighthouse restarts while
    group_b restarts too, and group_b asks the new lighthouse before group_a, which holds step 7, has reconnected
    (here: frozen for that time). Alone, group_b would get a quorum at step 0 and commit steps 1-7 again."""
    caplog.set_level(logging.DEBUG, logger="ft_core.control.lighthouse")
    settings = dict(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5000, http_bind=None)
    first = LighthouseServer(**settings)
    stack.callback(first.shutdown)
    port = first.address().rsplit(":", 1)[1]
    holder = processes.python("-c", STEP_HOLDER, first.address(), "group_a", stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().split() == ["group_a"], "group_a never got its quorum"
    holder.send_signal(signal.SIGSTOP)  # not reconnected yet: its process has not run since the restart
    stack.callback(holder.send_signal, signal.SIGCONT)
    first.shutdown()

    stack.enter_context(LighthouseServer(bind=f"127.0.0.1:{port}", **settings))
    monkeypatch.setenv("FT_RESTART_COUNT", "1")  # as `ftl launch` starts a restarted group
    (restarted,) = start_groups(stack, f"127.0.0.1:{port}", ["group_b"], world_size=1)
    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        asked = pool.submit(restarted.clients[0].quorum, 0, 0, "", False, timedelta(seconds=20))
        time.sleep(0.5)
        holder.send_signal(signal.SIGCONT)
        result = asked.result(timeout=30)
    assert result.replica_ids == ["group_a", "group_b"], "the restarted group got a quorum without the job's holder"
    assert result.max_step == 7 and result.heal, "the restarted group must heal from step 7, not train it again"
    statuses = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quorum status:")]
    assert any("group_b restarted and no participant reports a last quorum" in s for s in statuses), statuses[-3:]


@pytest.mark.parametrize("env, restarted", [
    ({}, False), ({"FT_RESTART_COUNT": "0"}, False), ({"FT_RESTART_COUNT": "2"}, True),
    ({"TORCHELASTIC_RESTART_COUNT": "1"}, True), ({"TORCHELASTIC_RESTART_COUNT": "0"}, False),
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, False),
])
def test_a_group_knows_it_restarted_from_ftl_launch_or_torchrun(monkeypatch: pytest.MonkeyPatch,
                                                                  env: dict[str, str], restarted: bool) -> None:
    for name in ("FT_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert restarted_incarnation() is restarted


@pytest.mark.timeout(60)
def test_first_lighthouse_address_dead_managers_use_the_second(stack: ExitStack) -> None:
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None))
    addrs = f"127.0.0.1:{free_port()},{lighthouse.address()}"
    a, b = start_groups(stack, addrs, ["group_a", "group_b"])
    results = rounds_until([a, b], {"group_a": 3, "group_b": 3}, lambda ids: len(ids) == 2)
    assert results["group_b"][1].replica_ids == ["group_a", "group_b"]


def test_manager_with_the_wrong_lighthouse_token_gets_a_clear_error(stack: ExitStack) -> None:
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=1, http_bind=None, token="right"))
    group = start_groups(stack, lighthouse.address(), ["group_a"], world_size=1, token="wrong",
                         wait_connected=False)[0]
    with pytest.raises(RPCError, match="token"):
        group.clients[0].quorum(0, 0, "", False, ROUND_TIMEOUT)
    with ManagerClient(group.server.address(), token="wrong") as client:  # the manager itself still serves
        with pytest.raises(RPCError, match="token"):
            client.quorum(0, 0, "", False, ROUND_TIMEOUT)


CHILD_MANAGER = """
import sys, time
from datetime import timedelta
from ft_core.errors import FTError
from ft_core.control.manager_server import ManagerServer

server = ManagerServer(sys.argv[2], sys.argv[1], world_size=1)
assert server.wait_heartbeat_connected(20), "heartbeat stream never connected"
print(server.address(), flush=True)
while True:
    try:
        server.quorum_local(0, 0, "", False, timedelta(seconds=5))
    except FTError:
        time.sleep(0.05)
"""


def start_child_manager(processes: Any, lighthouse_addr: str, replica_id: str) -> subprocess.Popen:
    child = processes.python("-c", CHILD_MANAGER, lighthouse_addr, replica_id, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip(), "the child manager server did not start"
    return child


def seconds_until_excluded(groups: list[Group], victim: str, limit_s: float) -> float:
    """Quorum rounds of the survivors until one leaves `victim` out; the time that took."""
    started = time.monotonic()
    rounds_until(groups, {g.replica_id: 0 for g in groups}, lambda ids: victim not in ids, limit_s)
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_sigkill_of_a_manager_process_drops_it_from_the_next_quorum_within_a_second(
        stack: ExitStack, processes: Any) -> None:
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=2, join_timeout_ms=60_000,
                                                      heartbeat_timeout_ms=5000, http_bind=None))
    survivors = start_groups(stack, lighthouse.address(), ["group_a", "group_b"], world_size=1)
    child = start_child_manager(processes, lighthouse.address(), "victim")
    rounds_until(survivors, {"group_a": 0, "group_b": 0}, lambda ids: "victim" in ids, limit_s=30)

    child.send_signal(signal.SIGKILL)
    elapsed = seconds_until_excluded(survivors, "victim", limit_s=10)
    assert elapsed < 1.0, f"the lighthouse took {elapsed:.2f}s to drop a killed manager (heartbeat timeout is 5 s)"
    assert child.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_a_frozen_manager_process_is_dropped_within_heartbeat_timeout_plus_a_tick(
        stack: ExitStack, processes: Any) -> None:
    heartbeat_timeout_s, tick_s = 1.0, 0.1
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=2, join_timeout_ms=60_000, quorum_tick_ms=100,
                                                      heartbeat_timeout_ms=1000, http_bind=None))
    survivors = start_groups(stack, lighthouse.address(), ["group_a", "group_b"], world_size=1)
    child = start_child_manager(processes, lighthouse.address(), "frozen")
    rounds_until(survivors, {"group_a": 0, "group_b": 0}, lambda ids: "frozen" in ids, limit_s=30)

    child.send_signal(signal.SIGSTOP)  # alive but silent: its connection stays open, its heartbeats stop
    try:
        elapsed = seconds_until_excluded(survivors, "frozen", limit_s=10)
    finally:
        child.send_signal(signal.SIGCONT)
    assert elapsed < heartbeat_timeout_s + tick_s + SLACK_S


# ---- the quorum over the heartbeat stream, with a member killed at every point of a round ----------

STREAM_MEMBER = r"""
import sys
from datetime import timedelta
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.types import QuorumMember

lighthouse, replica_id = sys.argv[1], sys.argv[2]
client = LighthouseClient(lighthouse)
stream = client.start_heartbeat_stream(replica_id, interval=timedelta(milliseconds=50))
assert stream.wait_connected(20), stream.last_error
print("READY", flush=True)
for line in sys.stdin:
    quorum = stream.quorum(QuorumMember(replica_id, address="127.0.0.1:1", step=int(line)), timedelta(seconds=30))
    print("JOINED", quorum.quorum_id, ",".join(quorum.replica_ids), flush=True)
"""

KILL_POINTS = ["between rounds", "after its join, before the others", "while the others wait for it",
               "with its join and answer in flight"]


def waiting_at(lighthouse: LighthouseServer) -> set[str]:
    return {m["replica_id"] for m in lighthouse.core.status()["members"] if m["waiting"]}


def wait_for_waiting(lighthouse: LighthouseServer, who: set[str], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not who <= waiting_at(lighthouse):
        assert time.monotonic() < deadline, f"{who} never waited at the lighthouse ({waiting_at(lighthouse)})"
        time.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", KILL_POINTS)
def test_stream_quorum_survivors_are_answered_when_a_member_is_killed_at_any_point_of_a_round(
        stack: ExitStack, processes: Any, point: str) -> None:
    # heartbeat_timeout 30 s and join_timeout 60 s: only the broken stream can explain a prompt answer.
    lighthouse = stack.enter_context(LighthouseServer(min_replicas=2, join_timeout_ms=60_000,
                                                      heartbeat_timeout_ms=30_000, http_bind=None))
    survivors = start_groups(stack, lighthouse.address(), ["a", "b"], world_size=1)
    for group in survivors:
        assert group.server.wait_heartbeat_connected(10)
    victim = processes.python("-c", STREAM_MEMBER, lighthouse.address(), "v", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "READY"
    pool = stack.enter_context(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-rank"))

    def survivors_round(step: int) -> list[futures.Future]:
        return [pool.submit(g.calls(step, timedelta(seconds=20))[0]) for g in survivors]

    def victim_join(step: int) -> None:
        victim.stdin.write(f"{step}\n")
        victim.stdin.flush()

    first = survivors_round(0)
    victim_join(0)
    assert [f.result(timeout=20).replica_ids for f in first] == [["a", "b", "v"]] * 2
    assert victim.stdout.readline().split()[2] == "a,b,v"

    if point == "between rounds":
        victim.kill()
        pending = survivors_round(1)
    elif point == "after its join, before the others":
        victim_join(1)
        wait_for_waiting(lighthouse, {"v"})
        victim.kill()
        pending = survivors_round(1)
    elif point == "while the others wait for it":
        pending = survivors_round(1)
        wait_for_waiting(lighthouse, {"a", "b"})
        victim.kill()
    else:  # the lighthouse may issue {a, b, v} and the answer to v die with it, or v's join die unsent
        pending = survivors_round(1)
        wait_for_waiting(lighthouse, {"a", "b"})
        victim_join(1)
        victim.kill()
    started = time.monotonic()
    ids = [f.result(timeout=20).replica_ids for f in pending]
    assert ids[0] == ids[1] and ids[0] in (["a", "b"], ["a", "b", "v"]), ids
    if ids[0] != ["a", "b"]:  # v was in that round: the next one goes on without it
        ids = [f.result(timeout=20).replica_ids for f in survivors_round(2)]
        assert ids == [["a", "b"], ["a", "b"]], ids
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"the survivors waited {elapsed:.1f}s for a quorum without the killed member"
    assert victim.wait(timeout=10) == -signal.SIGKILL
    for group in survivors:
        assert group.server._lighthouse is None, "a survivor fell back to unary calls: its stream quorum failed"
