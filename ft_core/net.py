"""Network addresses: the one parser and formatter of `host:port`, `[v6]:port` and store addresses.

Every component (lighthouse, manager server, store, checkpoint server, status CLI) reads addresses
through here, so they all accept the same forms and reject bad ones with the same ConfigError,
naming the bad value and the expected form. An IPv6 host takes brackets when a port follows
(`[::1]:29510`); without a port it may be written bare (`::1`).

It also decides which local address a replica group advertises (`advertised_host`): FT_HOST or
`host=` when given, else the source address of the route toward the lighthouse, so groups on other
machines need no setting and a lighthouse on loopback keeps the whole job on loopback.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import socket
import struct

from ft_core.errors import ConfigError, RPCError

logger = logging.getLogger(__name__)

SCHEMES = ("http://", "https://", "grpc://")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
MAX_PORT = 65535
LOOPBACK_HOST = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_ROUTE_PROBE_PORT = 9  # any port: a UDP connect() sends nothing, it only picks the route
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


# ---- which local address to advertise ------------------------------------------------------------------

def is_ip_literal(host: str) -> bool:
    """True for an IPv4/IPv6 address (IPv6 optionally in brackets or with a %zone), False for a name."""
    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """True for localhost, 127.x.y.z and ::1 (no name lookup: other names are not loopback here)."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def local_address_toward(host: str, port: int = _ROUTE_PROBE_PORT) -> str:
    """The source address the kernel picks to reach `host` (an address or a name): a UDP connect(),
    which consults the routing table and sends no packet. OSError when there is no route."""
    bare = host.strip("[]")
    infos = socket.getaddrinfo(bare, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(sockaddr)
            except OSError as exc:  # e.g. ENETUNREACH: try the name's next address
                last = exc
                continue
            return str(sock.getsockname()[0])
    raise last if last is not None else OSError(f"{host!r} resolved to no address")


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(reply[20:24])


def _ipv6_interfaces(path: str = "/proc/net/if_inet6") -> dict[str, str]:
    """{IPv6 address: interface name} from the kernel's table (empty where it is absent)."""
    out: dict[str, str] = {}
    try:
        with open(path) as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and len(fields[0]) == 32:
                    packed = bytes.fromhex(fields[0])
                    out[str(ipaddress.IPv6Address(packed))] = fields[5]
    except OSError:
        return {}
    return out


def interface_of(address: str) -> str | None:
    """The name of the local interface that carries `address` (e.g. 'eth0', 'lo'); None when none does.
    IPv4 through SIOCGIFADDR over socket.if_nameindex(), IPv6 through /proc/net/if_inet6."""
    bare = address.strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def _lighthouse_hosts(lighthouse_addrs: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if not lighthouse_addrs:
        return []
    hosts = []
    for addr in split_addresses(lighthouse_addrs):
        try:
            hosts.append(split_host_port(addr, "lighthouse address", default_port=0)[0])
        except ConfigError:
            continue  # a malformed address is reported by the lighthouse client, with its own message
    return hosts


def advertised_host(explicit_host: str | None,
                    lighthouse_addrs: str | list[str] | tuple[str, ...] | None) -> str:
    """The host a replica group advertises for its servers: `explicit_host` (FT_HOST / host=, an address
    or a name) when given; else the local address of the route toward the first lighthouse that has one
    (loopback for a lighthouse on loopback); else 127.0.0.1."""
    if explicit_host is not None and explicit_host.strip():
        return explicit_host.strip().strip("[]")
    hosts = _lighthouse_hosts(lighthouse_addrs)
    for host in hosts:
        if host in WILDCARD_HOSTS or is_loopback(host):
            return LOOPBACK_HOST if ":" not in host else "::1"
        try:
            return local_address_toward(host)
        except OSError as exc:
            logger.warning("no route toward lighthouse host %s (%s); trying the next one", host, exc)
    if hosts:
        logger.warning("no route toward any lighthouse (%s): advertising %s; set FT_HOST to this machine's "
                       "address if other machines must reach it", ",".join(hosts), LOOPBACK_HOST)
    return LOOPBACK_HOST


def bind_host(advertised: str, bind_all: bool = False) -> str:
    """The host servers bind for `advertised`: the address itself (a name resolved to its first
    address); with `bind_all`, the wildcard of its family ('0.0.0.0' or '::')."""
    bare = advertised.strip("[]")
    if bind_all:
        return "::" if ":" in bare else "0.0.0.0"
    if is_ip_literal(bare):
        return bare
    try:
        return str(socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError as exc:
        raise ConfigError(f"host {advertised!r} (FT_HOST or host=) does not resolve ({exc}); give this machine's "
                          f"address or a name that resolves") from None


# ---- why a server could not bind ---------------------------------------------------------------------

def bind_problem(bind: str, error: OSError | None = None, fallback: str = "is the port in use?") -> str:
    """Why `bind` (host:port) cannot be bound, with the fix. `error`: the OSError of a failed bind; without
    one (gRPC reports only that its bind failed) a plain socket is bound there to learn the cause, and
    `fallback` is returned when that bind works (a cause this probe cannot see)."""
    try:
        host, port = split_host_port(bind, "bind address")
    except ConfigError as exc:
        return str(exc)
    if error is None:
        error = _probe_bind(host.strip("[]"), port)
    if error is None:
        return fallback
    if isinstance(error, socket.gaierror):
        return (f"{host!r} is neither an IP address nor a name this machine resolves; bind one of this "
                f"machine's addresses, or 0.0.0.0 for every interface")
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is already in use on {host}; stop what holds it, or pick another port (0: a free one)"
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this machine; bind one of its own addresses (`ip addr`) or "
                f"0.0.0.0, and advertise the address the others dial with FT_HOST")
    if error.errno == errno.EACCES:
        return f"port {port} needs privileges here; pick a port above 1023 (0: a free one)"
    return f"{error.strerror or error}; {fallback}"


def _probe_bind(host: str, port: int) -> OSError | None:
    """Bind a plain TCP socket at host:port (SO_REUSEADDR, as servers set it) and close it: its error, or None."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: neither an address nor a name that resolves
        return exc
    family, kind, proto, _, sockaddr = infos[0]  # the address a server binds first
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            return exc
    return None


# ---- reaching the lighthouse at start ----------------------------------------------------------------

DIAL_TIMEOUT_S = 3.0


def check_reachable(addrs: str | list[str] | tuple[str, ...], what: str = "lighthouse",
                    timeout_s: float = DIAL_TIMEOUT_S, hint: str = "FT_LIGHTHOUSE") -> str:
    """The first of `addrs` that accepts a TCP connection within `timeout_s`, each checked for form and port
    range first (ConfigError). None reachable: RPCError (code UNAVAILABLE) naming every address and why.

    Called once at start, so a typo or a lighthouse that is not running is reported in seconds rather
    than at a quorum deadline; the caller decides whether to fail or to warn and keep trying.
    """
    items = split_addresses(addrs)
    if not items:
        raise ConfigError(f"no {what} address given; set {hint} to HOST:PORT (e.g. 127.0.0.1:29510)")
    problems = []
    for item in items:
        host, port = split_host_port(item, f"{what} address", default_host=None, hint=f"set {hint}")
        if port == 0:
            raise ConfigError(f"{what} address {item!r} has port 0; give the port it listens on ({hint})")
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
                return format_host_port(host, port)
        except socket.timeout:
            problems.append(f"{item}: no answer within {timeout_s:g} s")
        except OSError as exc:
            problems.append(f"{item}: {exc.strerror or exc}")
    raise RPCError(f"cannot reach the {what} ({'; '.join(problems)}): is it running and is {hint} right?",
                   peer=",".join(items), call="connect", code="UNAVAILABLE")


def describe_route(address: str) -> str:
    """'HOST via IFACE from LOCAL' for logs: where traffic toward `address` (host:port, a URL or a host)
    leaves this machine; the address unchanged, with '(route unknown)', when it has no route or no host."""
    try:
        host, _ = split_host_port(address, "address", default_host=None, default_port=0)
        local = local_address_toward(host)
    except (ConfigError, OSError, UnicodeError):
        return f"{address} (route unknown)"
    return f"{host} via {interface_of(local) or '?'} from {local}"
