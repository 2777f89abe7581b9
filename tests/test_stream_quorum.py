"""Quorum long polls carried on the heartbeat stream (LighthouseService.HeartbeatStream with a quorum field).

Real lighthouse, real streams: answers, the deadline on both sides, bad requests answered without
breaking the stream, a lighthouse shutting down, and the manager server's fallback to unary calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from ft_core.errors import FTTimeoutError, RPCError
from ft_core.lighthouse import LighthouseServer
from ft_core.lighthouse_client import LighthouseClient, StreamUnavailable
from ft_core.manager_server import ManagerClient, ManagerServer
from ft_core.types import QuorumMember


def member(replica_id: str, step: int = 0, last_quorum_id: int = 0) -> QuorumMember:
    return QuorumMember(replica_id=replica_id, address=f"{replica_id}:1", store_address="", step=step,
                        world_size=1, last_quorum_id=last_quorum_id)


def waiting(server: LighthouseServer, replica_id: str) -> bool:
    return any(m["replica_id"] == replica_id and m["waiting"] for m in server.core.status()["members"])


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_TOKEN", raising=False)
    monkeypatch.delenv("TORCHFT_TOKEN", raising=False)


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    with LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None) as server:
        yield server


def test_two_replicas_get_the_same_quorum_over_their_streams(lighthouse: LighthouseServer) -> None:
    with LighthouseClient(lighthouse.address()) as client:
        streams = [client.start_heartbeat_stream(rid) for rid in ("a", "b")]
        assert all(s.wait_connected(10) for s in streams)
        results: dict[str, object] = {}

        def join(stream, rid: str) -> None:
            results[rid] = stream.quorum(member(rid, step=3), timeout=10)

        threads = [threading.Thread(target=join, args=(s, rid), name=f"join-{rid}")
                   for s, rid in zip(streams, ("a", "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert results["a"] == results["b"]
        assert [p.replica_id for p in results["a"].participants] == ["a", "b"]
        assert results["a"].quorum_id == 1
        assert all(s.connected for s in streams)  # heartbeats go on after the answer


def test_deadline_ends_the_poll_on_both_sides(lighthouse: LighthouseServer) -> None:
    with LighthouseClient(lighthouse.address()) as client:
        stream = client.start_heartbeat_stream("alone")
        assert stream.wait_connected(10)
        start = time.monotonic()
        with pytest.raises(FTTimeoutError):
            stream.quorum(member("alone"), timeout=0.5)  # min_replicas=2: no quorum
        assert time.monotonic() - start < 0.5 + 2
        deadline = time.monotonic() + 5
        while waiting(lighthouse, "alone") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not waiting(lighthouse, "alone"), "the lighthouse kept the join past its timeout_ms"
        assert stream.connected


def test_bad_request_is_answered_and_the_stream_stays_open(lighthouse: LighthouseServer) -> None:
    with LighthouseClient(lighthouse.address()) as client:
        stream = client.start_heartbeat_stream("a")
        assert stream.wait_connected(10)
        with pytest.raises(RPCError) as err:
            stream.quorum(member("someone-else"), timeout=5)
        assert err.value.code == "INVALID_ARGUMENT"
        assert "heartbeat stream of a" in str(err.value)
        time.sleep(0.3)
        assert stream.connected


def test_lighthouse_shutdown_answers_unavailable() -> None:
    server = LighthouseServer(min_replicas=2, http_bind=None)
    try:
        with LighthouseClient(server.address()) as client:
            stream = client.start_heartbeat_stream("a")
            assert stream.wait_connected(10)
            outcome: list[BaseException] = []

            def join() -> None:
                try:
                    stream.quorum(member("a"), timeout=20)
                except BaseException as exc:  # recorded for the assertion below
                    outcome.append(exc)

            t = threading.Thread(target=join, name="join-a")
            t.start()
            deadline = time.monotonic() + 10
            while not waiting(server, "a") and time.monotonic() < deadline:
                time.sleep(0.02)
            start = time.monotonic()
            server.shutdown()
            t.join(10)
            assert time.monotonic() - start < 10
            assert outcome and isinstance(outcome[0], StreamUnavailable)
            with pytest.raises(StreamUnavailable):
                stream.quorum(member("a"), timeout=1)  # stream down now: the caller must go unary
    finally:
        server.shutdown()


def test_manager_server_uses_the_stream_and_keeps_restart_safety() -> None:
    with LighthouseServer(min_replicas=1, http_bind=None) as lighthouse:
        with ManagerServer("g", lighthouse.address()) as server, ManagerClient(server.address()) as client:
            assert server.wait_heartbeat_connected(10)
            first = client.quorum(0, 0, "", False, timedelta(seconds=10))
            second = client.quorum(0, 1, "", False, timedelta(seconds=10))
            assert first.quorum_id == second.quorum_id == 1
            assert server.last_quorum_id() == 1
            assert server._lighthouse is None, "the unary lighthouse client was used instead of the stream"
            assert server.wait_heartbeat_connected(1)
