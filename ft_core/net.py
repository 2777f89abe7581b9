"""Network addresses: the one parser and formatter of `host:port`, `[v6]:port` and store addresses.

Every component (lighthouse, manager server, store, checkpoint server, status CLI) reads addresses
through here, so they all accept the same forms and reject bad ones with the same ConfigError,
naming the bad value and the expected form. An IPv6 host takes brackets when a port follows
(`[::1]:29510`); without a port it may be written bare (`::1`).
"""

from __future__ import annotations

import socket

from ft_core.errors import ConfigError

SCHEMES = ("http://", "https://", "grpc://")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
MAX_PORT = 65535
HOST_PORT_FORM = "HOST:PORT or [IPv6]:PORT (e.g. 127.0.0.1:29510)"
STORE_FORM = "'host:port/prefix' (for example '127.0.0.1:29500/ft/3/0')"


def normalize_address(addr: str) -> str:
    """Accept `host:port`, `http://host:port` or `grpc://host:port`; return `host:port`."""
    for prefix in SCHEMES:
        if addr.startswith(prefix):
            addr = addr[len(prefix):]
    return addr.rstrip("/")


def split_addresses(addrs: str | list[str] | tuple[str, ...]) -> list[str]:
    """A comma-separated string or a list of addresses, normalized, empties dropped."""
    items = addrs.split(",") if isinstance(addrs, str) else list(addrs)
    return [normalize_address(a.strip()) for a in items if a and a.strip()]


def parse_port(text: str, what: str, value: str, lowest: int = 0) -> int:
    """A decimal port in `lowest`..65535, or a ConfigError naming `what` and its `value`."""
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(f"{what} {value!r} has port {text!r}, which is not a number; expected {HOST_PORT_FORM}")
    port = int(text)
    if not lowest <= port <= MAX_PORT:
        raise ConfigError(f"{what} {value!r} has port {port} outside {lowest}-{MAX_PORT}")
    return port


def split_host_port(addr: str, what: str = "address", *, default_host: str | None = "127.0.0.1",
                    default_port: int | None = None, hint: str = "") -> tuple[str, int]:
    """`host:port`, `[v6]:port` (optionally behind http://, https:// or grpc://) -> (host, port).

    Without `default_port` the port is required; with it, a bare `host`, `[v6]` or `v6` is accepted.
    An empty host becomes `default_host` (an error when that is None). IPv6 hosts come back unbracketed.
    """
    text = normalize_address(addr.strip())
    extra = f"; {hint}" if hint else ""
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what} {addr!r} is not {HOST_PORT_FORM}: unbalanced brackets{extra}")
        port_text: str | None = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif text.count(":") == 0 or default_port is not None:
        host, port_text = text, None  # a bare host: IPv4, a name, or an unbracketed IPv6 address
    else:
        raise ConfigError(f"{what} {addr!r} is not {HOST_PORT_FORM}: an IPv6 host needs brackets before "
                          f"its port{extra}")
    if port_text is None or port_text == "":
        if default_port is None:
            raise ConfigError(f"{what} {addr!r} has no port; expected {HOST_PORT_FORM}{extra}")
        port = default_port
    else:
        port = parse_port(port_text, what, addr)
    if not host:
        if default_host is None:
            raise ConfigError(f"{what} {addr!r} has no host; expected {HOST_PORT_FORM}{extra}")
        host = default_host
    return host, port


def format_host(host: str) -> str:
    """`host` as it goes before `:port` in an address or URL: IPv6 in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def format_host_port(host: str, port: int) -> str:
    """(host, port) -> `host:port` or `[v6]:port`."""
    return f"{format_host(host)}:{port}"


def dial_host(host: str) -> str:
    """The host a client should dial for a server bound to `host` (a wildcard bind: this machine's name)."""
    return socket.gethostname() if host in WILDCARD_HOSTS else host


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Split a store address 'host:port/prefix' into its parts; the prefix may itself contain '/'."""
    if not isinstance(store_addr, str) or "/" not in store_addr:
        raise ConfigError(f"store address {store_addr!r} must look like {STORE_FORM}")
    hostport, prefix = store_addr.split("/", 1)
    host, sep, port_text = hostport.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()) or not prefix:
        raise ConfigError(f"store address {store_addr!r} must look like {STORE_FORM} "
                          "with a numeric port and a non-empty prefix")
    port = int(port_text)
    if not 0 < port <= MAX_PORT:
        raise ConfigError(f"store address {store_addr!r} has port {port} outside 1-{MAX_PORT}")
    return host, port, prefix


def format_store_addr(host: str, port: int, prefix: str) -> str:
    """(host, port, prefix) -> 'host:port/prefix' (IPv6 hosts in brackets)."""
    return f"{format_host_port(host, port)}/{prefix}"
