"""ft_core.net: the one address parser, as tables of accepted and rejected forms."""

from __future__ import annotations

import socket

import pytest

from ft_core.errors import ConfigError
from ft_core.net import (
    dial_host,
    format_host_port,
    format_store_addr,
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
