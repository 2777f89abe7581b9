"""Manager server behaviour against a real lighthouse on loopback: aggregation of the group's
Quorum calls, the step-keyed commit barrier, checkpoint metadata, validation, tokens and Kill."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
from conftest import run_calls

from ft_core.errors import AuthError, ConfigError, FTTimeoutError, RPCError
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_server import ManagerClient, ManagerServer, QuorumResult
from ft_core.control.proto import ft_pb2, ft_pb2_grpc

TIMEOUT = timedelta(seconds=5)




@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    with LighthouseServer(min_replicas=1, join_timeout_ms=100, http_bind=None) as server:
        yield server


WIRES = ["grpc", "frames"]  # the same calls on gRPC and on the frames wire (ft_core.control.frames)


def frames_of(server: ManagerServer, wire: str) -> str:
    """The frames address a client of `wire` is given ("": it keeps to gRPC)."""
    return server.frames_address() if wire == "frames" else ""


@pytest.fixture(params=WIRES)
def group(request: pytest.FixtureRequest, lighthouse: LighthouseServer
          ) -> Iterator[tuple[ManagerServer, list[ManagerClient]]]:
    """A replica group of two ranks: its server and one client per rank, on each wire."""
    with ManagerServer("group_a", lighthouse.address(), store_addr="127.0.0.1:1234", world_size=2) as server:
        assert server.frames_address() and server.frames_address() != server.address()
        clients = [ManagerClient(server.address(), frames_addr=frames_of(server, request.param)) for _ in range(2)]
        try:
            yield server, clients
        finally:
            for c in clients:
                c.close()


def quorum_calls(clients: list[ManagerClient], steps: list[int], metadata: str = "ckpt",
                 timeout: timedelta = TIMEOUT, **kwargs: Any) -> list[Callable[[], Any]]:
    return [lambda r=r: clients[r].quorum(r, steps[r], f"{metadata}-{r}", False, timeout, **kwargs)
            for r in range(len(clients))]


def test_every_rank_gets_its_own_plan_from_one_lighthouse_quorum(group: tuple[ManagerServer, list[ManagerClient]],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    server, clients = group
    with caplog.at_level(logging.INFO, logger="ft_core.control.manager_server"):
        results = [r for r, _ in run_calls(quorum_calls(clients, [3, 3]))]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO], "a healthy round logs nothing"
    assert all(isinstance(r, QuorumResult) for r in results), results
    first, second = results
    assert first.quorum_id == second.quorum_id >= 1
    assert first.replica_ids == second.replica_ids == ["group_a"]
    assert (first.replica_rank, first.replica_world_size, first.max_step, first.max_replica_rank) == (0, 1, 3, 0)
    assert first.store_address == "127.0.0.1:1234"
    assert not first.heal and first.recover_src_replica_rank is None and first.recover_dst_replica_ranks == []
    assert server.last_quorum_id() == first.quorum_id
    # The metadata each rank registered is what a healing peer's same rank will ask for.
    assert clients[0].checkpoint_metadata(1, TIMEOUT) == "ckpt-1"
    assert server.checkpoint_metadata_local(0) == "ckpt-0"


def test_local_fast_path_and_client_join_the_same_round(group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    server, clients = group
    local = lambda: server.quorum_local(0, 2, "local-0", False, TIMEOUT)  # noqa: E731
    remote = lambda: clients[1].quorum(1, 2, "remote-1", False, TIMEOUT)  # noqa: E731
    (a, _), (b, _) = run_calls([local, remote])
    assert isinstance(a, QuorumResult) and isinstance(b, QuorumResult)
    assert a.quorum_id == b.quorum_id
    (x, _), (y, _) = run_calls([lambda: server.should_commit_local(0, 2, True, TIMEOUT),
                                lambda: clients[1].should_commit(1, 2, True, TIMEOUT)])
    assert x is True and y is True


def test_ranks_reporting_different_steps_all_get_an_error_naming_both(group: tuple[ManagerServer,
                                                                                   list[ManagerClient]]) -> None:
    _, clients = group
    results = run_calls(quorum_calls(clients, [4, 5]))
    for err, _ in results:
        assert isinstance(err, RPCError) and err.code == "FAILED_PRECONDITION", err
        assert "step 4" in str(err) and "step 5" in str(err)
    # The group recovers once its ranks agree.
    assert all(isinstance(r, QuorumResult) for r, _ in run_calls(quorum_calls(clients, [5, 5])))


def test_a_rank_alone_times_out_naming_the_missing_rank_and_leaves_no_stale_call(
        group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    _, clients = group
    with pytest.raises(FTTimeoutError, match=r"group rank\(s\) \[1\]"):
        clients[0].quorum(0, 1, "x", False, timedelta(seconds=2))  # answered 0.5 s before the caller's deadline
    # Had the timed-out call stayed in the round, rank 1 alone would complete it and rank 0's next call would hang.
    results = run_calls(quorum_calls(clients, [1, 1]))
    assert all(isinstance(r, QuorumResult) for r, _ in results), results


COMMIT_VOTES = [
    pytest.param([True, True], True, id="all-true"),
    pytest.param([True, False], False, id="one-false"),
    pytest.param([False, False], False, id="all-false"),
]


@pytest.mark.parametrize(("votes", "decision"), COMMIT_VOTES)
def test_should_commit_is_the_and_of_the_group_votes(group: tuple[ManagerServer, list[ManagerClient]],
                                                     votes: list[bool], decision: bool) -> None:
    _, clients = group
    results = run_calls([lambda r=r: clients[r].should_commit(r, 7, votes[r], TIMEOUT) for r in range(2)])
    assert [r for r, _ in results] == [decision, decision]


def test_should_commit_for_another_step_is_an_error_for_every_rank(group: tuple[ManagerServer,
                                                                                list[ManagerClient]]) -> None:
    _, clients = group
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(_catch(lambda: clients[0].should_commit(0, 8, True,
                                                                                                    TIMEOUT))),
                             name="test-rank-0")
    first.start()
    time.sleep(0.3)  # rank 0's vote for step 8 is now in progress
    with pytest.raises(RPCError, match="step 9.*step 8") as info:
        clients[1].should_commit(1, 9, True, TIMEOUT)
    assert info.value.code == "FAILED_PRECONDITION"
    first.join(10)
    assert isinstance(results[0], RPCError) and "step 8" in str(results[0]) and "step 9" in str(results[0])
    # The barrier is usable again afterwards.
    assert [r for r, _ in run_calls([lambda r=r: clients[r].should_commit(r, 9, True, TIMEOUT)
                                     for r in range(2)])] == [True, True]


def test_should_commit_times_out_when_a_rank_never_votes(group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    _, clients = group
    with pytest.raises(FTTimeoutError, match=r"group rank\(s\) \[0\] did not vote"):
        clients[1].should_commit(1, 3, True, timedelta(seconds=1))
    assert [r for r, _ in run_calls([lambda r=r: clients[r].should_commit(r, 3, False, TIMEOUT)
                                     for r in range(2)])] == [False, False]


def test_world_size_one_commit_vote_is_local(lighthouse: LighthouseServer) -> None:
    with ManagerServer("solo", lighthouse.address(), world_size=1) as server:
        assert server.should_commit_local(0, 0, True, TIMEOUT) is True
        assert server.should_commit_local(0, 1, False, TIMEOUT) is False
        result = server.quorum_local(0, 0, "m", False, TIMEOUT)
        assert result.replica_ids == ["solo"] and not result.heal


def _stream_loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "ftl-heartbeat-streams"}


def test_the_stream_loop_thread_ends_with_the_last_server_using_it(lighthouse: LighthouseServer) -> None:
    before = _stream_loop_threads()  # a loop held by something else stays, and is shared
    with ManagerServer("loop_a", lighthouse.address()) as a, ManagerServer("loop_b", lighthouse.address()) as b:
        assert a.wait_heartbeat_connected(TIMEOUT) and b.wait_heartbeat_connected(TIMEOUT)
        assert len(_stream_loop_threads()) == 1
    assert _stream_loop_threads() <= before


def _catch(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # returned for the test to assert on
        return exc


BAD_REQUESTS = [
    pytest.param(lambda c: c.quorum(2, 0, "", False, TIMEOUT), "unknown group rank 2", id="quorum-rank-too-big"),
    pytest.param(lambda c: c.quorum(-1, 0, "", False, TIMEOUT), "unknown group rank -1", id="quorum-rank-negative"),
    pytest.param(lambda c: c.quorum(0, -3, "", False, TIMEOUT), "step must be >= 0", id="quorum-negative-step"),
    pytest.param(lambda c: c.quorum(0, 0, "x" * (64 * 1024 + 1), False, TIMEOUT), "limit is 65536",
                 id="quorum-oversized-metadata"),
    pytest.param(lambda c: c.quorum(0, 0, "", False, TIMEOUT, commit_failures=-1), "commit_failures",
                 id="quorum-negative-commit-failures"),
    pytest.param(lambda c: c.should_commit(5, 0, True, TIMEOUT), "unknown group rank 5", id="commit-bad-rank"),
    pytest.param(lambda c: c.should_commit(0, -1, True, TIMEOUT), "step must be >= 0", id="commit-negative-step"),
    pytest.param(lambda c: c.checkpoint_metadata(9, TIMEOUT), "unknown group rank 9", id="metadata-bad-rank"),
]


@pytest.mark.parametrize(("bad_call", "message"), BAD_REQUESTS)
def test_malformed_requests_are_invalid_argument_and_the_server_keeps_serving(
        group: tuple[ManagerServer, list[ManagerClient]], bad_call: Callable[[ManagerClient], Any],
        message: str) -> None:
    _, clients = group
    with pytest.raises(RPCError, match=message) as info:
        bad_call(clients[0])
    assert info.value.code == "INVALID_ARGUMENT"
    assert all(isinstance(r, QuorumResult) for r, _ in run_calls(quorum_calls(clients, [0, 0])))


def test_checkpoint_metadata_of_a_rank_that_never_called_quorum_is_not_found(
        group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    _, clients = group
    with pytest.raises(RPCError, match="has not called Quorum") as info:
        clients[0].checkpoint_metadata(1, TIMEOUT)
    assert info.value.code == "NOT_FOUND"


def test_a_call_without_a_deadline_is_rejected(group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    server, _ = group
    with grpc.insecure_channel(server.address()) as channel:
        stub = ft_pb2_grpc.ManagerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ShouldCommit(ft_pb2.ShouldCommitRequest(group_rank=0, step=0, should_commit=True))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "missing deadline" in info.value.details()


@pytest.mark.parametrize("wire", WIRES)
def test_wrong_or_missing_token_is_rejected_and_the_right_one_works(wire: str) -> None:
    with LighthouseServer(min_replicas=1, join_timeout_ms=100, http_bind=None, token="s3cret") as lh, \
            ManagerServer("tok", lh.address(), world_size=1, token="s3cret") as server:
        for token in (None, "wrong"):
            with ManagerClient(server.address(), token=token, frames_addr=frames_of(server, wire)) as client:
                with pytest.raises(AuthError, match="token"):
                    client.quorum(0, 0, "", False, TIMEOUT)
        with ManagerClient(server.address(), token="s3cret", frames_addr=frames_of(server, wire)) as client:
            result = client.quorum(0, 0, "", False, TIMEOUT)
            assert result.replica_ids == ["tok"]


def test_kill_is_refused_without_a_token(group: tuple[ManagerServer, list[ManagerClient]]) -> None:
    _, clients = group
    with pytest.raises(RPCError, match="Kill refused") as info:
        clients[0].kill("please", TIMEOUT)
    assert info.value.code == "PERMISSION_DENIED"
    assert all(isinstance(r, QuorumResult) for r, _ in run_calls(quorum_calls(clients, [0, 0])))


KILL_CHILD = """
import sys, time
from ft_core.control.manager_server import ManagerServer
server = ManagerServer("victim", sys.argv[1], world_size=1, token="s3cret")
print(server.address(), flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_kill_with_the_token_exits_the_hosting_process(processes: Any) -> None:
    with LighthouseServer(min_replicas=1, http_bind=None, token="s3cret") as lh:
        child = processes.python("-c", KILL_CHILD, lh.address(), stdout=subprocess.PIPE, text=True)
        address = child.stdout.readline().strip()
        assert address, "child manager server did not start"
        with ManagerClient(address, token="s3cret") as client:
            client.kill("test says goodbye", TIMEOUT)
        assert child.wait(timeout=10) == 1


CONFIG_ERRORS = [
    pytest.param(dict(replica_id="", lighthouse_addr="127.0.0.1:1"), "replica_id", id="empty-replica-id"),
    pytest.param(dict(replica_id="a", lighthouse_addr=""), "lighthouse address", id="no-lighthouse"),
    pytest.param(dict(replica_id="a", lighthouse_addr="127.0.0.1:1", world_size=0), "world_size", id="world-size-0"),
    pytest.param(dict(replica_id="a", lighthouse_addr="127.0.0.1:1", quorum_retries=-1), "quorum_retries",
                 id="negative-retries"),
]


@pytest.mark.parametrize(("kwargs", "message"), CONFIG_ERRORS)
def test_bad_configuration_is_a_config_error(kwargs: dict[str, Any], message: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=message):
        ManagerServer(**kwargs)



@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["grpc", "frames", "local"])
def test_shutdown_with_a_lighthouse_long_poll_pending_ends_it_at_once(path: str) -> None:
    """The long poll (50 s left, min_replicas=2 never met) is cancelled: shutdown does not wait for it, and
    the waiting rank gets an error at once instead of at its deadline."""
    with LighthouseServer(min_replicas=2, join_timeout_ms=60_000, http_bind=None) as lighthouse:
        server = ManagerServer("lonely", lighthouse.address(), world_size=1)
        client = ManagerClient(server.address(), connect_timeout=5, frames_addr=frames_of(server, path))
        outcome: list[BaseException | QuorumResult] = []

        def join() -> None:
            try:
                if path != "local":
                    outcome.append(client.quorum(0, 0, "", False, timedelta(seconds=50)))
                else:
                    outcome.append(server.quorum_local(0, 0, "", False, timedelta(seconds=50)))
            except BaseException as exc:  # recorded for the assertion below
                outcome.append(exc)

        caller = threading.Thread(target=join, name="lonely-quorum")
        caller.start()
        try:
            def waiting() -> list[str]:
                return [m["replica_id"] for m in lighthouse.core.status()["members"] if m["waiting"]]

            deadline = time.monotonic() + 20
            while not waiting() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waiting() == ["lonely"], "the long poll never reached the lighthouse"
            started = time.monotonic()
            server.shutdown()
            took = time.monotonic() - started
            caller.join(20)
            assert not caller.is_alive(), "the waiting rank was not answered"
            assert took < 20, f"shutdown took {took:.1f}s: it waited for the lighthouse long poll"
            assert outcome and isinstance(outcome[0], (RPCError, FTTimeoutError)), outcome
        finally:
            server.shutdown()
            client.close()
            caller.join(60)


def test_quorum_goes_over_the_heartbeat_stream_and_unary_calls_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    for stream in ("1", "0"):
        monkeypatch.setenv("FT_STREAM_QUORUM", stream)
        with LighthouseServer(min_replicas=1, http_bind=None) as lh, ManagerServer("g", lh.address()) as server, \
                ManagerClient(server.address()) as client:
            assert server.wait_heartbeat_connected(10)
            first = client.quorum(0, 0, "", False, timedelta(seconds=10))
            second = client.quorum(0, 1, "", False, timedelta(seconds=10))
            assert first.quorum_id == second.quorum_id == 1 and server.last_quorum_id() == 1
            used_unary = server._lighthouse is not None
            assert used_unary == (stream == "0"), f"FT_STREAM_QUORUM={stream}: unary client used: {used_unary}"
