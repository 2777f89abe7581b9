"""The frames wire (ft_core.control.frames): the manager server's unary calls on a plain TCP port beside
gRPC. The calls' behaviour on both wires is tested by test_manager_server (its group fixture runs every
test on each); here what only this wire has: its handshake, its bounds, TLS, the fallback to gRPC, and
a port that cannot be reached or is switched off."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest
from conftest import assert_bounded, run_calls

from ft_core.control import frames
from ft_core.control.heartbeat_stream import release_stream_loop, stream_loop
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_server import ManagerClient, ManagerServer, QuorumResult
from ft_core.control.proto import ft_pb2
from ft_core.errors import AuthError, FTTimeoutError, RPCError

TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    with LighthouseServer(min_replicas=1, join_timeout_ms=100, http_bind=None) as server:
        yield server


def raw_reply(address: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Send `data` to a frames port; the status and details of its answer."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        (length,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
        code, details, _ = frames.parse_reply(sock.recv(length, socket.MSG_WAITALL))
        assert sock.recv(1) == b"", "a refused connection is closed"
    return code, details


def test_a_client_that_does_not_greet_or_sends_a_huge_frame_is_refused_and_others_keep_working(
        lighthouse: LighthouseServer) -> None:
    with ManagerServer("g", lighthouse.address()) as server:
        address = server.frames_address()
        assert raw_reply(address, frames._frame(b"GET / HTTP/1.1")) == (grpc.StatusCode.UNIMPLEMENTED,
                                                                          "not a frames client (wrong magic)")
        code, details = raw_reply(address, struct.pack("!I", frames.MAX_FRAME + 1))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over" in details
        unknown = frames.hello(None) + frames.request_frame("Nope", b"", 1.0)
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(unknown)
            (length,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
            code, details, _ = frames.parse_reply(sock.recv(length, socket.MSG_WAITALL))
            assert code == grpc.StatusCode.UNIMPLEMENTED and "'Nope'" in details
        with ManagerClient(server.address(), frames_addr=address) as client:
            assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["g"]


def test_concurrent_calls_of_one_client_each_get_their_own_answer(lighthouse: LighthouseServer) -> None:
    """Two ranks' calls through one client at once (two connections): both answered, one round."""
    with ManagerServer("pair", lighthouse.address(), world_size=2) as server, \
            ManagerClient(server.address(), frames_addr=server.frames_address()) as client:
        results = run_calls([lambda r=r: client.quorum(r, 4, f"m{r}", False, TIMEOUT) for r in range(2)])
        plans = [r for r, _ in results]
        assert all(isinstance(p, QuorumResult) for p in plans), plans
        assert plans[0].quorum_id == plans[1].quorum_id and plans[0].max_step == 4
        votes = run_calls([lambda r=r: client.vote_round(r, 4, r == 0, False, TIMEOUT) for r in range(2)])
        assert [v for v, _ in votes] == [(False, False, False)] * 2


def test_an_unreachable_frames_port_falls_back_to_grpc_with_a_warning(
        lighthouse: LighthouseServer, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as closed:  # a port nobody listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    with ManagerServer("g", lighthouse.address()) as server, \
            ManagerClient(server.address(), frames_addr=dead) as client, caplog.at_level(logging.WARNING):
        started = time.monotonic()
        assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["g"]
        assert client.should_commit(0, 0, True, TIMEOUT)
        assert_bounded(started, frames.CONNECT_S + 5)
    warnings = [r.getMessage() for r in caplog.records if "frames port" in r.getMessage()]
    assert len(warnings) == 1 and "FT_MANAGER_FRAMES_PORT" in warnings[0] and "gRPC port" in warnings[0], warnings


def test_frames_off_serves_and_uses_grpc_only(lighthouse: LighthouseServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_FRAMES", "0")
    with ManagerServer("g", lighthouse.address()) as server:
        assert server.frames_address() == ""
        with ManagerClient(server.address(), frames_addr="127.0.0.1:1") as client:  # ignored when off
            assert client._frames is None
            assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["g"]


def test_a_fixed_frames_port_is_used_and_a_taken_one_keeps_the_group_on_grpc(
        lighthouse: LighthouseServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("FT_MANAGER_FRAMES_PORT", str(taken.getsockname()[1]))
        with caplog.at_level(logging.WARNING), ManagerServer("g", lighthouse.address()) as server:
            assert server.frames_address() == ""
            with ManagerClient(server.address(), frames_addr=server.frames_address()) as client:
                assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["g"]
        assert any("could not be bound" in r.getMessage() for r in caplog.records)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    monkeypatch.setenv("FT_MANAGER_FRAMES_PORT", str(free))
    with ManagerServer("h", lighthouse.address()) as server:
        assert server.frames_address() == f"127.0.0.1:{free}"


def test_a_stopped_server_fails_a_waiting_call_at_once_and_the_next_call_clearly(
        lighthouse: LighthouseServer) -> None:
    """A rank waits for its group's second rank; the server stops: the waiting call ends now, not at
    its deadline, and a later call gets an error naming the peer within the connect bound."""
    server = ManagerServer("g2", lighthouse.address(), world_size=2)
    client = ManagerClient(server.address(), frames_addr=server.frames_address())
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(_catch(client.quorum, 0, 0, "", False, 30.0)),
                              name="frames-waiting-rank")
    try:
        caller.start()
        time.sleep(0.3)
        started = time.monotonic()
        server.shutdown()
        caller.join(15)
        assert not caller.is_alive() and isinstance(outcome[0], RPCError), outcome
        assert_bounded(started, 10, "the waiting call's end")
        started = time.monotonic()
        with pytest.raises((RPCError, FTTimeoutError), match="manager server"):
            client.quorum(0, 1, "", False, 30.0)
        assert_bounded(started, frames.CONNECT_S + 12, "the call to a stopped server")
    finally:
        server.shutdown()
        client.close()
        caller.join(30)


def _catch(fn, *args):  # noqa: ANN001, ANN002, ANN202 - a thread's outcome, value or error
    try:
        return fn(*args)
    except Exception as exc:  # recorded for the assertion
        return exc


def test_the_frames_wire_uses_tls_when_the_job_does(tls_env: dict[str, str]) -> None:
    with LighthouseServer(min_replicas=1, join_timeout_ms=0, http_bind=None, token="tok") as lh, \
            ManagerServer("tls", lh.address(), world_size=1, token="tok") as server:
        with ManagerClient(server.address(), token="tok", frames_addr=server.frames_address()) as client:
            assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["tls"]
            assert client._frames is not None, "the call fell back to gRPC"
        with ManagerClient(server.address(), token="wrong", frames_addr=server.frames_address()) as client:
            with pytest.raises(AuthError, match="token"):
                client.quorum(0, 1, "", False, TIMEOUT)
        plain = frames.FrameClient(server.frames_address(), "tok", "plain", tls=frames.rpc.TLSConfig())
        started = time.monotonic()
        with pytest.raises((RPCError, FTTimeoutError)):  # plaintext to a TLS port is never served
            plain.call("ShouldCommit", ft_pb2.ShouldCommitRequest(group_rank=0, step=0).SerializeToString(), 3.0)
        assert_bounded(started, 8, "a plaintext call to a TLS port")
        plain.close()


# ------------------------------------------------------------------ the lighthouse's heartbeat streams


def stream_of(server: ManagerServer):  # noqa: ANN201 - the group's HeartbeatStreamHandle
    return server._heartbeat


def test_heartbeat_streams_and_their_quorums_go_on_the_lighthouse_frames_port() -> None:
    with LighthouseServer(min_replicas=2, join_timeout_ms=5_000, http_bind=None) as lighthouse, \
            ManagerServer("a", lighthouse.address()) as a, ManagerServer("b", lighthouse.address()) as b:
        assert lighthouse.frames_port
        for server in (a, b):
            assert server.wait_heartbeat_connected(10)
            handle = stream_of(server)
            assert handle._frames_ports == {lighthouse.address(): lighthouse.frames_port}
            assert not handle._channels, "an idle gRPC channel was kept beside the frames stream"
        plans = run_calls([lambda s=s: ManagerClient(s.address(), frames_addr=s.frames_address()).quorum(
            0, 0, "", False, TIMEOUT) for s in (a, b)])
        assert [p.replica_ids for p, _ in plans] == [["a", "b"], ["a", "b"]], plans
        assert all(m["replica_id"] in ("a", "b") for m in lighthouse.core.status()["members"])


def test_a_member_whose_stream_drops_is_lost_at_once_on_the_frames_wire() -> None:
    """The other member gets its PeerLost notice as on gRPC: the dropped connection is the death."""
    lost: list[tuple[int, str]] = []
    got = threading.Event()
    with LighthouseServer(min_replicas=2, join_timeout_ms=5_000, http_bind=None) as lighthouse, \
            ManagerServer("keep", lighthouse.address()) as keep:
        keep.add_failure_listener(lambda q, r: (lost.append((q, r)), got.set()))
        gone = ManagerServer("gone", lighthouse.address())
        try:
            plans = run_calls([lambda s=s: s.quorum_local(0, 0, "", False, TIMEOUT) for s in (keep, gone)])
            assert [p.replica_ids for p, _ in plans] == [["gone", "keep"]] * 2, plans
            handle = stream_of(gone)
            started = time.monotonic()
            with handle._lock:
                call = handle._call
            handle._loop.call_soon_threadsafe(call.cancel)  # the connection drops, no goodbye
            assert got.wait(10), "no PeerLost notice"
            assert_bounded(started, 3, "the PeerLost notice")
            assert lost[0][1] == "gone"
        finally:
            gone.shutdown()


def test_an_unreachable_lighthouse_frames_port_keeps_the_stream_on_grpc(
        lighthouse: LighthouseServer, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    asyncio.run_coroutine_threadsafe(lighthouse._frames.stop(), lighthouse._loop).result(10)  # port refuses now
    with caplog.at_level(logging.WARNING), ManagerServer("g", lighthouse.address()) as server:
        assert server.wait_heartbeat_connected(10)
        assert stream_of(server)._frames_ports == {lighthouse.address(): 0}
        with ManagerClient(server.address(), frames_addr=server.frames_address()) as client:
            assert client.quorum(0, 0, "", False, TIMEOUT).replica_ids == ["g"]
    warnings = [r.getMessage() for r in caplog.records if "frames port" in r.getMessage()]
    assert warnings and "FT_LIGHTHOUSE_FRAMES_PORT" in warnings[0], warnings


@pytest.mark.parametrize("side", ["lighthouse", "member"])
def test_frames_off_on_either_side_keeps_the_stream_on_grpc(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if side == "lighthouse":
        monkeypatch.setenv("FT_FRAMES", "0")
    with LighthouseServer(min_replicas=1, join_timeout_ms=100, http_bind=None) as lh:
        monkeypatch.setenv("FT_FRAMES", "0" if side == "member" else "1")
        assert bool(lh.frames_port) == (side == "member")
        with ManagerServer("g", lh.address()) as server:
            assert server.wait_heartbeat_connected(10)
            assert stream_of(server)._frames_ports.get(lh.address(), 0) == 0
            assert server.quorum_local(0, 0, "", False, TIMEOUT).replica_ids == ["g"]


def test_the_loop_client_calls_and_fails_as_the_thread_client_does(lighthouse: LighthouseServer) -> None:
    """AsyncFrameClient (code on an asyncio loop, the benchmarks' groups): an answer, a refused token, a
    deadline, and a server that went away, each as the blocking client raises it."""
    import asyncio

    with ManagerServer("loop", lighthouse.address(), world_size=2, token="tok") as server:
        request = ft_pb2.ManagerQuorumRequest(group_rank=0, step=0).SerializeToString()

        async def scenario() -> list[object]:
            outcomes: list[object] = []
            good = frames.AsyncFrameClient(server.frames_address(), "tok", "manager server loop")
            started = time.monotonic()
            outcomes.append(await _async_catch(good.call("Quorum", request, 0.5)))  # rank 1 never comes
            outcomes.append(time.monotonic() - started)
            bad = frames.AsyncFrameClient(server.frames_address(), "wrong", "manager server loop")
            outcomes.append(await _async_catch(bad.call("Quorum", request, 2.0)))
            server.shutdown()
            outcomes.append(await _async_catch(good.call("Quorum", request, 2.0)))
            good.close()
            return outcomes

        timed_out, took, refused, gone = asyncio.run(scenario())
    assert isinstance(timed_out, FTTimeoutError) and took < 0.5 + 5, (timed_out, took)
    assert isinstance(refused, AuthError) and "token" in str(refused), refused
    assert isinstance(gone, RPCError) and "manager server loop" in str(gone), gone


async def _async_catch(work):  # noqa: ANN001, ANN202 - the call's value or error
    try:
        return await work
    except Exception as exc:  # recorded for the assertion
        return exc


@pytest.mark.parametrize(("bind", "port"), [("0.0.0.0:29510", "29512"), ("127.0.0.1:0", "0"), ("[::1]:7000", "7002")])
def test_ftl_lighthouse_puts_its_frames_port_two_above_its_grpc_port(bind: str, port: str) -> None:
    from ft_core.control.lighthouse import frames_port_for

    assert frames_port_for(bind) == port


def test_a_connection_that_never_says_hello_is_closed(lighthouse: LighthouseServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "HELLO_S", 0.3)
    with ManagerServer("g", lighthouse.address()) as server:
        host, port = server.frames_address().rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            started = time.monotonic()
            (length,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
            code, details, _ = frames.parse_reply(sock.recv(length, socket.MSG_WAITALL))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no hello" in details
            assert sock.recv(1) == b""
            assert_bounded(started, 3, "closing a silent connection")


class _Collect(frames.FrameReader):
    """A FrameReader that keeps what it reads, fed the way asyncio feeds a BufferedProtocol."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []
        self.too_long: list[int] = []

    def frame_received(self, body: bytes) -> None:
        self.bodies.append(body)

    def frame_too_long(self, length: int) -> None:
        self.too_long.append(length)

    def feed(self, data: bytes) -> None:
        while data:
            buf = self.get_buffer(-1)
            n = min(len(buf), len(data))
            assert n > 0, "get_buffer must always offer room"
            buf[:n] = data[:n]
            del buf
            self.buffer_updated(n)
            data = data[n:]


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 100, 8191, 1 << 20])
def test_the_frame_reader_splits_any_byte_stream_into_its_frames(chunk: int) -> None:
    """Frames of 0 bytes to 3x the first buffer, arriving in reads of any size (split inside the length, inside
    a body, or many per read), come out whole and in order; the buffer grows for a long one."""
    bodies = [b"", b"x", bytes(range(256)) * 3, b"y" * (3 * frames.FrameReader._FIRST_BUFFER + 17), b"z" * 1000, b"end"]
    wire = b"".join(frames._frame(body) for body in bodies)
    reader = _Collect()
    for i in range(0, len(wire), chunk):
        reader.feed(wire[i:i + chunk])
    assert reader.bodies == bodies and reader.too_long == []
    reader.feed(wire)  # the buffer, grown and drained, is reused
    assert reader.bodies == bodies * 2


def test_the_frame_reader_stops_at_a_frame_over_the_cap_and_ignores_what_follows() -> None:
    reader = _Collect()
    reader.feed(frames._frame(b"ok") + struct.pack("!I", frames.MAX_FRAME + 1) + frames._frame(b"after"))
    assert reader.bodies == [b"ok"] and reader.too_long == [frames.MAX_FRAME + 1]
    reader.feed(frames._frame(b"later"))
    assert reader.bodies == [b"ok"], "a refused connection reads nothing more"


def test_the_mailbox_hands_items_over_in_order_and_survives_a_cancelled_get() -> None:
    import asyncio

    async def scenario() -> list[object]:
        box = frames.Mailbox(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        waiting.cancel()  # a reader that gave up leaves no waiter behind
        with pytest.raises(asyncio.CancelledError):
            await waiting
        getter = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        for item in (1, 2, 3):
            box.put_nowait(item)
        got = [await getter, await box.get(), box.get_nowait()]
        assert box.empty()
        return got

    assert asyncio.run(scenario()) == [1, 2, 3]


def test_the_blocking_client_reads_a_reply_that_arrives_in_pieces_and_fails_on_a_cut_one() -> None:
    body = frames.reply_frame(grpc.StatusCode.OK, "", b"x" * 100_000)  # longer than one first read
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=lambda: [b.sendall(body[i:i + 3]) or time.sleep(0.0005)
                                                  for i in range(0, 12, 3)] + [b.sendall(body[12:])])
        sender.start()
        a.settimeout(5)
        assert frames._read_frame(a, time.monotonic() + 5) == body[4:]
        sender.join(5)
        b.sendall(body[:50])
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(EOFError):
            frames._read_frame(a, time.monotonic() + 5)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The process's stream loop, as the manager servers run their frames port on it."""
    loop = stream_loop()
    try:
        yield loop
    finally:
        release_stream_loop(loop)


def test_a_stopping_server_sends_the_answers_of_calls_in_flight_within_its_grace(
        loop: asyncio.AbstractEventLoop) -> None:
    """A group's last commit round is decided for every rank, but a remote rank's answer may still be on
    its way when the local rank goes on to stop the server (a busy machine delays the handler thread):
    the stop lets calls in flight answer within its grace, refuses new ones, and cuts what outlasts it."""
    async def slow(request: bytes, context: object) -> bytes:
        await asyncio.sleep(float(request))
        return b"answered " + request

    server = frames.FrameServer({"/t.S/Slow": grpc.unary_unary_rpc_method_handler(slow)}, None)
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(10)
    clients = [frames.FrameClient(f"127.0.0.1:{port}", None, "test server") for _ in range(3)]
    outcome: dict[str, object] = {}
    callers = [threading.Thread(target=lambda c=c, d=d: outcome.update({d: _catch(c.call, "Slow", d.encode(), 30.0)}))
               for c, d in zip(clients, ["0.3", "5"])]
    try:
        for caller in callers:
            caller.start()
        deadline = time.monotonic() + 10
        while len(server._calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        asyncio.run_coroutine_threadsafe(server.stop(grace=1.5), loop).result(10)
        assert_bounded(started, 5, "the stop")
        for caller in callers:
            caller.join(10)
        assert outcome["0.3"] == b"answered 0.3", outcome
        assert isinstance(outcome["5"], RPCError) and outcome["5"].code == "UNAVAILABLE", outcome
        with pytest.raises(RPCError, match="test server"):
            clients[2].call("Slow", b"0", 5.0)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        for client in clients:
            client.close()
        for caller in callers:
            caller.join(10)
