"""ft_core.net: the one address parser, as tables of accepted and rejected forms; and the rule for the
address a replica group advertises (FT_HOST, else the route toward the lighthouse), on loopback and
across simulated hosts (tests/netns.py)."""

from __future__ import annotations

import socket
import sys

import pytest

from ft_core.errors import ConfigError
from ft_core.manager_config import resolve_config
from ft_core.net import (
    advertised_host,
    bind_host,
    describe_route,
    dial_host,
    format_host_port,
    format_store_addr,
    interface_of,
    is_ip_literal,
    is_loopback,
    local_address_toward,
    normalize_address,
    parse_store_addr,
    split_addresses,
    split_host_port,
)


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:29510", ("127.0.0.1", 29510)),
    ("localhost:1", ("localhost", 1)),
    ("host.example:65535", ("host.example", 65535)),
    ("[::1]:29510", ("::1", 29510)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    (":29510", ("127.0.0.1", 29510)),
    ("grpc://h:1", ("h", 1)),
    ("http://h:2/", ("h", 2)),
    ("https://[::1]:3", ("::1", 3)),
    ("  h:4  ", ("h", 4)),
])
def test_host_port_parses_host_and_port(text, expected):
    assert split_host_port(text, "test address") == expected


@pytest.mark.parametrize("text, message", [
    ("h", "has no port"),
    ("h:", "has no port"),
    ("h:x", "not a number"),
    ("h:-1", "not a number"),
    ("h:+1", "not a number"),
    ("h:65536", "outside 0-65535"),
    ("h:99999999", "outside 0-65535"),
    ("::1:5", "needs brackets"),
    ("[::1", "unbalanced brackets"),
    ("[::1]x:5", "unbalanced brackets"),
    ("[::1]", "has no port"),
])
def test_bad_host_port_is_a_config_error_naming_the_value(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        split_host_port(text, "test address")
    assert repr(text) in str(info.value) and "test address" in str(info.value)


def test_bad_host_port_error_names_the_expected_form_and_hint():
    with pytest.raises(ConfigError, match=r"HOST:PORT or \[IPv6\]:PORT.*port 0 picks a free one"):
        split_host_port("nohost", "bind", hint="port 0 picks a free one")


def test_empty_host_without_a_default_is_an_error():
    with pytest.raises(ConfigError, match="has no host"):
        split_host_port(":1", "test address", default_host=None)


@pytest.mark.parametrize("text, expected", [
    ("h", ("h", 0)),
    ("", ("127.0.0.1", 0)),
    ("::1", ("::1", 0)),
    ("[::1]", ("::1", 0)),
    ("[::1]:", ("::1", 0)),
    ("[::1]:7", ("::1", 7)),
    ("h:7", ("h", 7)),
])
def test_with_a_default_port_a_bare_host_is_accepted(text, expected):
    assert split_host_port(text, "bind", default_port=0) == expected


@pytest.mark.parametrize("host, port, expected", [
    ("127.0.0.1", 1, "127.0.0.1:1"),
    ("::1", 2, "[::1]:2"),
    ("[::1]", 3, "[::1]:3"),
    ("name", 0, "name:0"),
])
def test_host_port_formats_ipv6_in_brackets(host, port, expected):
    assert format_host_port(host, port) == expected
    assert split_host_port(expected, "round trip") == (host.strip("[]"), port)


@pytest.mark.parametrize("host, expected", [
    ("0.0.0.0", socket.gethostname()),
    ("::", socket.gethostname()),
    ("", socket.gethostname()),
    ("10.0.0.1", "10.0.0.1"),
    ("::1", "::1"),
])
def test_a_wildcard_bind_is_dialled_by_this_machines_name(host, expected):
    assert dial_host(host) == expected


@pytest.mark.parametrize("text, expected", [
    ("h:1", "h:1"),
    ("http://h:1", "h:1"),
    ("https://h:1/", "h:1"),
    ("grpc://[::1]:2", "[::1]:2"),
])
def test_normalize_address_drops_scheme_and_trailing_slash(text, expected):
    assert normalize_address(text) == expected


@pytest.mark.parametrize("given, expected", [
    ("a:1,b:2", ["a:1", "b:2"]),
    (" a:1 , ,grpc://b:2/ ", ["a:1", "b:2"]),
    (["a:1", "", "http://b:2"], ["a:1", "b:2"]),
    ("", []),
])
def test_address_lists_are_split_and_normalized(given, expected):
    assert split_addresses(given) == expected


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:29500/ft/3/0", ("127.0.0.1", 29500, "ft/3/0")),
    ("[::1]:1234/p", ("::1", 1234, "p")),
    ("host.example:80/a/b", ("host.example", 80, "a/b")),
    ("h:65535/p", ("h", 65535, "p")),
])
def test_store_address_parses_host_port_and_prefix(text, expected):
    assert parse_store_addr(text) == expected
    assert parse_store_addr(format_store_addr(*expected)) == expected


@pytest.mark.parametrize("text, message", [
    ("127.0.0.1:29500", "host:port/prefix"),
    ("127.0.0.1/p", "host:port/prefix"),
    (":12/p", "host:port/prefix"),
    ("h:x/p", "numeric port"),
    ("h:1/", "non-empty prefix"),
    ("h:0/p", "outside 1-65535"),
    ("h:99999/p", "outside 1-65535"),
    (None, "host:port/prefix"),
])
def test_bad_store_address_is_a_config_error_naming_the_value(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        parse_store_addr(text)
    assert repr(text) in str(info.value)


# ---- the address a group advertises ------------------------------------------------------------------

@pytest.mark.parametrize("explicit, lighthouses, expected", [
    ("10.1.2.3", "127.0.0.1:29510", "10.1.2.3"),       # FT_HOST / host= wins
    ("node-7.cluster", "127.0.0.1:1", "node-7.cluster"),  # a name is advertised as given
    (" [::1] ", None, "::1"),
    ("", "127.0.0.1:29510", "127.0.0.1"),              # empty: unset
    (None, "127.0.0.1:29510", "127.0.0.1"),            # a lighthouse on loopback keeps the job on loopback
    (None, "localhost:29510", "127.0.0.1"),
    (None, "[::1]:29510", "::1"),
    (None, "0.0.0.0:29510", "127.0.0.1"),
    (None, ["grpc://127.0.0.1:1", "10.9.9.9:2"], "127.0.0.1"),  # the first lighthouse decides
    (None, None, "127.0.0.1"),                          # no lighthouse: loopback
    (None, "", "127.0.0.1"),
])
def test_advertised_host_rule(explicit, lighthouses, expected):
    assert advertised_host(explicit, lighthouses) == expected


@pytest.mark.parametrize("host, bind_all, expected", [
    ("10.1.2.3", False, "10.1.2.3"),
    ("10.1.2.3", True, "0.0.0.0"),
    ("::1", False, "::1"),
    ("[::1]", True, "::"),
    ("127.0.0.1", False, "127.0.0.1"),
])
def test_servers_bind_the_advertised_address_or_the_wildcard(host, bind_all, expected):
    assert bind_host(host, bind_all) == expected


def test_an_unresolvable_host_name_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="no-such-host.invalid.*FT_HOST"):
        bind_host("no-such-host.invalid")


@pytest.mark.parametrize("host, literal, loopback", [
    ("127.0.0.1", True, True), ("127.0.1.1", True, True), ("::1", True, True), ("[::1]", True, True),
    ("localhost", False, True), ("10.0.0.1", True, False), ("fe80::1%eth0", True, False), ("node1", False, False),
])
def test_literal_and_loopback_hosts(host, literal, loopback):
    assert (is_ip_literal(host), is_loopback(host)) == (literal, loopback)


def test_loopback_route_and_interface():
    assert local_address_toward("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.1") is None and interface_of("not an address") is None


@pytest.mark.parametrize("address, expected", [
    ("http://127.0.0.1:4567", "127.0.0.1 via lo from 127.0.0.1"),
    ("127.0.0.1:1", "127.0.0.1 via lo from 127.0.0.1"),
    ("pg:rank3", "pg:rank3 (route unknown)"),  # not an address (another transport's metadata)
    ("", " (route unknown)"),
])
def test_describe_route_names_the_interface_traffic_leaves_by(address, expected):
    assert describe_route(address) == expected


def test_the_manager_config_resolves_ft_host_and_ft_bind_all():
    base = dict(replica_id="g", rank=0, world_size=1, min_replica_size=None, use_async_quorum=None, timeout=None,
                quorum_timeout=None, connect_timeout=None, world_size_mode=None, lighthouse_addr="127.0.0.1:1",
                port=None, heartbeat_interval=0.1, init_sync=True, max_retries=None, quorum_retries=None,
                token=None)
    default = resolve_config(hostname=None, environ={}, **base)
    assert (default.hostname, default.bind_host) == ("127.0.0.1", "127.0.0.1")
    assert resolve_config(hostname="10.1.2.3", environ={}, **base).bind_host == "10.1.2.3"
    env = resolve_config(hostname="10.1.2.3", environ={"FT_HOST": "10.4.5.6", "FT_BIND_ALL": "1"}, **base)
    assert (env.hostname, env.bind_host) == ("10.4.5.6", "0.0.0.0")  # the variable wins, as everywhere


ROUTE_PROBE = """
import logging, sys
from ft_core import net
from ft_core.process_groups.child import gloo_bind_address
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
peer, lighthouse = sys.argv[1], sys.argv[2]
mine = net.local_address_toward(peer)
print(mine, net.interface_of(mine), net.advertised_host(None, lighthouse + ":29510"), gloo_bind_address(peer))
print(net.describe_route(f"http://{peer}:8000"))
"""


@pytest.mark.timeout(60)
def test_across_simulated_hosts_the_route_gives_this_hosts_address_and_interface(simulated_hosts):
    hosts = simulated_hosts(2)
    a, b = hosts[0], hosts[1]
    first, second = hosts.run(a, [sys.executable, "-c", ROUTE_PROBE, b.address, b.address]).stdout.splitlines()
    assert first.split() == [a.address, "eth0", a.address, a.address]
    assert second == f"{b.address} via eth0 from {a.address}"


@pytest.mark.timeout(60)
def test_without_a_route_to_the_lighthouse_the_group_falls_back_to_loopback_and_says_why(simulated_hosts):
    hosts = simulated_hosts(1)
    code = ("import logging, sys; from ft_core import net; logging.basicConfig(stream=sys.stdout);"
            "print(net.advertised_host(None, '192.0.2.9:29510'))")
    out = hosts.run(hosts[0], [sys.executable, "-c", code]).stdout
    assert "no route toward any lighthouse" in out and "FT_HOST" in out
    assert out.strip().splitlines()[-1] == "127.0.0.1"


# ---- a server that cannot bind says why ----------------------------------------------------------------

def _start_server(kind: str, bind: str, lighthouse: str) -> None:
    """Start one of the servers a job runs at `bind` (it is expected to fail), and stop it if it started."""
    from ft_core.control.lighthouse import LighthouseServer
    from ft_core.control.manager_server import ManagerServer
    from ft_core.metrics import MetricsServer

    if kind == "lighthouse":
        server = LighthouseServer(bind=bind, http_bind=None)
    elif kind == "lighthouse HTTP":
        server = LighthouseServer(bind="127.0.0.1:0", http_bind=bind)
    elif kind == "metrics":
        server = MetricsServer(bind)
    else:
        server = ManagerServer("bind-test", lighthouse, bind=bind)
    server.shutdown()


SERVERS = ["lighthouse", "lighthouse HTTP", "metrics", "manager server"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", SERVERS)
def test_a_server_whose_port_is_taken_says_so_and_how_to_fix_it(kind):
    """Before, every server said 'is the port in use?' whatever the cause (gRPC reports only that its bind
    failed); now the cause is found and named, with the fix."""
    from ft_core.control.lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", http_bind=None)
    try:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            with pytest.raises(ConfigError) as info:
                _start_server(kind, f"127.0.0.1:{port}", lighthouse.address())
    finally:
        lighthouse.shutdown()
    message = str(info.value)
    assert f"could not bind 127.0.0.1:{port}" in message.replace("'", "")
    assert f"port {port} is already in use on 127.0.0.1" in message and "0: a free one" in message


@pytest.mark.timeout(90)
def test_a_server_bound_to_another_hosts_address_says_it_is_not_this_machines(simulated_hosts):
    """A multi-host job's usual slip: --bind (or the manager's bind) given the address of another machine.
    The address of simulated host h0 is not an address of the test's own namespace."""
    from ft_core.control.lighthouse import LighthouseServer

    other = simulated_hosts(1)[0].address
    lighthouse = LighthouseServer(bind="127.0.0.1:0", http_bind=None)
    try:
        for kind in SERVERS:
            with pytest.raises(ConfigError) as info:
                _start_server(kind, f"{other}:0", lighthouse.address())
            assert f"{other} is not an address of this machine" in str(info.value), kind
            assert "FT_HOST" in str(info.value) and "port in use" not in str(info.value), kind
    finally:
        lighthouse.shutdown()


def test_bind_problem_names_each_cause_and_its_fix():
    from errno import EACCES, ECONNRESET

    from ft_core.net import bind_problem

    unresolved = bind_problem("nosuchhost:29510", socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert "'nosuchhost' is neither an IP address nor a name this machine resolves" in unresolved
    assert "port 80 needs privileges" in bind_problem("0.0.0.0:80", OSError(EACCES, "Permission denied"))
    assert bind_problem("127.0.0.1:1", OSError(ECONNRESET, "odd"), fallback="fix it") == "odd; fix it"
    with socket.socket() as free:  # nothing holds it: the probe binds, so the cause is not one it can see
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert bind_problem(f"127.0.0.1:{port}", fallback="is the port in use?") == "is the port in use?"
