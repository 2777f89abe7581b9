"""The lighthouse and its client: real servers on loopback, real child processes, real failures."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from conftest import assert_bounded, child_env, run_calls

from ft_core.tools import status as status_cli
from ft_core.errors import AuthError, FTTimeoutError, RPCError
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient, StreamUnavailable
from ft_core.control.lighthouse_calls import Waiter
from ft_core.control.lighthouse_state import LighthouseConfig, LighthouseCore
from ft_core.control.types import Quorum, QuorumMember
from ft_core.tools.launcher import free_port

SECOND = timedelta(seconds=1)

# A replica group in its own process: hosts a ManagerService whose Kill exits the process (as the
# real manager does), holds a heartbeat stream, joins one quorum, then idles until killed.
CHILD = r"""
import os, sys, threading, time
from concurrent import futures
from datetime import timedelta
import grpc
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.types import QuorumMember

lighthouse, replica_id, step = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Manager(ft_pb2_grpc.ManagerServiceServicer):
    def Kill(self, request, context):
        print("KILLED", request.msg, flush=True)
        threading.Timer(0.05, os._exit, (3,)).start()
        return ft_pb2.KillResponse()

server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="child-manager"))
ft_pb2_grpc.add_ManagerServiceServicer_to_server(Manager(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
client = LighthouseClient(lighthouse)
stream = client.start_heartbeat_stream(replica_id, interval=timedelta(milliseconds=50))
assert stream.wait_connected(20), stream.last_error
print("STREAMING", flush=True)
member = QuorumMember(replica_id, address=f"127.0.0.1:{port}", store_address="127.0.0.1:1", step=step)
quorum = client.quorum(member, timedelta(seconds=30))
print("JOINED", quorum.quorum_id, ",".join(quorum.replica_ids), flush=True)
time.sleep(300)
"""


def get(url: str, token: str | None = None, method: str = "GET") -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def status_of(server: LighthouseServer, token: str | None = None) -> dict:
    code, body, _ = get(server.http_address() + "/status", token)
    assert code == 200, body
    return json.loads(body)


def member_of(status: dict, replica_id: str) -> dict | None:
    return next((m for m in status["members"] if m["replica_id"] == replica_id), None)


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metric(server: LighthouseServer, name: str) -> float:
    _, body, _ = get(server.http_address() + "/metrics")
    match = re.search(rf"^{re.escape(name)} (\S+)$", body.decode(), re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def free_dead_port() -> int:
    """A loopback port nothing listens on (bound by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_all(client: LighthouseClient, members: list[QuorumMember], timeout: float = 10.0) -> list[Quorum]:
    """Call Quorum for every member from its own thread; return their answers in order."""
    results: list[object] = [None] * len(members)

    def run(i: int) -> None:
        try:
            results[i] = client.quorum(members[i], timedelta(seconds=timeout))
        except Exception as exc:  # surfaced by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"test-join-{i}") for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for r in results:
        assert isinstance(r, Quorum), r
    return results  # type: ignore[return-value]


def spawn_child(processes, server: LighthouseServer, replica_id: str, step: int = 0) -> subprocess.Popen:
    proc = processes.python("-c", CHILD, server.address(), replica_id, str(step), stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("STREAMING"), f"child {replica_id} failed to start: {line!r}"
    return proc


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_TOKEN", raising=False)


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=500) as s:
        yield s


@pytest.fixture
def client(lighthouse: LighthouseServer) -> Iterator[LighthouseClient]:
    with LighthouseClient(lighthouse.address(), connect_timeout=5 * SECOND) as c:
        yield c


def test_long_poll_quorum_from_threads_keeps_id_until_membership_changes() -> None:
    with LighthouseServer(min_replicas=3, quorum_tick_ms=50, heartbeat_timeout_ms=2_000) as server, \
            LighthouseClient(server.address()) as c:
        first = join_all(c, [QuorumMember(r, step=1) for r in ("c", "a", "b")])
        assert {q.quorum_id for q in first} == {1}
        assert first[0].replica_ids == ["a", "b", "c"]
        steady = join_all(c, [QuorumMember(r, step=2) for r in ("a", "b", "c")])
        assert {q.quorum_id for q in steady} == {1}, "same members: same quorum id"
        assert [p.step for p in steady[0].participants] == [2, 2, 2]
        # A joiner already waiting comes in with the fast quorum of the previous members.
        joiner: list[Quorum] = []
        thread = threading.Thread(target=lambda: joiner.extend(join_all(c, [QuorumMember("d", step=0)])),
                                  name="test-joiner")
        thread.start()
        wait_for(lambda: (member_of(status_of(server), "d") or {}).get("waiting"), what="d to wait")
        grown = join_all(c, [QuorumMember(r, step=3) for r in ("a", "b", "c")])
        thread.join(15)
        assert {q.quorum_id for q in grown + joiner} == {2} and joiner[0].replica_ids == ["a", "b", "c", "d"]


def test_quorum_call_ends_at_its_deadline_and_server_keeps_serving() -> None:
    with LighthouseServer(min_replicas=2, quorum_tick_ms=50, heartbeat_timeout_ms=500) as server, \
            LighthouseClient(server.address()) as c:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            c.quorum(QuorumMember("lonely"), timedelta(seconds=0.3))
        assert isinstance(info.value, FTTimeoutError) and "Quorum" in str(info.value)
        assert_bounded(start, 0.3, "a 0.3 s quorum poll")
        # Under load the member may already be pruned (heartbeat timeout 500 ms): gone has left the wait too.
        wait_for(lambda: not (member_of(status_of(server), "lonely") or {}).get("waiting"),
                 what="waiter to leave")
        assert {q.quorum_id for q in join_all(c, [QuorumMember("x"), QuorumMember("y")])} == {1}


def test_token_is_required_on_grpc_and_http(processes) -> None:
    token = "s3cret-token"
    with LighthouseServer(token=token, quorum_tick_ms=50, heartbeat_timeout_ms=500) as server:
        for bad in (None, "wrong"):
            with LighthouseClient(server.address(), token=bad) as c:
                with pytest.raises(AuthError) as info:
                    c.quorum(QuorumMember("a"), 2 * SECOND)
                assert info.value.code == "UNAUTHENTICATED" and "token" in str(info.value)
                with pytest.raises(AuthError):
                    c.heartbeat("a", 2 * SECOND)
                stream = c.start_heartbeat_stream("intruder")
                assert not stream.wait_connected(0.5)
                stream.stop()
                assert isinstance(stream.last_error, AuthError)
        for path in ("/status", "/", "/metrics"):
            assert get(server.http_address() + path)[0] == 401
            assert get(server.http_address() + path, token="wrong")[0] == 401
            assert get(server.http_address() + path, token=token)[0] == 200
            assert get(f"{server.http_address()}{path}?token={token}")[0] == 200
        assert get(server.http_address() + "/replica/a/kill", method="POST")[0] == 401
        assert member_of(status_of(server, token), "intruder") is None, "rejected streams register nothing"
        with LighthouseClient(server.address(), token=token) as c:
            assert c.quorum(QuorumMember("a"), 5 * SECOND).replica_ids == ["a"]
        assert status_cli.main(["--lighthouse", server.http_address(), "--token", token, "--json"]) == 0
        assert status_cli.main(["--lighthouse", server.http_address()]) == 1


@pytest.mark.parametrize("member,problem", [
    (QuorumMember(""), "empty replica_id"),
    (QuorumMember("a", world_size=0), "world_size must be >= 1"),
    (QuorumMember("a", data="x" * (64 * 1024 + 1)), "65536-byte limit"),
], ids=["empty-replica-id", "world-size-0", "oversized-data"])
def test_malformed_quorum_is_invalid_argument_and_server_keeps_serving(
        client: LighthouseClient, member: QuorumMember, problem: str) -> None:
    with pytest.raises(RPCError) as info:
        client.quorum(member, 2 * SECOND)
    assert info.value.code == "INVALID_ARGUMENT" and problem in str(info.value)
    with pytest.raises(RPCError) as info:
        client.heartbeat("", 2 * SECOND)
    assert info.value.code == "INVALID_ARGUMENT"
    assert client.quorum(QuorumMember("ok"), 5 * SECOND).replica_ids == ["ok"]


def test_status_json_metrics_and_page(lighthouse: LighthouseServer, client: LighthouseClient) -> None:
    stream = client.start_heartbeat_stream("fast")
    assert stream.wait_connected(5)
    slow = QuorumMember("slow", address="127.0.0.1:7003", store_address="127.0.0.1:7004", step=3, world_size=2)
    waiting = threading.Thread(target=join_all, args=(client, [slow]), name="test-slow")
    waiting.start()  # slow waits first: with only the streaming member alive, "fast" alone would be a quorum
    wait_for(lambda: (member_of(status_of(lighthouse), "slow") or {}).get("waiting"), what="slow to wait")
    fast = QuorumMember("fast", address="127.0.0.1:7001", store_address="127.0.0.1:7002", step=5, world_size=2)
    quorum = join_all(client, [fast])[0]
    waiting.join(10)
    assert quorum.replica_ids == ["fast", "slow"]
    status = status_of(lighthouse)
    assert status["quorum_id"] == quorum.quorum_id == 1
    assert status["max_step"] == 5 and status["min_replicas"] == 1
    assert isinstance(status["reason"], str) and status["reason"]
    participant = status["quorum"]["participants"][0]
    assert participant == {**participant, "replica_id": "fast", "step": 5, "address": "127.0.0.1:7001",
                           "store_address": "127.0.0.1:7002", "world_size": 2}
    assert participant["heartbeat_age_s"] >= 0
    fast, slow = member_of(status, "fast"), member_of(status, "slow")
    assert fast["stream"] and fast["healthy"] and not fast["waiting"] and not fast["recovering"]
    assert slow["recovering"] and slow["step"] == 3, "a member behind max_step is recovering"

    code, body, kind = get(lighthouse.http_address() + "/metrics")
    text = body.decode()
    assert code == 200 and kind.startswith("text/plain")
    for name in ("ftl_lighthouse_quorum_latency_seconds_bucket", "ftl_lighthouse_quorum_latency_seconds_count",
                 "ftl_lighthouse_quorums_issued_total", "ftl_lighthouse_members",
                 "ftl_lighthouse_participants", "ftl_lighthouse_heartbeats_expired_total",
                 "ftl_lighthouse_deaths_detected_total"):
        assert name in text, name
    assert metric(lighthouse, "ftl_lighthouse_quorums_issued_total") == 1
    assert metric(lighthouse, "ftl_lighthouse_participants") == 2

    code, page, kind = get(lighthouse.http_address() + "/")
    html = page.decode()
    assert code == 200 and kind.startswith("text/html")
    assert "<table" in html and "fetch(" in html and "/kill" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads nothing external"

    status_cli.main(["--lighthouse", lighthouse.http_address()])
    assert get(lighthouse.http_address() + "/nope")[0] == 404


@pytest.mark.timeout(60)
def test_sigkilled_member_is_excluded_in_under_a_second(processes) -> None:
    # heartbeat_timeout and join_timeout are long: only the broken stream can explain a fast exclusion.
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=100,
                          heartbeat_timeout_ms=10_000) as server, LighthouseClient(server.address()) as client:
        assert client.start_heartbeat_stream("a").wait_connected(5)
        child = spawn_child(processes, server, "b")
        first = client.quorum(QuorumMember("a"), 20 * SECOND)
        assert first.replica_ids == ["a", "b"]
        assert child.stdout.readline().split()[:2] == ["JOINED", str(first.quorum_id)]

        start = time.monotonic()
        child.kill()  # SIGKILL: no goodbye, the kernel drops its connections
        after = client.quorum(QuorumMember("a"), 5 * SECOND)
        elapsed = time.monotonic() - start
        assert after.replica_ids == ["a"] and after.quorum_id == first.quorum_id + 1
        assert elapsed < 1.0, f"death took {elapsed:.3f}s to detect"
        assert metric(server, "ftl_lighthouse_deaths_detected_total") == 1
        assert member_of(status_of(server), "b") is None


# A replica group that dies before its heartbeat stream connects: it only calls Quorum (no stream).
CHILD_NO_STREAM = r"""
import sys
from datetime import timedelta
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.types import QuorumMember

client = LighthouseClient(sys.argv[1])
print("CALLING", flush=True)
client.quorum(QuorumMember(sys.argv[2]), timedelta(seconds=60))
"""


@pytest.mark.timeout(60)
def test_member_killed_in_its_quorum_call_before_its_stream_connected_is_not_waited_for(processes) -> None:
    # The killed call counted as b's heartbeat; with a 30 s heartbeat_timeout, a quorum without b within
    # seconds proves the cancelled call withdrew it (else the split-brain guard waits for b).
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=100,
                          heartbeat_timeout_ms=30_000) as server, LighthouseClient(server.address()) as client:
        assert client.start_heartbeat_stream("a").wait_connected(5)
        child = processes.python("-c", CHILD_NO_STREAM, server.address(), "b", stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().startswith("CALLING")
        wait_for(lambda: (member_of(server.core.status(), "b") or {}).get("waiting"), 20, "b waiting in Quorum")
        assert member_of(server.core.status(), "b")["healthy"] is True  # its call counts as a heartbeat
        child.kill()
        child.wait(10)
        started = time.monotonic()
        quorum = client.quorum(QuorumMember("a"), 20 * SECOND)
        assert quorum.replica_ids == ["a"]
        assert time.monotonic() - started < 10.0, "waited for the dead member's heartbeat to expire"
        assert member_of(server.core.status(), "b") is None


def test_a_broken_streams_late_quorum_call_does_not_revive_it_until_a_new_stream_opens() -> None:
    # Drives the real core with the events in the order the race delivers them: b's stream breaks,
    # then a Quorum call from b's dead connection is handled.
    core = LighthouseCore(LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=30_000))
    woken: list[str] = []
    first_stream = object()
    core.stream_opened("b", first_stream)
    core.stream_closed("b", first_stream, "broke (connection dropped)")
    late = Waiter(QuorumMember("b"), lambda: woken.append("b"))
    core.join(late)
    assert member_of(core.status(), "b")["healthy"] is False, "a late call from a dead stream revived it"
    alone = Waiter(QuorumMember("a"), lambda: woken.append("a"))
    core.join(alone)
    assert alone.issued is not None and alone.issued.quorum.replica_ids == ["a"]
    assert late.issued is None
    core.leave(alone)
    core.stream_opened("b", object())  # a new stream: b is alive again and its waiting call takes part
    assert member_of(core.status(), "b")["healthy"] is True
    again = Waiter(QuorumMember("a"), lambda: woken.append("a"))
    core.join(again)
    assert late.issued is not None and late.issued.quorum.replica_ids == ["a", "b"]
    assert again.issued is late.issued
    assert sorted(woken) == ["a", "a", "b"]


def core_after_a_quorum_of(rids: str) -> tuple[LighthouseCore, dict[str, object]]:
    """A real core whose members (one letter each) hold heartbeat streams (the tokens, returned) and were
    issued one quorum together, their calls since ended."""
    core = LighthouseCore(LighthouseConfig(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=30_000))
    streams = {rid: object() for rid in rids}
    for rid, token in streams.items():
        core.stream_opened(rid, token)
    first = [Waiter(QuorumMember(rid), lambda: None) for rid in rids]
    for waiter in first:
        core.join(waiter)
    assert first[0].issued is not None and first[0].issued.quorum.replica_ids == sorted(rids)
    for waiter in first:
        core.leave(waiter)
    return core, streams


def test_a_waiting_shrink_only_call_is_answered_once_a_quorum_leaves_its_caller_out() -> None:
    # b asks for a redo (shrink-only) while it is still in the previous quorum {a, b}, then its stream breaks:
    # the quorum issued next is {a}. From then on no quorum can include b's call; the core answers it there
    # and then, with the reason, instead of holding it (and keeping joiners out) until its deadline.
    core, streams = core_after_a_quorum_of("ab")
    woken: list[str] = []
    redo = Waiter(QuorumMember("b", shrink_only=True), lambda: woken.append("b"))
    core.join(redo)
    assert redo.issued is None and redo.excluded is None, "b is in the previous quorum: its redo may be issued"
    core.stream_closed("b", streams["b"], "broke (connection dropped)")
    alone = Waiter(QuorumMember("a"), lambda: None)
    core.join(alone)
    assert alone.issued is not None and alone.issued.quorum.replica_ids == ["a"]
    core.stream_opened("b", object())  # b is back (it was frozen): its redo can never be issued now
    assert redo.issued is None and woken == ["b"]
    assert redo.excluded is not None and "not a member of the last quorum" in redo.excluded, redo.excluded


def test_fast_quorum_is_issued_at_the_last_join_after_a_quorum_that_left_a_live_member_out() -> None:
    # The core skips decide() on a join while a live member of the previous quorum has not joined
    # (rule 4 would wait for it). Once a quorum without that member is issued, it is no straggler of
    # the new one: the next round's last join must issue the fast quorum itself, not leave it to a tick.
    core, streams = core_after_a_quorum_of("abc")
    second = [Waiter(QuorumMember(rid), lambda: None) for rid in "ab"]
    for waiter in second:
        core.join(waiter)
    assert second[1].issued is None, "c is alive and in the previous quorum: the round waits for it"
    core.stream_closed("c", streams["c"], "broke (connection dropped)")  # c is dropped: {a, b} issued
    assert second[1].issued is not None and second[1].issued.quorum.replica_ids == ["a", "b"]
    for waiter in second:
        core.leave(waiter)
    core.stream_opened("c", object())  # c reconnects, alive but not joining (it is busy elsewhere)
    third = [Waiter(QuorumMember(rid), lambda: None) for rid in "ab"]
    for waiter in third:
        core.join(waiter)
    assert third[1].issued is not None, "the fast quorum of {a, b} waited for a tick"
    assert third[1].issued.quorum.replica_ids == ["a", "b"]


def test_a_live_holder_of_a_step_is_waited_for_after_a_quorum_that_left_it_out() -> None:
    # Found by ftl chaos (c2, seed 44). a holds step 212 but is stuck (still heartbeating) after quorum 1;
    # quorum 2 goes on with b and c:1, c:1 holding 212 too; c:1 is killed. b (211) and c's new incarnation
    # (0) must not form a quorum at step 211 (it would commit 212 again, beside a's 212) while a heartbeats,
    # although a is not in the previous quorum; once a is gone they may.
    core = LighthouseCore(LighthouseConfig(min_replicas=1, join_timeout_ms=50, heartbeat_timeout_ms=30_000))
    streams = {rid: object() for rid in ("a", "b", "c:1")}
    for rid, token in streams.items():
        core.stream_opened(rid, token)
    steps = {"a": 212, "b": 211, "c:1": 212}
    first = [Waiter(QuorumMember(rid, step=steps[rid]), lambda: None) for rid in steps]
    for waiter in first:
        core.join(waiter)
    assert first[0].issued is not None and first[0].issued.quorum.replica_ids == ["a", "b", "c:1"]
    for waiter in first:
        core.leave(waiter)
    second = [Waiter(QuorumMember(rid, step=steps[rid]), lambda: None) for rid in ("b", "c:1")]
    for waiter in second:
        core.join(waiter)
    time.sleep(0.1)  # a is a straggler past the join timeout, and c:1 holds 212: issued without a
    core.tick()
    assert second[0].issued is not None and second[0].issued.quorum.replica_ids == ["b", "c:1"]
    for waiter in second:
        core.leave(waiter)
    core.stream_closed("c:1", streams["c:1"], "broke (killed)")
    core.stream_opened("c:2", object())
    third = [Waiter(QuorumMember("b", step=211), lambda: None), Waiter(QuorumMember("c:2", step=0), lambda: None)]
    for waiter in third:
        core.join(waiter)
    time.sleep(0.1)
    core.tick()
    assert third[0].issued is None, "a quorum at step 211 was issued while a, holding step 212, heartbeats"
    assert "behind step 212 of a" in core.quorum_status(), core.quorum_status()
    core.stream_closed("a", streams["a"], "broke (killed)")
    core.tick()
    assert third[0].issued is not None and third[0].issued.quorum.replica_ids == ["b", "c:2"]


@pytest.mark.timeout(60)
def test_silent_member_is_excluded_after_heartbeat_timeout_and_comes_back(processes) -> None:
    timeout_ms, tick_ms = 500, 50
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=tick_ms,
                          heartbeat_timeout_ms=timeout_ms) as server, LighthouseClient(server.address()) as client:
        assert client.start_heartbeat_stream("a").wait_connected(5)
        child = spawn_child(processes, server, "b")
        assert client.quorum(QuorumMember("a"), 20 * SECOND).replica_ids == ["a", "b"]

        child.send_signal(signal.SIGSTOP)  # hung: connection open, nothing sent
        start = time.monotonic()
        after = client.quorum(QuorumMember("a"), 10 * SECOND)
        elapsed = time.monotonic() - start
        assert after.replica_ids == ["a"]
        assert elapsed <= (timeout_ms + tick_ms) / 1000 + 1.0, f"took {elapsed:.3f}s"
        silent = member_of(status_of(server), "b")
        assert silent["stream"] and not silent["healthy"], "the stream is open but the member is silent"
        assert metric(server, "ftl_lighthouse_heartbeats_expired_total") == 1
        assert metric(server, "ftl_lighthouse_deaths_detected_total") == 0

        child.send_signal(signal.SIGCONT)
        wait_for(lambda: member_of(status_of(server), "b")["healthy"], 5, "the member to heartbeat again")


@pytest.mark.timeout(60)
def test_dashboard_kill_calls_the_members_manager(processes) -> None:
    with LighthouseServer(quorum_tick_ms=50, heartbeat_timeout_ms=10_000) as server, \
            LighthouseClient(server.address()) as client:
        assert client.start_heartbeat_stream("a").wait_connected(5)
        child = spawn_child(processes, server, "b")
        assert client.quorum(QuorumMember("a"), 20 * SECOND).replica_ids == ["a", "b"]
        assert child.stdout.readline().startswith("JOINED")
        code, body, _ = get(server.http_address() + "/replica/b/kill", method="POST")
        assert code == 200, body
        assert child.stdout.readline().startswith("KILLED killed from the lighthouse dashboard")
        assert child.wait(timeout=10) == 3
        assert client.quorum(QuorumMember("a"), 5 * SECOND).replica_ids == ["a"]
        assert get(server.http_address() + "/replica/nobody/kill", method="POST")[0] == 404


@pytest.mark.timeout(60)
def test_restart_on_same_port_keeps_quorum_ids_increasing() -> None:
    first = LighthouseServer(quorum_tick_ms=50, heartbeat_timeout_ms=500)
    port = int(first.address().rsplit(":", 1)[1])
    with LighthouseClient(first.address()) as client:
        stream = client.start_heartbeat_stream("a")
        seen = 0
        try:
            for _ in range(3):  # a commit failure forces a new id each round
                seen = client.quorum(QuorumMember("a", commit_failures=1, last_quorum_id=seen), 5 * SECOND).quorum_id
            assert seen == 3
        finally:
            first.shutdown()
        with LighthouseServer(bind=f"127.0.0.1:{port}", quorum_tick_ms=50, heartbeat_timeout_ms=500) as second:
            again = client.quorum(QuorumMember("a", last_quorum_id=seen), 10 * SECOND)
            assert again.quorum_id > seen
            wait_for(lambda: (member_of(status_of(second), "a") or {}).get("stream"), 10, "the stream to reconnect")
            # the lighthouse lists the stream at its first request; the client calls it connected at the first answer
            assert stream.wait_connected(10), "the stream reconnected on the lighthouse's side but was never answered"


def test_client_fails_over_when_the_first_address_is_dead(lighthouse: LighthouseServer) -> None:
    dead = f"127.0.0.1:{free_dead_port()}"
    with LighthouseClient(f"{dead},{lighthouse.address()}", connect_timeout=5 * SECOND) as client:
        start = time.monotonic()
        assert client.quorum(QuorumMember("a"), 10 * SECOND).replica_ids == ["a"]
        assert time.monotonic() - start < 3.0, "the dead address must not eat the timeout"
        client.heartbeat("a", 2 * SECOND)
    with LighthouseClient([dead, lighthouse.address()]) as client:
        stream = client.start_heartbeat_stream("s")
        assert stream.wait_connected(5)
        assert member_of(status_of(lighthouse), "s")["stream"]


def test_lighthouse_down_fails_within_the_timeout() -> None:
    with LighthouseClient(f"127.0.0.1:{free_dead_port()}", connect_timeout=10 * SECOND) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="check that a lighthouse is running"):
            client.quorum(QuorumMember("a"), timedelta(seconds=1))
        assert_bounded(start, 1, "a 1 s quorum call to a dead lighthouse")
    with LighthouseClient(f"127.0.0.1:{free_dead_port()}", connect_timeout=0.5 * SECOND) as client:
        with pytest.raises(RPCError, match="no lighthouse reachable") as info:
            client.quorum(QuorumMember("a"), timedelta(seconds=10))
        assert info.value.code == "UNAVAILABLE"


@pytest.mark.timeout(60)
def test_cli_lighthouse_serves_and_exits_cleanly_on_sigterm(processes) -> None:
    proc = processes.python("-m", "ft_core.tools.cli", "lighthouse", "--bind", "127.0.0.1:0", "--http-bind",
                            "127.0.0.1:0", "--heartbeat-timeout-ms", "500", stderr=subprocess.PIPE, text=True,
                            env=child_env(COLUMNS="250"))
    address = http = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (address and http):
        line = proc.stderr.readline()
        assert line, "ftl lighthouse exited before printing its addresses"
        address = address or (re.search(r"gRPC (\S+:\d+)", line) or [None, None])[1]
        http = http or (re.search(r"status (http://[0-9.]+:\d+)", line) or [None, None])[1]
    with LighthouseClient(address) as client:
        assert client.quorum(QuorumMember("cli"), 5 * SECOND).quorum_id == 1
    assert status_cli.main(["--lighthouse", http, "--json"]) == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_64_streaming_groups_all_get_their_quorums() -> None:
    """Open heartbeat streams must not starve the long polls: 64 groups, 3 rounds, one id."""
    groups = [f"g{i:02d}" for i in range(64)]
    with LighthouseServer(min_replicas=64, quorum_tick_ms=50, heartbeat_timeout_ms=5_000) as server, \
            LighthouseClient(server.address()) as client:
        streams = [client.start_heartbeat_stream(g, interval=timedelta(milliseconds=100)) for g in groups]
        assert all(s.wait_connected(10) for s in streams)
        for step in range(3):
            answers = join_all(client, [QuorumMember(g, step=step) for g in groups], timeout=20)
            assert {q.quorum_id for q in answers} == {1} and answers[0].replica_ids == groups
        assert metric(server, "ftl_lighthouse_members") == 64


def test_long_expired_heartbeats_are_pruned() -> None:
    core = LighthouseCore(LighthouseConfig(heartbeat_timeout_ms=10))
    core.heartbeat("gone")
    assert [m["replica_id"] for m in core.status()["members"]] == ["gone"]
    time.sleep(0.05)
    core.tick()
    assert core.status()["members"][0]["healthy"] is False, "expired but still shown"
    time.sleep(0.1)  # past PRUNE_AFTER_TIMEOUTS * heartbeat_timeout
    core.tick()
    assert core.status()["members"] == []


def test_status_cli_address_forms(lighthouse: LighthouseServer, capsys: pytest.CaptureFixture) -> None:
    assert status_cli.status_urls("http://h:1/status") == ["http://h:1"]
    assert status_cli.status_urls("h:29510") == ["http://h:29510", "http://h:29511"]
    assert status_cli.main(["--lighthouse", lighthouse.http_address().removeprefix("http://"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["min_replicas"] == 1
    assert status_cli.main(["--lighthouse", f"127.0.0.1:{free_dead_port()}", "--timeout", "1"]) == 1
    assert "no lighthouse status server answered" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.timeout(60)
def test_a_second_live_incarnation_of_a_group_is_refused_until_the_first_is_gone(caplog) -> None:
    caplog.set_level(logging.INFO, logger="ft_core.control.lighthouse")
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=30_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        old = client.start_heartbeat_stream("g:old", interval=timedelta(milliseconds=50))
        assert old.wait_connected(10)
        assert client.quorum(QuorumMember("g:old"), 10 * SECOND).replica_ids == ["g:old"]
        new = client.start_heartbeat_stream("g:new", interval=timedelta(milliseconds=50))
        assert new.wait_connected(10)
        answer: list[object] = []
        joiner = threading.Thread(target=lambda: answer.append(client.quorum(QuorumMember("g:new"), 30 * SECOND)),
                                  name="test-join-new")
        joiner.start()
        wait_for(lambda: "refused: g:new" in server.core.status()["reason"], what="g:new to be refused")
        assert member_of(server.core.status(), "g:new")["refused_for"] == "g:old"
        again = client.quorum(QuorumMember("g:old", step=1), 10 * SECOND)
        assert again.replica_ids == ["g:old"], "the older incarnation keeps training alone"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("g:new refused" in w and "g:old" in w for w in warnings), warnings
        assert not answer, "the second incarnation was admitted while the first was alive"
        old.stop()  # the first incarnation is gone (a clean exit): the newer one takes over at once
        joiner.join(20)
        assert answer and isinstance(answer[0], Quorum) and answer[0].replica_ids == ["g:new"], answer


@pytest.mark.timeout(60)
def test_ftl_lighthouse_log_lines_are_not_wrapped_in_a_file(processes, tmp_path) -> None:
    log = tmp_path / "lighthouse.log"
    long_id = "replica_" + "x" * 150
    with open(log, "wb") as out:
        proc = processes.python("-m", "ft_core", "lighthouse", "--bind", "127.0.0.1:0", "--http-bind", "off",
                                stdout=out, stderr=subprocess.STDOUT)
    address = wait_for(lambda: re.search(r"listening on (127\.0\.0\.1:\d+)", log.read_text()), 30,
                       "the lighthouse to start").group(1)
    with LighthouseClient(address) as client:
        assert client.quorum(QuorumMember(long_id), 10 * SECOND).replica_ids == [long_id]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 0
    lines = log.read_text().splitlines()
    assert any("quorum 1 issued" in line and long_id in line for line in lines), lines


# ---- quorum long polls carried on the heartbeat stream ---------------------------------------------

def test_stream_quorum_answers_both_members_with_one_quorum_and_heartbeats_go_on() -> None:
    with LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None) as server, \
            LighthouseClient(server.address()) as client:
        streams = {rid: client.start_heartbeat_stream(rid) for rid in ("a", "b")}
        assert all(s.wait_connected(10) for s in streams.values())
        got = run_calls([lambda rid=rid: streams[rid].quorum(QuorumMember(rid, step=3), 10) for rid in ("a", "b")])
        quorums = [q for q, _ in got]
        assert quorums[0] == quorums[1] and quorums[0].replica_ids == ["a", "b"] and quorums[0].quorum_id == 1
        assert all(s.connected for s in streams.values())


def test_stream_quorum_deadline_bad_request_and_shutdown_are_answered_on_the_open_stream() -> None:
    server = LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None)
    try:
        with LighthouseClient(server.address()) as client:
            stream = client.start_heartbeat_stream("alone")
            assert stream.wait_connected(10)
            with pytest.raises(FTTimeoutError, match="no quorum containing alone before the deadline"):
                stream.quorum(QuorumMember("alone"), 0.3)  # min_replicas=2: no quorum
            wait_for(lambda: not member_of(server.core.status(), "alone")["waiting"], what="the join to end")
            with pytest.raises(RPCError, match="heartbeat stream of alone") as err:
                stream.quorum(QuorumMember("someone-else"), 5)
            assert err.value.code == "INVALID_ARGUMENT" and stream.connected
            outcome: list[BaseException] = []

            def join() -> None:
                try:
                    stream.quorum(QuorumMember("alone"), 20)
                except BaseException as exc:  # recorded for the assertion below
                    outcome.append(exc)

            joiner = threading.Thread(target=join, name="test-join-alone")
            joiner.start()
            wait_for(lambda: member_of(server.core.status(), "alone")["waiting"], what="the join to wait")
            server.shutdown()
            joiner.join(10)
            assert outcome and isinstance(outcome[0], StreamUnavailable), outcome
    finally:
        server.shutdown()


def test_a_stream_of_rapid_heartbeats_gets_few_answers_and_stays_alive() -> None:
    # Answers only prove the stream is alive to the client (its staleness limit is >= 3 s), so the lighthouse
    # answers a stream's heartbeats at most every HEARTBEAT_ACK_S: 200 heartbeats cost no 200 writes.
    from ft_core.control.lighthouse import HEARTBEAT_ACK_S
    from ft_core.control.proto import ft_pb2, ft_pb2_grpc
    import grpc

    with LighthouseServer(http_bind=None) as server, grpc.insecure_channel(server.address()) as channel:
        stub = ft_pb2_grpc.LighthouseServiceStub(channel)
        beats = [ft_pb2.LighthouseHeartbeatRequest(replica_id="rapid")] * 200
        started = time.monotonic()
        answers = list(stub.HeartbeatStream(iter(beats), timeout=30))
        elapsed = time.monotonic() - started
        assert 1 <= len(answers) <= 2 + elapsed / HEARTBEAT_ACK_S, (len(answers), elapsed)
        assert all(not a.HasField("peer_lost") and not a.request_id for a in answers)


def test_many_heartbeat_streams_of_one_process_share_one_thread(lighthouse: LighthouseServer) -> None:
    # "Many members per process" costs one event loop thread, not a thread (or two) per stream.
    with LighthouseClient(lighthouse.address()) as client:
        streams = [client.start_heartbeat_stream(f"shared-{i}") for i in range(12)]
        assert all(s.wait_connected(20) for s in streams)
        names = [t.name for t in threading.enumerate()]
        assert names.count("ftl-heartbeat-streams") == 1 and not any(n.startswith("ftl-heartbeat-s") and
                                                                        n != "ftl-heartbeat-streams" for n in names)
        got = run_calls([lambda s=s, i=i: s.quorum(QuorumMember(f"shared-{i}", step=1), 20)
                         for i, s in enumerate(streams)])
        quorums = [q for q, _ in got]
        assert all(isinstance(q, Quorum) for q in quorums), quorums
        assert {q.quorum_id for q in quorums} == {quorums[0].quorum_id}
        assert all(q.replica_ids == sorted(f"shared-{i}" for i in range(12)) for q in quorums)


def ask_in_threads(client: LighthouseClient, members: list[QuorumMember],
                   timeout: float = 30.0) -> tuple[list[threading.Thread], dict[str, object]]:
    """Start a Quorum call for each member on its own thread; answers (or errors) land by replica id."""
    answers: dict[str, object] = {}

    def ask(member: QuorumMember) -> None:
        try:
            answers[member.replica_id] = client.quorum(member, timedelta(seconds=timeout))
        except Exception as exc:  # surfaced by the test's assertions
            answers[member.replica_id] = exc

    threads = [threading.Thread(target=ask, args=(member,), name=f"test-ask-{member.replica_id}")
               for member in members]
    for thread in threads:
        thread.start()
    return threads, answers


def reporting(rid: str, quorum_id: int, members: tuple[str, ...], step: int = 0) -> QuorumMember:
    """A member whose last quorum (issued by another or an earlier lighthouse) was `quorum_id` with `members`."""
    return QuorumMember(rid, step=step, last_quorum_id=quorum_id, last_quorum_replica_ids=members)


@pytest.mark.timeout(60)
def test_a_fresh_lighthouse_waits_for_the_reported_last_quorum_member_until_it_joins() -> None:
    """Rule 10: b and c report quorum 7 of {a, b, c}, which this fresh lighthouse never issued: no quorum for
    b and c alone (a may hold a step committed after theirs) until a, still reconnecting, joins."""
    last = ("a", "b", "c")
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=30_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        threads, answers = ask_in_threads(client, [reporting(rid, 7, last, step=802) for rid in ("b", "c")])
        wait_for(lambda: "waiting for a (quorum 7" in server.core.quorum_status(), what="the wait for a")
        assert not answers, f"issued without a, the reported member of quorum 7: {answers}"
        a = client.quorum(reporting("a", 7, last, step=803), 10 * SECOND)
        for thread in threads:
            thread.join(15)
        assert a.quorum_id == 8 and a.replica_ids == ["a", "b", "c"]
        assert all(isinstance(q, Quorum) and q.quorum_id == 8 and q.replica_ids == ["a", "b", "c"]
                   for q in answers.values()), answers
        assert all(p.last_quorum_replica_ids == () for p in a.participants), "the reports are not echoed back"


@pytest.mark.timeout(60)
def test_a_fresh_lighthouse_gives_up_on_an_unheard_reported_member_after_the_heartbeat_timeout(caplog) -> None:
    """Rule 10: the reported member never shows up; one heartbeat timeout after the report it counts as dead
    and the others get their quorum (above the reported id)."""
    caplog.set_level(logging.DEBUG, logger="ft_core.control.lighthouse")
    last = ("a", "b", "c")
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=1_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        streams = [client.start_heartbeat_stream(rid, interval=timedelta(milliseconds=50)) for rid in ("b", "c")]
        try:
            assert all(stream.wait_connected(10) for stream in streams)
            threads, answers = ask_in_threads(client, [reporting("b", 7, last), reporting("c", 7, last)])
            for thread in threads:
                thread.join(20)
        finally:
            for stream in streams:
                stream.stop()
        assert all(isinstance(q, Quorum) and q.quorum_id == 8 and q.replica_ids == ["b", "c"]
                   for q in answers.values()) and len(answers) == 2, answers
        statuses = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quorum status:")]
        assert any("waiting for a (quorum 7" in s for s in statuses), "b and c were issued a quorum before the wait"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("reports quorum 7, which this lighthouse never issued" in w for w in warnings), warnings


@pytest.mark.timeout(60)
def test_a_fresh_lighthouse_waits_for_a_heartbeating_reported_member_past_the_heartbeat_timeout() -> None:
    """Rule 10 waits for a reported member that heartbeats until it asks (its step is unknown here), also
    once a heartbeat timeout has passed since the report: the lighthouse's periodic prune of the reports
    used to drop them then, a still in its step became a straggler, and b and c got a quorum without it
    at the join timeout, as in the fork ftl chaos found (c7, seed 7)."""
    last = ("a", "b", "c")
    with LighthouseServer(min_replicas=1, join_timeout_ms=300, quorum_tick_ms=50, heartbeat_timeout_ms=2_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        streams = [client.start_heartbeat_stream(rid, interval=timedelta(milliseconds=50)) for rid in last]
        try:
            assert all(stream.wait_connected(10) for stream in streams)
            threads, answers = ask_in_threads(client, [reporting(rid, 7, last, step=802) for rid in ("b", "c")])
            wait_for(lambda: "waiting for a (quorum 7, heartbeating" in server.core.quorum_status(),
                     what="the wait for a")
            time.sleep(5.0)  # two and a half heartbeat timeouts past the report, many join timeouts
            assert not answers, f"issued without a, which heartbeats and may hold a later step: {answers}"
            assert "waiting for a (quorum 7, heartbeating" in server.core.quorum_status()
            a = streams[0].quorum(reporting("a", 7, last, step=803), 10 * SECOND)
            for thread in threads:
                thread.join(15)
        finally:
            for stream in streams:
                stream.stop()
        assert a.quorum_id == 8 and a.replica_ids == ["a", "b", "c"]
        assert all(isinstance(q, Quorum) and q.quorum_id == 8 for q in answers.values()) and len(answers) == 2, answers


@pytest.mark.timeout(60)
def test_the_stream_carries_the_last_quorum_report_only_to_a_lighthouse_that_did_not_answer_that_quorum() -> None:
    """Rule 10's report names every member of the last quorum (O(N) per member per round): on a heartbeat stream
    whose lighthouse answered that quorum it stays home; on a new stream (the lighthouse restarted, or another
    one took over) the first request carries it."""
    port = free_port()
    seen: list[tuple[str, ...]] = []

    def spy_on(server: LighthouseServer) -> None:
        join = server.core.join

        def recording_join(waiter: Waiter) -> None:
            seen.append(waiter.member.last_quorum_replica_ids)  # what arrived, before the lighthouse strips it
            join(waiter)

        server.core.join = recording_join  # type: ignore[method-assign]

    settings = dict(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50,
                    heartbeat_timeout_ms=1_000, http_bind=None)
    with LighthouseClient(f"127.0.0.1:{port}", connect_timeout=10) as client:
        with LighthouseServer(**settings) as first:
            spy_on(first)
            stream = client.start_heartbeat_stream("a", interval=timedelta(milliseconds=50))
            try:
                assert stream.wait_connected(10)
                one = stream.quorum(QuorumMember("a", step=1), 10 * SECOND)
                two = stream.quorum(reporting("a", one.quorum_id, ("a",), step=2), 10 * SECOND)
                assert two.quorum_id == one.quorum_id
                assert seen == [(), ()], "a report of the quorum this stream's lighthouse answered was sent"
                elsewhere = stream.quorum(reporting("a", one.quorum_id + 5, ("a",), step=3), 10 * SECOND)
                assert seen[-1] == ("a",), "a quorum this lighthouse never answered is news: the report goes"
                first.shutdown()
                wait_for(lambda: not stream.connected, what="the stream to notice the lighthouse is gone")
                with LighthouseServer(**settings) as second:
                    spy_on(second)
                    seen.clear()
                    assert stream.wait_connected(15)
                    again = stream.quorum(reporting("a", elsewhere.quorum_id, ("a", "b"), step=4), 10 * SECOND)
                    assert seen[0] == ("a", "b"), "the restarted lighthouse was not told of the members' last quorum"
                    assert again.quorum_id > elsewhere.quorum_id and again.replica_ids == ["a"]
            finally:
                stream.stop()


@pytest.mark.parametrize("wire", ["frames", "grpc"])
def test_stream_quorum_polls_are_freed_without_the_cycle_collector(wire: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quorum poll on a heartbeat stream, answered or withdrawn with its stream, leaves no reference cycle:
    at a few hundred groups polling at 10 Hz, per-poll cycles made the lighthouse run a full collection
    (30-70 ms, every member's round waiting) about once a second."""
    import gc

    monkeypatch.setenv("FT_FRAMES", "1" if wire == "frames" else "0")
    with LighthouseServer(min_replicas=2, join_timeout_ms=5_000, http_bind=None) as lighthouse:
        clients = {rid: LighthouseClient(lighthouse.address()) for rid in ("a", "b")}
        streams = {rid: client.start_heartbeat_stream(rid) for rid, client in clients.items()}
        try:
            assert all(stream.wait_connected(10) for stream in streams.values())
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for step in range(5):
                    answers = run_calls([lambda rid=rid: streams[rid].quorum(
                        QuorumMember(rid, address="127.0.0.1:1", step=step), 10 * SECOND) for rid in streams])
                    assert all(isinstance(q, Quorum) and q.replica_ids == ["a", "b"] for q, _ in answers), answers
                lone = threading.Thread(target=lambda: run_calls([lambda: streams["a"].quorum(
                    QuorumMember("a", address="127.0.0.1:1", step=9), 10 * SECOND)]))
                lone.start()  # a poll that waits for "b", then is withdrawn as a's stream ends
                wait_for(lambda: any(m["replica_id"] == "a" and m["waiting"]
                                     for m in lighthouse.core.status()["members"]), 10)
                streams["a"].stop()
                lone.join(20)
                wait_for(lambda: not any(m["replica_id"] == "a" and m["waiting"]
                                         for m in lighthouse.core.status()["members"]), 10)
                gc.collect()
                cyclic = [o.member.replica_id for o in gc.garbage if isinstance(o, Waiter)]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
            assert cyclic == [], f"{len(cyclic)} quorum polls were left for the cycle collector"
        finally:
            for client in clients.values():
                client.close()


def _poll_waiting_at(lighthouse: LighthouseServer, client: LighthouseClient) -> tuple[threading.Thread, list[object]]:
    """`a`'s unary quorum long poll through `client`, on a thread, once it waits at the lighthouse."""
    answers: list[object] = []
    caller = threading.Thread(target=lambda: answers.extend(
        value for value, _ in run_calls([lambda: client.quorum(QuorumMember("a"), 15 * SECOND)])))
    caller.start()
    wait_for(lambda: any(m["replica_id"] == "a" and m["waiting"] for m in lighthouse.core.status()["members"]),
             10, "a's call to wait at the lighthouse")
    return caller, answers


def test_a_reset_closes_a_channel_only_after_the_last_call_on_it_ends() -> None:
    """A reset (the heartbeat stream's, from its own thread) retires the channel: new calls get a fresh one,
    and the quorum long poll in flight on the old one goes on there, unbroken and not sent again; the old
    channel is closed once that call ends (before: closed at once, cancelling the call under it)."""
    import grpc

    def probe(channel) -> grpc.StatusCode:
        """A call on `channel` that touches no lighthouse state: UNIMPLEMENTED when it is open."""
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/ft.Probe/Nothing")(b"", timeout=5)
        return err.value.code()

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000, http_bind=None) as lighthouse, \
            LighthouseClient(lighthouse.address()) as first, LighthouseClient(lighthouse.address()) as second:
        addr = lighthouse.address()
        caller, answers = _poll_waiting_at(lighthouse, first)
        old = first._channels[addr]
        first._reset(addr)
        assert first._channels.get(addr) is not old
        assert probe(old) is grpc.StatusCode.UNIMPLEMENTED  # still open: a's poll is on it
        assert second.quorum(QuorumMember("b"), 15 * SECOND).replica_ids == ["a", "b"]
        caller.join(20)
        assert len(answers) == 1 and isinstance(answers[0], Quorum), answers
        with pytest.raises(ValueError, match="closed channel"):  # closed by the poll's end
            old.unary_unary("/ft.Probe/Nothing")(b"", timeout=5)
        caller, answers = _poll_waiting_at(lighthouse, first)  # retired with a call on it, then the client closes
        old = first._channels[addr]
        first._reset(addr)
        closed = time.monotonic()
        first.close()
        caller.join(20)
        assert len(answers) == 1 and isinstance(answers[0], Exception), answers
        assert_bounded(closed, 1.0, "the poll on a retired channel after close()")  # not its 15 s deadline
        with pytest.raises(ValueError, match="closed channel"):
            old.unary_unary("/ft.Probe/Nothing")(b"", timeout=5)


def test_a_quorum_call_cancelled_under_it_goes_on_within_its_deadline() -> None:
    """A unary quorum long poll whose channel is closed under it anyway (grpc ends the call at once with
    CANCELLED, which maps to a timeout status) is no timeout: well before its deadline, the call goes on on
    a fresh channel and gets its quorum (e4544ed; before: FTTimeoutError at once)."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000, http_bind=None) as lighthouse, \
            LighthouseClient(lighthouse.address()) as first, LighthouseClient(lighthouse.address()) as second:
        caller, answers = _poll_waiting_at(lighthouse, first)
        first._channels[lighthouse.address()].close()  # not through _reset, which waits for the poll
        time.sleep(0.3)
        assert second.quorum(QuorumMember("b"), 15 * SECOND).replica_ids == ["a", "b"]
        caller.join(20)
        assert len(answers) == 1 and isinstance(answers[0], Quorum), answers
        assert answers[0].replica_ids == ["a", "b"]


@pytest.mark.parametrize("wire", ["frames", "grpc"])
def test_a_stall_of_the_member_s_own_loop_is_not_read_as_a_silent_lighthouse(
        wire: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stream reconnects when the lighthouse leaves its heartbeats unanswered for the stale time (3 s). A
    member whose own stream loop stalls that long (a loaded machine, a long pause) sent no heartbeat
    meanwhile, so none went unanswered: the stream stays (before: "stopped answering", a reconnect, and a
    quorum asked meanwhile refused with StreamUnavailable; the busy suite hit it)."""
    monkeypatch.setenv("FT_FRAMES", "1" if wire == "frames" else "0")
    with LighthouseServer(min_replicas=1, http_bind=None) as lighthouse, \
            LighthouseClient(lighthouse.address()) as client:
        stream = client.start_heartbeat_stream("a", interval=timedelta(milliseconds=50))
        assert stream.wait_connected(10)
        call = stream._call
        with caplog.at_level(logging.WARNING, logger="ft_core.control.lighthouse_client"):
            stream._loop.call_soon_threadsafe(time.sleep, stream._stale_after_s + 1.0)  # the loop's thread stalls
            time.sleep(stream._stale_after_s + 1.5)
            wait_for(lambda: asyncio.run_coroutine_threadsafe(asyncio.sleep(0), stream._loop).result(5) is None, 10)
            time.sleep(0.5)  # a few beats after the stall
        assert "stopped answering" not in caplog.text
        assert stream._call is call and stream.connected, "the stream was reopened"
        assert stream.quorum(QuorumMember("a", address="127.0.0.1:1"), 10 * SECOND).replica_ids == ["a"]


@pytest.mark.timeout(60)
def test_a_shrink_only_call_from_outside_the_last_quorum_is_answered_at_once_on_both_wires() -> None:
    """Rule 2 keeps a shrink-only quorum (a redo of a step) to the previous quorum's members. A group frozen in
    its step's collective wakes up behind a quorum the others formed without it, and asks for a redo: no
    quorum can include it. It used to wait out its whole quorum deadline (tests/test_push_failures.py's frozen
    group once waited 59.8 s, then healed), keeping joiners out of the others' rounds meanwhile. Now it is
    answered at once, over a unary call and over its heartbeat stream, with the reason, and no retry."""
    with LighthouseServer(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=5_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        first = client.quorum(QuorumMember("a", step=9), 10 * SECOND)
        assert first.replica_ids == ["a"]
        stream = client.start_heartbeat_stream("b", interval=timedelta(milliseconds=50))
        answers: dict[str, object] = {}
        try:
            assert stream.wait_connected(10)
            redo = QuorumMember("b", step=3, shrink_only=True)
            with pytest.raises(RPCError) as unary:
                client.quorum(redo, 60 * SECOND)
            with pytest.raises(RPCError) as streamed:
                stream.quorum(redo, 60 * SECOND)
            for error in (unary.value, streamed.value):
                assert error.code == "FAILED_PRECONDITION", error
                assert f"not a member of the last quorum {first.quorum_id} (a)" in str(error), error
            assert not (member_of(server.core.status(), "b") or {}).get("waiting"), "nothing of it is left waiting"
            # Its next quorum, as any joiner's: it takes part (and heals from a).
            rejoin = threading.Thread(target=lambda: answers.update(b=stream.quorum(QuorumMember("b", step=3),
                                                                                    30 * SECOND)))
            rejoin.start()
            wait_for(lambda: (member_of(server.core.status(), "b") or {}).get("waiting"), what="b's next call")
            answers["a"] = client.quorum(QuorumMember("a", step=10), 30 * SECOND)
            rejoin.join(15)
        finally:
            stream.stop()
        assert sorted(answers) == ["a", "b"], answers
        assert all(isinstance(q, Quorum) and q.replica_ids == ["a", "b"] for q in answers.values()), answers


@pytest.mark.timeout(60)
def test_a_redo_whose_quorum_lost_too_many_members_for_min_replicas_is_answered_at_once_and_keeps_no_joiner_out(
) -> None:
    """min_replicas 2; the last quorum is {a, c} and c is lost. a's redo of its step (shrink-only: the last
    quorum's members only) can never reach 2, and it kept b, a healthy group waiting for a quorum, out of
    every round until a's quorum deadline (found by a Lightning test with 3 groups: the survivor of a
    2-group quorum waited 89.5 s, then lost the step anyway). Now a is answered at once with the reason, and
    its next quorum, with b, forms."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=60_000, quorum_tick_ms=50, heartbeat_timeout_ms=1_000,
                          http_bind=None) as server, LighthouseClient(server.address()) as client:
        streams = {rid: client.start_heartbeat_stream(rid, interval=timedelta(milliseconds=50)) for rid in "acb"}
        answers: dict[str, object] = {}
        try:
            assert all(s.wait_connected(10) for s in streams.values())
            streams["b"].stop()  # b comes later
            first = run_calls([lambda: streams["a"].quorum(QuorumMember("a", step=4), 10 * SECOND),
                               lambda: streams["c"].quorum(QuorumMember("c", step=4), 10 * SECOND)])
            assert all(isinstance(q, Quorum) and q.replica_ids == ["a", "c"] for q, _ in first), first
            streams["c"].stop()  # c is lost
            wait_for(lambda: not (member_of(server.core.status(), "c") or {}).get("healthy"), what="c lost")
            streams["b"] = client.start_heartbeat_stream("b", interval=timedelta(milliseconds=50))
            assert streams["b"].wait_connected(10)
            joiner = threading.Thread(target=lambda: answers.update(b=streams["b"].quorum(QuorumMember("b", step=0),
                                                                                         30 * SECOND)))
            joiner.start()
            wait_for(lambda: (member_of(server.core.status(), "b") or {}).get("waiting"), what="b's call")
            asked = time.monotonic()
            with pytest.raises(RPCError) as redo:
                streams["a"].quorum(QuorumMember("a", step=5, shrink_only=True), 30 * SECOND)
            assert time.monotonic() - asked < 10, "the redo waited for its deadline"
            assert redo.value.code == "FAILED_PRECONDITION", redo.value
            assert f"only 1 member(s) of the last quorum {first[0][0].quorum_id} are still heartbeating (a), fewer " \
                   "than min_replicas 2" in str(redo.value), redo.value
            answers["a"] = streams["a"].quorum(QuorumMember("a", step=5), 30 * SECOND)
            joiner.join(15)
        finally:
            for s in streams.values():
                s.stop()
        assert sorted(answers) == ["a", "b"], answers
        assert all(isinstance(q, Quorum) and q.replica_ids == ["a", "b"] for q in answers.values()), answers
