"""Shared gRPC plumbing: token auth, deadlines, error mapping, connect backoff.

Every client call goes through `call()` so that a deadline is always set and failures
surface as `FTTimeoutError` (a TimeoutError) or a typed `RPCError` naming peer, call and fix.
"""

from __future__ import annotations

import hmac
import random
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Callable

import grpc

from ft_core.errors import AuthError, FTTimeoutError, RPCError

TOKEN_METADATA_KEY = "authorization"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # control-plane messages are small; bigger ones are rejected

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


def normalize_address(addr: str) -> str:
    """Accept `host:port`, `http://host:port` or `grpc://host:port`; return `host:port`."""
    for prefix in ("http://", "https://", "grpc://"):
        if addr.startswith(prefix):
            addr = addr[len(prefix):]
    return addr.rstrip("/")


def split_addresses(addrs: str | list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated string or a list of addresses, normalized, empties dropped."""
    items = addrs.split(",") if isinstance(addrs, str) else list(addrs)
    return [normalize_address(a.strip()) for a in items if a and a.strip()]


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
    where = f"{call} to {peer}"
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        budget = f" after {timeout_s:.3g}s" if timeout_s is not None else ""
        return FTTimeoutError(f"{where} timed out{budget} ({details}); the peer may be dead, hung or overloaded, "
                              f"or the timeout too short")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"{where} was rejected: {details}", peer=peer, call=call, code=code.name)
    if code == grpc.StatusCode.UNAVAILABLE:
        return RPCError(f"{where} failed: peer unavailable ({details}); check that it is running and the "
                        f"address is right", peer=peer, call=call, code=code.name)
    name = code.name if code is not None else "UNKNOWN"
    return RPCError(f"{where} failed with {name}: {details}", peer=peer, call=call, code=name)


def call(method: Callable, request: Any, *, peer: str, name: str, timeout: timedelta | float,
         token: str | None = None) -> Any:
    """Invoke a unary gRPC stub method with a deadline and mapped errors."""
    timeout_s = max(seconds(timeout), 0.001)
    try:
        return method(request, timeout=timeout_s, metadata=auth_metadata(token))
    except grpc.RpcError as err:
        raise map_rpc_error(err, peer=peer, call=name, timeout_s=timeout_s) from None


def connect(address: str, connect_timeout: timedelta | float, *, call_name: str = "connect") -> grpc.Channel:
    """Open a channel and wait until it is ready, retrying with capped backoff until connect_timeout."""
    target = normalize_address(address)
    deadline = time.monotonic() + seconds(connect_timeout)
    delays = backoff_delays()
    while True:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        remaining = deadline - time.monotonic()
        try:
            grpc.channel_ready_future(channel).result(timeout=max(min(remaining, 1.0), 0.001))
            return channel
        except grpc.FutureTimeoutError:
            channel.close()
        if time.monotonic() >= deadline:
            raise FTTimeoutError(f"{call_name}: could not connect to {target} within {seconds(connect_timeout):.3g}s; "
                                 f"check that the server is running and reachable (connect_timeout)")
        time.sleep(min(next(delays), max(deadline - time.monotonic(), 0)))
