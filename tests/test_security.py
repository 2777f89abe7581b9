"""Security: the shared token guards every gRPC method and every HTTP endpoint; optional TLS on every
gRPC and HTTP server; servers bind loopback by default; request sizes are bounded.

Certificates for the TLS tests are made at test time with the `openssl` command (skipped without it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from datetime import timedelta

import grpc
import pytest
import torch
from conftest import child_env

from ft_core.control import rpc
from ft_core.checkpointing import HTTPTransport
from ft_core.checkpointing.http_transport import fetch
from ft_core.errors import AuthError, CheckpointError, ConfigError
from ft_core.control.lighthouse import DEFAULT_BIND, DEFAULT_HTTP_BIND, LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.stores import own_store
from ft_core.control.manager_server import ManagerClient, ManagerServer
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.tools.status import main as status_main
from ft_core.tools.status import status_urls
from ft_core.control.types import QuorumMember

TOKEN = "s3cret-token"
STEP = timedelta(seconds=5)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("FT_TOKEN", "FT_TLS_CERT", "FT_TLS_KEY", "FT_TLS_CA", "FT_ALLOW_KILL"):
        monkeypatch.delenv(var, raising=False)


def status_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def bearer(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token is not None else ()


# ------------------------------------------------------------------ the token, endpoint by endpoint

@pytest.mark.parametrize("presented, accepted", [
    (f"Bearer {TOKEN}", True), ("", False), (f"Bearer {TOKEN[:-1]}", False), (f"Bearer {TOKEN}x", False),
    (f"bearer {TOKEN}", False), (TOKEN, False), (f"Bearer {TOKEN.upper()}", False),
])
def test_token_check_is_exact(presented, accepted):
    assert rpc.token_matches(TOKEN, [("authorization", presented)]) is accepted
    assert rpc.token_matches(None, [("authorization", presented)])  # no token configured: open


def test_every_lighthouse_grpc_method_needs_the_token():
    with LighthouseServer(min_replicas=1, join_timeout_ms=0, http_bind=None, token=TOKEN) as server:
        with grpc.insecure_channel(server.address()) as channel:
            stub = ft_pb2_grpc.LighthouseServiceStub(channel)
            member = ft_pb2.QuorumMember(replica_id="r", world_size=1)

            def calls(token):
                md = bearer(token)
                heartbeat = ft_pb2.LighthouseHeartbeatRequest(replica_id="r")
                return {
                    "Quorum": lambda: stub.Quorum(ft_pb2.LighthouseQuorumRequest(requester=member), timeout=5,
                                                  metadata=md),
                    "Heartbeat": lambda: stub.Heartbeat(heartbeat, timeout=5, metadata=md),
                    "HeartbeatStream": lambda: list(stub.HeartbeatStream(iter([heartbeat]), timeout=5, metadata=md)),
                }

            for token in (None, "wrong", TOKEN + "x"):
                for name, call in calls(token).items():
                    assert status_of(call) == grpc.StatusCode.UNAUTHENTICATED, (name, token)
            for name, call in calls(TOKEN).items():
                assert status_of(call) == grpc.StatusCode.OK, name


def test_every_manager_grpc_method_needs_the_token():
    with LighthouseServer(min_replicas=1, join_timeout_ms=0, http_bind=None, token=TOKEN) as lighthouse, \
            ManagerServer("g", lighthouse.address(), world_size=1, token=TOKEN) as server, \
            grpc.insecure_channel(server.address()) as channel:
        stub = ft_pb2_grpc.ManagerServiceStub(channel)
        requests = {"Quorum": (stub.Quorum, ft_pb2.ManagerQuorumRequest(group_rank=0, step=0)),
                    "ShouldCommit": (stub.ShouldCommit, ft_pb2.ShouldCommitRequest(group_rank=0, step=0)),
                    "CheckpointMetadata": (stub.CheckpointMetadata, ft_pb2.CheckpointMetadataRequest(group_rank=0)),
                    "Kill": (stub.Kill, ft_pb2.KillRequest(msg="not without the token"))}
        for token in (None, "wrong"):
            for name, (method, request) in requests.items():
                code = status_of(lambda: method(request, timeout=5, metadata=bearer(token)))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, token)
        for name in ("Quorum", "ShouldCommit", "CheckpointMetadata"):  # Kill with the token: see the next test
            method, request = requests[name]
            assert status_of(lambda: method(request, timeout=10, metadata=bearer(TOKEN))) == grpc.StatusCode.OK


KILLABLE = """
import sys, time
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.manager_server import ManagerServer
lighthouse = LighthouseServer(min_replicas=1, http_bind=None)
server = ManagerServer("victim", lighthouse.address(), world_size=1)
print(server.address(), flush=True)
time.sleep(120)
"""


def test_kill_rpc_needs_the_token_and_without_a_token_is_refused(processes):
    for token in (TOKEN, None):
        env = child_env(**({"FT_TOKEN": token} if token else {}))
        proc = processes.python("-c", KILLABLE, env=env, stdout=subprocess.PIPE)
        address = proc.stdout.readline().decode().strip()
        assert address, "the child did not start its manager server"
        with grpc.insecure_channel(address) as channel:
            stub = ft_pb2_grpc.ManagerServiceStub(channel)
            kill = ft_pb2.KillRequest(msg="test")
            if token is None:  # no token configured anywhere: Kill cannot be authenticated, so it is refused
                assert status_of(lambda: stub.Kill(kill, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
                assert proc.poll() is None
                continue
            assert status_of(lambda: stub.Kill(kill, timeout=5, metadata=bearer("wrong"))) == \
                grpc.StatusCode.UNAUTHENTICATED
            time.sleep(0.3)
            assert proc.poll() is None, "a Kill with a wrong token ended the process"
            stub.Kill(kill, timeout=5, metadata=bearer(TOKEN))
            assert proc.wait(timeout=10) != 0


def test_checkpoint_fetch_needs_the_token():
    with HTTPTransport(timeout=STEP, token=TOKEN) as source:
        source.send_checkpoint([1], 3, {"w": torch.ones(4)}, STEP)
        for token in (None, "wrong"):
            with pytest.raises(AuthError, match="HTTP 401"):
                fetch(source.metadata(), 3, 5.0, token=token)
        assert torch.equal(fetch(source.metadata(), 3, 5.0, token=TOKEN)["w"], torch.ones(4))


def http(url: str, token: str | None = None, method: str = "GET", context=None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_every_lighthouse_http_route_and_the_kill_action_need_the_token():
    with LighthouseServer(min_replicas=1, http_bind="127.0.0.1:0", token=TOKEN) as server:
        base = server.http_address().rstrip("/")
        for path, method in (("/", "GET"), ("/status", "GET"), ("/metrics", "GET"), ("/replica/any/kill", "POST")):
            for token in (None, "wrong"):
                assert http(base + path, token, method)[0] == 401, (path, token)
        assert http(base + "/status", TOKEN)[0] == 200
        assert http(base + "/replica/nobody/kill", TOKEN, "POST")[0] == 404  # authorized, but no such replica


# ------------------------------------------------------------------ loopback by default, bounded requests

def test_servers_bind_loopback_by_default():
    assert DEFAULT_BIND.startswith("127.0.0.1:") and DEFAULT_HTTP_BIND.startswith("127.0.0.1:")
    store = own_store("127.0.0.1", STEP)  # the TCPStore a one-rank group's Manager hosts
    with LighthouseServer(min_replicas=1) as lighthouse, ManagerServer("g", lighthouse.address()) as manager, \
            HTTPTransport(timeout=STEP) as transport:
        addresses = [lighthouse.address(), lighthouse.http_address(), manager.address(), transport.metadata(),
                     f"127.0.0.1:{store.port}"]
        assert all(rpc.normalize_address(a).startswith("127.0.0.1:") for a in addresses), addresses
        other = outward_address()
        if other is None:
            return
        for address in addresses:
            port = int(address.rstrip("/").rsplit(":", 1)[1])
            with pytest.raises(OSError):  # not reachable through the machine's other interface
                socket.create_connection((other, port), timeout=2).close()


def outward_address() -> str | None:
    """This machine's address on a non-loopback interface, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # no packet is sent; it only picks a route
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_request_sizes_are_bounded():
    too_big = "x" * (rpc.MAX_MESSAGE_BYTES + 1024)
    with LighthouseServer(min_replicas=1, http_bind="127.0.0.1:0") as lighthouse, \
            ManagerServer("g", lighthouse.address()) as manager:
        with grpc.insecure_channel(lighthouse.address(), options=[("grpc.max_send_message_length", -1)]) as ch:
            stub = ft_pb2_grpc.LighthouseServiceStub(ch)
            call = lambda: stub.Heartbeat(ft_pb2.LighthouseHeartbeatRequest(replica_id=too_big), timeout=10)
            assert status_of(call) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with grpc.insecure_channel(manager.address(), options=[("grpc.max_send_message_length", -1)]) as ch:
            stub = ft_pb2_grpc.ManagerServiceStub(ch)
            big = ft_pb2.ManagerQuorumRequest(group_rank=0, checkpoint_metadata=too_big)
            assert status_of(lambda: stub.Quorum(big, timeout=10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            medium = ft_pb2.ManagerQuorumRequest(group_rank=0, checkpoint_metadata="x" * 100_000)
            assert status_of(lambda: stub.Quorum(medium, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        # An HTTP body announced as 1 GB is not waited for: the lighthouse reads at most 64 KB of it.
        port = int(lighthouse.http_address().rstrip("/").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /replica/x/kill HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n" + b"y" * 70_000)
            assert sock.recv(100).startswith(b"HTTP/1.0 404")
    with HTTPTransport(timeout=STEP) as transport:  # a header line past http.server's 64 KB limit
        port = int(transport.metadata().rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /checkpoint/1/header HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")
            assert sock.recv(100).split(b" ")[1] in (b"400", b"431")


# ------------------------------------------------------------------ TLS

def test_tls_settings_are_checked():
    assert not rpc.tls_config().serves_tls and rpc.tls_config().client_roots is None
    with pytest.raises(ConfigError, match="both a certificate and its private key"):
        rpc.TLSConfig(cert_file=__file__)
    with pytest.raises(ConfigError, match="does not exist"):
        rpc.TLSConfig(ca_file="/nonexistent/ca.pem")


def test_grpc_over_tls_and_plaintext_clients_are_refused(tls_env):
    with LighthouseServer(min_replicas=1, join_timeout_ms=0, http_bind="127.0.0.1:0", token=TOKEN) as lighthouse:
        with LighthouseClient(lighthouse.address(), connect_timeout=STEP, token=TOKEN) as client:
            quorum = client.quorum(QuorumMember(replica_id="tls-member", world_size=1), timeout=STEP)
            assert "tls-member" in quorum.replica_ids
        with ManagerServer("g", lighthouse.address(), world_size=1, token=TOKEN) as manager:
            with ManagerClient(manager.address(), STEP, token=TOKEN) as client:
                assert client.should_commit(0, 0, True, STEP)
            for address in (lighthouse.address(), manager.address()):  # plaintext cannot talk to a TLS server
                with grpc.insecure_channel(address) as channel:
                    with pytest.raises(grpc.FutureTimeoutError):
                        grpc.channel_ready_future(channel).result(timeout=2)
        status, body = http(lighthouse.http_address() + "/status", TOKEN, context=rpc.client_ssl_context())
        assert lighthouse.http_address().startswith("https://") and status == 200 and json.loads(body)["quorum_id"]
        with pytest.raises(OSError):  # plaintext to the https status page: reset or refused, never served
            http(lighthouse.http_address().replace("https://", "http://") + "/status", TOKEN)
        assert status_main(["--lighthouse", lighthouse.http_address(), "--token", TOKEN, "--json"]) == 0
        assert status_urls("127.0.0.1:29510")[0] == "https://127.0.0.1:29510"  # a CA is set: the job uses TLS


def test_checkpoint_transfer_over_tls(tls_env, monkeypatch):
    with HTTPTransport(timeout=STEP, token=TOKEN) as source:
        assert source.metadata().startswith("https://")
        source.send_checkpoint([1], 4, {"w": torch.arange(10.0)}, STEP)
        assert torch.equal(fetch(source.metadata(), 4, 5.0, token=TOKEN)["w"], torch.arange(10.0))
        port = int(source.metadata().rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # plaintext: no HTTP answer
            sock.sendall(b"GET /checkpoint/4/header HTTP/1.1\r\n\r\n")
            sock.settimeout(5)
            try:
                assert not sock.recv(100).startswith(b"HTTP/")
            except (ConnectionError, TimeoutError):
                pass
        for var in ("FT_TLS_CA", "FT_TLS_CERT", "FT_TLS_KEY"):  # a healer with no CA cannot verify the source
            monkeypatch.delenv(var)
        with pytest.raises(CheckpointError, match="FT_TLS_CA"):
            fetch(source.metadata(), 4, 5.0, token=TOKEN)


@pytest.mark.timeout(150)
def test_training_heals_over_tls_end_to_end(certs, processes, tmp_path):
    """A TLS lighthouse process and two groups with FT_TLS_* set: the late group heals over https."""
    env = {**certs, "FT_TOKEN": TOKEN}
    from ft_core.tools.launcher import free_port

    port = free_port()
    processes.python("-m", "ft_core", "lighthouse", "--bind", f"127.0.0.1:{port}", "--http-bind", "off",
                     "--join-timeout-ms", "500", env=child_env(**env), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    out = str(tmp_path)
    args = ["-m", "ft_core.tools.chaos_worker", "--out", out, "--min-replicas", "1", "--timeout", "10"]

    def worker(group: int):
        return processes.python(*args, env=child_env(FT_LIGHTHOUSE=f"127.0.0.1:{port}", REPLICA_GROUP_ID=str(group),
                                                     FT_RESTART_COUNT="0", **env),
                                stdout=open(tmp_path / f"w{group}.log", "wb"), stderr=subprocess.STDOUT)

    from ft_core.tools.chaos_checks import check_digests, read_run

    def records(group: int) -> list[dict]:
        return next((inc.records for inc in read_run(out) if inc.group == str(group)), [])

    def wait(predicate, what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            logs = [tmp_path / f"w{g}.log" for g in (0, 1)]
            assert time.monotonic() < deadline, f"timed out waiting for {what}: " \
                + "".join(log.read_text()[-1500:] for log in logs if log.exists())
            time.sleep(0.1)

    first = worker(0)
    wait(lambda: sum(r["kind"] == "step" for r in records(0)) >= 5, "group 0 to train")
    second = worker(1)
    wait(lambda: sum(r["kind"] == "step" for r in records(1)) >= 3, "group 1 to heal and train")
    with open(os.path.join(out, "exit"), "w") as f:
        f.write(str(max(r["step"] for g in (0, 1) for r in records(g) if r["kind"] == "step") + 3))
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    healed = [r for r in records(1) if r["kind"] == "recv_done"]
    assert healed and healed[0]["source"].startswith("https://"), records(1)[:10]
    assert check_digests(read_run(out)) == []


def test_idle_http_connections_are_closed_by_the_servers():
    """A client that connects and says nothing does not hold a server thread forever."""
    with LighthouseServer(min_replicas=1, http_bind="127.0.0.1:0") as lighthouse, \
            HTTPTransport(timeout=timedelta(seconds=1)) as transport:
        from ft_core.control.lighthouse_http import _Handler

        assert _Handler.timeout and _Handler.timeout <= 60
        port = int(transport.metadata().rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            assert sock.recv(10) == b""  # closed by the server after its 1 s timeout
            assert time.monotonic() - started < 8
        assert lighthouse.http_address()
