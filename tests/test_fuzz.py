"""Fuzzing every network door: malformed messages to the lighthouse (gRPC and HTTP), the manager
server and the checkpoint HTTP server. Each must give a clean error (a gRPC status other than
UNKNOWN/INTERNAL, an HTTP 4xx/5xx, or a closed connection) within a bound, and the server must
keep serving well-formed requests afterwards.

FT_FUZZ_EXAMPLES sets the examples per target (CI default 150; the 10,000-message run recorded in
SECURITY.md used FT_FUZZ_EXAMPLES=1300 over the 8 targets).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_core.checkpointing import HTTPTransport
from ft_core.checkpointing.http_transport import fetch
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_server import ManagerServer
from ft_core.control.proto import ft_pb2, ft_pb2_grpc

EXAMPLES = int(os.environ.get("FT_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                suppress_health_check=list(HealthCheck))
CALL_TIMEOUT_S = 0.3
ANSWER_BOUND_S = 5.0  # generous: the machine is shared; a hang would take far longer
# What a clean rejection looks like. UNKNOWN or INTERNAL would mean an exception escaped a handler.
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OUT_OF_RANGE}

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
TEXT = st.one_of(st.text(max_size=40), st.text(max_size=1500), st.sampled_from(["", "a", "127.0.0.1:1", "\x00", "é"]))


SENT = {"messages": 0}  # malformed (or health-check) messages sent so far


@pytest.fixture(autouse=True)
def count_messages(request):
    """Check that each fuzz test really sent its examples; FT_FUZZ_REPORT=path appends the counts."""
    before = SENT["messages"]
    yield
    sent = SENT["messages"] - before
    assert sent >= min(EXAMPLES // 3, 10), f"{request.node.name} sent only {sent} messages"
    report = os.environ.get("FT_FUZZ_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(f"{request.node.name} {sent}\n")


def count() -> None:
    SENT["messages"] += 1


def unparsable(err: grpc.RpcError) -> bool:
    """grpc's own answer to bytes that are not the method's protobuf (raised before any handler runs)."""
    details = err.details() or ""
    return err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and \
        ("deserializ" in details or "DecodeError" in details)


def outcome(invoke, *args, raw: bool = False, **kwargs) -> str:
    """Call; return 'ok' or the status code name; fail on an unclean status or a slow answer.

    raw: the request is arbitrary bytes, so grpc's parse failure is a clean answer too.
    """
    started = time.monotonic()
    count()
    try:
        invoke(*args, timeout=CALL_TIMEOUT_S, **kwargs)
        result = "ok"
    except grpc.RpcError as err:
        code = err.code()
        assert code in CLEAN or (raw and unparsable(err)), f"unclean status {code}: {err.details()}"
        result = code.name
    assert time.monotonic() - started < ANSWER_BOUND_S
    return result


@pytest.fixture(scope="module")
def lighthouse():
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=0, heartbeat_timeout_ms=200,
                          http_bind="127.0.0.1:0", token=None) as server:
        yield server


@pytest.fixture(scope="module")
def manager_server():
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=0, http_bind=None) as lh:
        with ManagerServer("fuzzed-group", lh.address(), world_size=1, token=None, allow_kill=False) as server:
            yield server


@pytest.fixture(scope="module")
def checkpoint_server():
    transport = HTTPTransport(timeout=timedelta(seconds=3), bind="127.0.0.1:0", token=None)
    transport.send_checkpoint([1], 7, {"w": torch.arange(64, dtype=torch.float32), "n": 3}, timedelta(seconds=3))
    try:
        yield transport
    finally:
        transport.shutdown()


def lighthouse_stub(address: str) -> tuple[grpc.Channel, ft_pb2_grpc.LighthouseServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, ft_pb2_grpc.LighthouseServiceStub(channel)


def assert_lighthouse_serves(server: LighthouseServer) -> None:
    channel, stub = lighthouse_stub(server.address())
    with channel:
        member = ft_pb2.QuorumMember(replica_id=f"healthy-{time.monotonic_ns()}", world_size=1)
        deadline = time.monotonic() + 30
        while True:  # short calls: each one is a fresh heartbeat (the fuzzed members expire meanwhile)
            try:
                response = stub.Quorum(ft_pb2.LighthouseQuorumRequest(requester=member), timeout=1)
                break
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                    raise AssertionError(f"lighthouse no longer issues quorums ({err.code()}: {err.details()}); "
                                         f"status: {server.core.status()}") from None
        assert member.replica_id in [m.replica_id for m in response.quorum.participants]


# ------------------------------------------------------------------ lighthouse gRPC

members = st.builds(ft_pb2.QuorumMember, replica_id=TEXT, address=TEXT, store_address=TEXT, step=INT64,
                    world_size=UINT64, shrink_only=st.booleans(), data=st.text(max_size=70_000),
                    commit_failures=INT64, last_quorum_id=INT64, last_quorum_replica_ids=st.lists(TEXT, max_size=4),
                    rebuild=st.booleans())


def test_lighthouse_survives_malformed_protobuf_values(lighthouse):
    channel, stub = lighthouse_stub(lighthouse.address())

    @FUZZ
    @given(member=st.one_of(st.none(), members), replica_id=TEXT, stream=st.lists(TEXT, max_size=4))
    def fuzz(member, replica_id, stream):
        request = ft_pb2.LighthouseQuorumRequest(requester=member) if member is not None \
            else ft_pb2.LighthouseQuorumRequest()
        outcome(stub.Quorum, request)
        outcome(stub.Heartbeat, ft_pb2.LighthouseHeartbeatRequest(replica_id=replica_id))
        calls = iter([ft_pb2.LighthouseHeartbeatRequest(replica_id=r) for r in stream])
        outcome(lambda timeout: list(stub.HeartbeatStream(calls, timeout=timeout)))

    with channel:
        fuzz()
    assert_lighthouse_serves(lighthouse)


@pytest.mark.parametrize("method", ["Quorum", "Heartbeat", "HeartbeatStream"])
def test_lighthouse_survives_raw_bytes_as_messages(lighthouse, method):
    channel = grpc.insecure_channel(lighthouse.address())
    path = f"/ftl.LighthouseService/{method}"

    @settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
    @given(payload=st.binary(max_size=2048))
    def fuzz(payload):
        if method == "HeartbeatStream":
            call = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            outcome(lambda timeout: list(call(iter([payload, payload]), timeout=timeout)), raw=True)
        else:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            outcome(call, payload, raw=True)

    with channel:
        fuzz()
    assert_lighthouse_serves(lighthouse)


def raw_tcp(address: str, payload: bytes) -> None:
    """Throw bytes at a port; the server must close or ignore them, never crash (checked after)."""
    host, _, port = address.rpartition(":")
    count()
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(1.0)
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionError, OSError):
            pass  # a server that waits for more bytes, or resets us: both fine


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
tcp_payloads = st.one_of(st.binary(max_size=4096), st.binary(max_size=512).map(lambda b: PREFACE + b),
                         st.binary(max_size=256).map(lambda b: b"GET / HTTP/1.1\r\n" + b))


def test_grpc_ports_survive_random_bytes_on_the_socket(lighthouse, manager_server):
    @FUZZ
    @given(payload=tcp_payloads, target=st.sampled_from(["lighthouse", "manager"]))
    def fuzz(payload, target):
        raw_tcp(lighthouse.address() if target == "lighthouse" else manager_server.address(), payload)

    fuzz()
    assert_lighthouse_serves(lighthouse)
    channel = grpc.insecure_channel(manager_server.address())
    with channel:
        stub = ft_pb2_grpc.ManagerServiceStub(channel)
        assert stub.ShouldCommit(ft_pb2.ShouldCommitRequest(group_rank=0, step=1, should_commit=True),
                                 timeout=10).should_commit


# ------------------------------------------------------------------ manager server gRPC

def test_manager_server_survives_malformed_requests(manager_server):
    channel = grpc.insecure_channel(manager_server.address())
    stub = ft_pb2_grpc.ManagerServiceStub(channel)
    small = st.one_of(st.integers(-3, 3), INT64)

    @FUZZ
    @given(rank=small, step=small, meta=st.text(max_size=70_000), flags=st.tuples(st.booleans(), st.booleans()),
           failures=small, vote=st.booleans(), msg=TEXT, raw=st.binary(max_size=512))
    def fuzz(rank, step, meta, flags, failures, vote, msg, raw):
        outcome(stub.Quorum, ft_pb2.ManagerQuorumRequest(group_rank=rank, step=step, checkpoint_metadata=meta,
                                                         shrink_only=flags[0], init_sync=flags[1],
                                                         commit_failures=failures))
        outcome(stub.ShouldCommit, ft_pb2.ShouldCommitRequest(group_rank=rank, step=step, should_commit=vote))
        outcome(stub.CheckpointMetadata, ft_pb2.CheckpointMetadataRequest(group_rank=rank))
        assert outcome(stub.Kill, ft_pb2.KillRequest(msg=msg)) == "PERMISSION_DENIED"  # no token: never allowed
        for method in ("Quorum", "ShouldCommit", "CheckpointMetadata", "Kill"):
            call = channel.unary_unary(f"/ftl.ManagerService/{method}", request_serializer=None,
                                       response_deserializer=None)
            outcome(call, raw, raw=True)

    with channel:
        fuzz()
        assert stub.ShouldCommit(ft_pb2.ShouldCommitRequest(group_rank=0, step=3, should_commit=True),
                                 timeout=10).should_commit


# ------------------------------------------------------------------ HTTP: checkpoints and lighthouse status

METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "GET\x00", "", "CONNECT"])
PATHS = st.one_of(
    st.sampled_from(["/", "/status", "/metrics", "/checkpoint/7/header", "/checkpoint/7/chunk/0",
                     "/checkpoint/7/chunk/99999", "/checkpoint/-1/header", "/checkpoint/99999999999999999999/header",
                     "/replica/x/kill", "/replica//kill", "*", "//../../etc/passwd", "/%00", "/?token=x"]),
    st.builds(lambda s, c: f"/checkpoint/{s}/chunk/{c}", INT64, INT64),
    st.text(max_size=300).map(lambda t: "/" + t))
HEADER_NAMES = st.sampled_from(["Content-Length", "Authorization", "Transfer-Encoding", "Host", "Connection",
                                "Expect", "X-Junk"])
HEADER_VALUES = st.one_of(st.text(max_size=100), st.integers(-5, 10**12).map(str), st.just("chunked"),
                          st.just("100-continue"), st.just("Bearer wrong"))


@st.composite
def http_requests(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=4096))  # not HTTP at all
    method, path = draw(METHODS), draw(PATHS)
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/9", ""]))
    headers = draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6))
    body = draw(st.binary(max_size=2048))
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("utf-8", "replace") + body


def http_exchange(port: int, request: bytes) -> bytes:
    """Send one raw request, half-close, and read what comes back before the server closes or goes quiet."""
    count()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        started = time.monotonic()
        received = b""
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(2.0)
            while len(received) < 1 << 20:
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        except (TimeoutError, ConnectionError, OSError):
            pass
        assert time.monotonic() - started < ANSWER_BOUND_S + 3
    # http.server answers a request without a usable HTTP/1.x version the HTTP/0.9 way: no status line,
    # just the page or its error page ("Error code explanation: 400/505 ...").
    simple = len(request.split(b"\n", 1)[0].split()) < 3 or b"Error code explanation" in received
    if received and not simple:
        assert received.startswith(b"HTTP/1."), received[:100]
        status = int(received.split(b" ", 2)[1])
        assert 100 <= status < 600
    return received


def test_checkpoint_server_survives_random_http(checkpoint_server):
    port = int(checkpoint_server.metadata().rsplit(":", 1)[1])

    @FUZZ
    @given(request=http_requests())
    def fuzz(request):
        http_exchange(port, request)

    fuzz()
    state = fetch(checkpoint_server.metadata(), 7, 10.0)  # a well-formed fetch still works, bit for bit
    assert torch.equal(state["w"], torch.arange(64, dtype=torch.float32)) and state["n"] == 3


def test_lighthouse_http_survives_random_http(lighthouse):
    port = int(lighthouse.http_address().rsplit(":", 1)[1].rstrip("/"))

    @FUZZ
    @given(request=http_requests())
    def fuzz(request):
        http_exchange(port, request)

    fuzz()
    reply = http_exchange(port, b"GET /status HTTP/1.0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.0 200") and b'"quorum_id"' in reply


# ------------------------------------------------------------------ the frames ports (ft_core.control.frames)

MANAGER_METHODS = ["Quorum", "ShouldCommit", "CheckpointMetadata", "Kill", "PeerLostNotices", "Nope", ""]


def frames_exchange(port: int, payload: bytes, half_close: bool = True) -> grpc.StatusCode | None:
    """Send bytes to a frames port (then half-close: the server ends the connection once it has answered
    what it got) and read the first answer: its status (None: closed or quiet). Fails on an unclean
    status or a slow answer."""
    from ft_core.control import frames

    count()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        try:
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            sock.settimeout(1.0)
            head = sock.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return None
            body = sock.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
        except (TimeoutError, ConnectionError, OSError):
            return None
    assert time.monotonic() - started < ANSWER_BOUND_S + 3
    if body[:1] in (frames.STREAM_HEADERS, frames.STREAM_MESSAGE):
        return grpc.StatusCode.OK
    code, details, _ = frames.parse_reply(body[1:] if body[:1] == frames.STREAM_END else body)
    assert code == grpc.StatusCode.OK or code in CLEAN or code == grpc.StatusCode.UNIMPLEMENTED, \
        f"unclean status {code}: {details}"
    return code


def test_frames_ports_survive_random_bytes_and_malformed_frames(lighthouse, manager_server):
    from ft_core.control import frames

    def hello_then(name: str, payload: bytes, timeout_ms: int) -> bytes:
        method = name.encode()
        return frames.hello(None) + frames._frame(timeout_ms.to_bytes(4, "big") + bytes([len(method)]) + method
                                                  + payload)

    ports = {"lighthouse": lighthouse.frames_port, "manager": int(manager_server.frames_address().rsplit(":", 1)[1])}

    @FUZZ
    @given(target=st.sampled_from(sorted(ports)), raw=st.binary(max_size=2048), name=st.sampled_from(
        MANAGER_METHODS + ["HeartbeatStream", "Heartbeat"]), timeout_ms=st.integers(0, 300),
        framed=st.booleans(), stream_tail=st.binary(max_size=256))
    def fuzz(target, raw, name, timeout_ms, framed, stream_tail):
        port = ports[target]
        frames_exchange(port, raw)  # anything at all
        if framed:  # a greeted connection and a random request (for a stream: then a random message)
            assert frames_exchange(port, hello_then(name, raw, timeout_ms) + frames._frame(stream_tail),
                                   half_close=False) is not None, "a greeted request got no answer"

    fuzz()
    assert_lighthouse_serves(lighthouse)
    client = frames.FrameClient(manager_server.frames_address(), None, "fuzzed manager")
    try:
        reply = client.call("ShouldCommit", ft_pb2.ShouldCommitRequest(group_rank=0, step=2, should_commit=True)
                            .SerializeToString(), 10.0)
        assert ft_pb2.ShouldCommitResponse.FromString(reply).should_commit
    finally:
        client.close()
