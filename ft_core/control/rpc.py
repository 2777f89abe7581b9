"""Shared gRPC plumbing: token auth, deadlines, error mapping, connect backoff.

Every client call goes through `call()` so that a deadline is always set and failures
surface as `FTTimeoutError` (a TimeoutError) or a typed `RPCError` naming peer, call and fix.
"""

from __future__ import annotations

import errno
import hmac
import os
import random
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import grpc

from ft_core import settings
from ft_core.errors import AuthError, ConfigError, FTError, FTTimeoutError, RPCError
from ft_core.control.job_end import job_finished_error
from ft_core.net import normalize_address, split_addresses, split_host_port  # noqa: F401 - rpc.split_addresses

TOKEN_METADATA_KEY = "authorization"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # control-plane messages are small; bigger ones are rejected
STOP_POLL_S = 0.05  # how often a connect that may be stopped checks its stop event

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_http_proxy", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]


def seconds(value: timedelta | float) -> float:
    """A timeout as float seconds."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the shared token (empty when no token is configured)."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()


def token_matches(expected: str | None, metadata: Any) -> bool:
    """Constant-time check of the bearer token in `metadata` (an iterable of key/value pairs)."""
    if not expected:
        return True
    presented = ""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            presented = value
    return hmac.compare_digest(presented.encode(), f"Bearer {expected}".encode())


TOKEN_REFUSED = "missing or wrong token: set FT_TOKEN (or token=) to the job's shared token"


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose bearer token is missing or wrong with UNAUTHENTICATED."""

    def __init__(self, token: str | None) -> None:
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: set FT_TOKEN (or token=) to the job's shared token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        if token_matches(self._token, handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary


class TokenCheckingHandler(grpc.GenericRpcHandler):
    """The method handlers of one grpc.aio service, with each call's token checked as its handler is looked
    up: a missing or wrong token gets a handler that answers UNAUTHENTICATED (as TokenAuthInterceptor does).

    A synchronous lookup per call instead of a grpc.aio interceptor, whose chain of awaits runs on every
    call (about 25 us of a ~1 ms manager quorum round on a 2-core VM, benchmarks/quorum_latency.py).
    """

    def __init__(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler], token: str | None) -> None:
        self._handlers = {f"/{service}/{method}": handler for method, handler in handlers.items()}
        self._token = token

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSED)

        async def deny_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, TOKEN_REFUSED)
            yield b""  # pragma: no cover - abort raises; this only makes it an async generator

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny_stream)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(handler_call_details.method)
        if token_matches(self._token, handler_call_details.invocation_metadata):
            return handler
        return self._deny_stream if handler is not None and handler.request_streaming else self._deny_unary


def servicer_handlers(add_to_server: Callable[[Any, Any], None], servicer: Any) -> tuple[str, dict[str, Any]]:
    """(service name, method handlers) that a generated `add_XServicer_to_server(servicer, server)` registers,
    for a TokenCheckingHandler (the generated code's serializers kept, its own registration not used)."""

    class _Collect:
        name = ""
        handlers: dict[str, Any] = {}

        def add_generic_rpc_handlers(self, generic: Any) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
            self.name, self.handlers = name, dict(handlers)

    collect = _Collect()
    add_to_server(servicer, collect)
    if not collect.name:
        raise ConfigError(f"{add_to_server.__name__} registered no method handlers")
    return collect.name, collect.handlers


def backoff_delays(initial: float = 0.1, factor: float = 1.5, cap: float = 2.0, jitter: float = 0.1,
                   rng: random.Random | None = None) -> Iterator[float]:
    """Capped exponential backoff with additive jitter: initial, initial*factor, ... <= cap (+jitter)."""
    rand = rng or random.Random()
    delay = initial
    while True:
        yield min(delay, cap) + rand.uniform(0, jitter)
        delay *= factor


def map_rpc_error(err: grpc.RpcError, *, peer: str, call: str, timeout_s: float | None = None) -> Exception:
    """Turn a grpc.RpcError into FTTimeoutError / AuthError / RPCError with an actionable message."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    return map_status(code, details, peer=peer, call=call, timeout_s=timeout_s)


def map_status(code: grpc.StatusCode | None, details: str, *, peer: str, call: str,
               timeout_s: float | None = None) -> Exception:
    """The error a call that ended with status `code` raises (any wire: gRPC, or frames)."""
    where = f"{call} to {peer}"
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        budget = f" after {timeout_s:.3g}s" if timeout_s is not None else ""
        return FTTimeoutError(f"{where} timed out{budget} ({details}); the peer may be dead, hung or overloaded, "
                              f"or the timeout too short")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"{where} was rejected: {details}", peer=peer, call=call, code=code.name)
    if code == grpc.StatusCode.OUT_OF_RANGE:  # the lighthouse refused a late group: the job finished
        return job_finished_error(details, peer=peer, call=call)
    if code == grpc.StatusCode.UNAVAILABLE:
        return RPCError(f"{where} failed: peer unavailable ({details}); check that it is running and the "
                        f"address is right", peer=peer, call=call, code=code.name)
    name = code.name if code is not None else "UNKNOWN"
    return RPCError(f"{where} failed with {name}: {details}", peer=peer, call=call, code=name)


def unreachable_peers(peers: Mapping[str, str], timeout_s: float) -> list[str]:
    """The keys of `peers` (name -> `host:port`) that do not accept a TCP connection within `timeout_s`.

    All connects run at once, non-blocking, on the calling thread: the whole probe takes at most
    `timeout_s` (a peer behind a dropping firewall or a cut link uses the whole of it; a live one
    answers in a round trip, a dead one refuses at once). Bad addresses count as unreachable.
    """
    failed: list[str] = []
    selector = selectors.DefaultSelector()
    try:
        for name, address in peers.items():
            try:
                host, port = split_host_port(address, "peer address", default_host=None)
                family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                      flags=socket.AI_NUMERICHOST)[0]
                sock = socket.socket(family, kind, proto)
            except (OSError, ValueError, ConfigError):
                failed.append(name)
                continue
            sock.setblocking(False)
            code = sock.connect_ex(sockaddr)
            if code == 0:
                sock.close()
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                selector.register(sock, selectors.EVENT_WRITE, name)
            else:
                sock.close()
                failed.append(name)
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                selector.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    failed.append(key.data)
                sock.close()
        for key in list(selector.get_map().values()):  # no answer in time
            failed.append(key.data)
            selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
    finally:
        selector.close()
    return sorted(failed)


def call(method: Callable, request: Any, *, peer: str, name: str, timeout: timedelta | float,
         token: str | None = None) -> Any:
    """Invoke a unary gRPC stub method with a deadline and mapped errors."""
    timeout_s = max(seconds(timeout), 0.001)
    try:
        return method(request, timeout=timeout_s, metadata=auth_metadata(token))
    except grpc.RpcError as err:
        raise map_rpc_error(err, peer=peer, call=name, timeout_s=timeout_s) from None


def connect(address: str, connect_timeout: timedelta | float, *, call_name: str = "connect",
            tls: "TLSConfig | None" = None, stop: threading.Event | None = None) -> grpc.Channel:
    """Open a channel and wait until it is ready, retrying with capped backoff until connect_timeout, or
    until `stop` is set (FTError: the caller gave up on the peer, e.g. the lighthouse said it is lost)."""
    target = normalize_address(address)
    deadline = time.monotonic() + seconds(connect_timeout)
    delays = backoff_delays()
    tls = tls_config() if tls is None else tls
    while True:
        channel = open_channel(target, CHANNEL_OPTIONS, tls=tls)
        if _ready(channel, max(min(deadline - time.monotonic(), 1.0), 0.001), stop):
            return channel
        channel.close()
        if stop is not None and stop.is_set():
            raise FTError(f"{call_name}: stopped before {target} answered")
        if time.monotonic() >= deadline:
            raise FTTimeoutError(f"{call_name}: could not connect to {target} within {seconds(connect_timeout):.3g}s; "
                                 f"check that the server is running and reachable (connect_timeout)")
        delay = min(next(delays), max(deadline - time.monotonic(), 0))
        if stop is None:
            time.sleep(delay)
        else:
            stop.wait(delay)


def _ready(channel: grpc.Channel, timeout_s: float, stop: threading.Event | None) -> bool:
    """Whether `channel` became ready within timeout_s (checking `stop` every STOP_POLL_S meanwhile)."""
    ready = grpc.channel_ready_future(channel)
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        try:
            ready.result(timeout=max(left if stop is None else min(left, STOP_POLL_S), 0.001))
            return True
        except grpc.FutureTimeoutError:
            if time.monotonic() >= end or (stop is not None and stop.is_set()):
                ready.cancel()
                return False


# --------------------------------------------------------------------------- TLS (optional)

@dataclass(frozen=True)
class TLSConfig:
    """Optional TLS for every gRPC and HTTP endpoint: off unless a certificate or a CA is configured.

    A server serves TLS when cert_file and key_file are set. A client uses TLS when ca_file is set
    (the CA that signed the servers' certificates), or else when cert_file is set (a self-signed
    certificate shared by the job is its own CA). Certificates must name the address clients dial
    (e.g. a subjectAltName of IP:10.0.0.5 or DNS:node1).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("TLS needs both a certificate and its private key: set FT_TLS_CERT and FT_TLS_KEY "
                              f"together (got cert={self.cert_file!r}, key={self.key_file!r})")
        for what, path in (("certificate (FT_TLS_CERT)", self.cert_file), ("key (FT_TLS_KEY)", self.key_file),
                           ("CA (FT_TLS_CA)", self.ca_file)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"TLS {what} file {path!r} does not exist")

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file and self.key_file)

    @property
    def client_roots(self) -> str | None:
        """The PEM file a client verifies servers against; None when clients use plaintext."""
        return self.ca_file or self.cert_file or None

    @property
    def http_scheme(self) -> str:
        return "https" if self.serves_tls else "http"


def tls_config(cert_file: str | None = None, key_file: str | None = None,
               ca_file: str | None = None) -> TLSConfig:
    """TLS settings: FT_TLS_CERT / FT_TLS_KEY / FT_TLS_CA override the arguments; all unset means plaintext."""
    return TLSConfig(settings.value("FT_TLS_CERT", cert_file), settings.value("FT_TLS_KEY", key_file),
                     settings.value("FT_TLS_CA", ca_file))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """gRPC server credentials from a PEM certificate (chain) and its private key."""
    return grpc.ssl_server_credentials([(_read(key_file), _read(cert_file))])


def channel_credentials(ca_file: str) -> grpc.ChannelCredentials:
    """gRPC channel credentials that trust the PEM CA bundle `ca_file`."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file))


def open_channel(target: str, options: list[tuple[str, Any]] | None = None,
                 tls: TLSConfig | None = None) -> grpc.Channel:
    """A gRPC channel to `target`: TLS when the config (default: the FT_TLS_* environment) asks for it."""
    tls = tls_config() if tls is None else tls
    opts = CHANNEL_OPTIONS if options is None else options
    roots = tls.client_roots
    if roots:
        return grpc.secure_channel(target, channel_credentials(roots), options=opts)
    return grpc.insecure_channel(target, options=opts)


def add_server_port(server: grpc.Server, address: str, tls: TLSConfig | None = None) -> int:
    """Bind `address` on `server` (TLS when cert and key are configured); returns the port (0 on failure)."""
    tls = tls_config() if tls is None else tls
    if tls.serves_tls:
        assert tls.cert_file and tls.key_file
        return server.add_secure_port(address, server_credentials(tls.cert_file, tls.key_file))
    return server.add_insecure_port(address)


def server_ssl_context(tls: TLSConfig | None = None) -> ssl.SSLContext | None:
    """An ssl context for an HTTP server (None: plaintext). TLS 1.2 or newer."""
    tls = tls_config() if tls is None else tls
    if not tls.serves_tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)  # type: ignore[arg-type]
    return context


def client_ssl_context(tls: TLSConfig | None = None) -> ssl.SSLContext | None:
    """An ssl context for an HTTP client that verifies the server (None: plaintext)."""
    tls = tls_config() if tls is None else tls
    roots = tls.client_roots
    if not roots:
        return None
    context = ssl.create_default_context(cafile=roots)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
