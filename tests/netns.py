"""Simulated hosts for multi-host tests: Linux network namespaces joined by a bridge.

    def test_something(simulated_hosts):
        hosts = simulated_hosts(3)                      # h0, h1, h2 at 10.213.0.2, .3, .4
        proc = hosts.python(hosts[1], "train.py", env=child_env(FT_LIGHTHOUSE=f"{hosts[0].address}:{port}"))
        hosts.cut(hosts[1]); hosts.restore(hosts[1])    # the host's link down / up
        hosts.block(hosts[1], hosts[2]); hosts.unblock(hosts[1], hosts[2])   # nft drop between two hosts

Each host is a namespace with `lo` up and one veth (named eth0 inside) on a bridge the fixture
creates. The private addresses exist only inside the namespaces: the root namespace gets none on
the bridge, so nothing a test starts there can reach them, and no loopback path joins two hosts.
Names carry a random tag per run (a crashed run cannot collide with the next one), and teardown
always ends the processes started here, then deletes the namespaces, veths and the bridge.
Where this cannot run (not root, no `ip netns`, no bridge support) the test is skipped with the reason.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from conftest import Processes, child_env

SUBNET = "10.213.0"  # /24; host i gets SUBNET.(i + 2)
PREFIX_LEN = 24
IP_TIMEOUT_S = 20.0
# Name lookups inside a namespace have no resolver to reach: fail in one second, not five.
NETNS_ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address on the bridge, its veth in the root namespace."""

    name: str
    netns: str
    address: str
    veth: str
    interface: str = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


def _failure(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"`{' '.join(exc.cmd)}` failed: {(exc.stderr or '').strip() or exc.returncode}"
    return str(exc)


def cannot_run_reason() -> str | None:
    """Why this machine cannot make simulated hosts (None when it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


class SimulatedHosts:
    """N hosts on one bridge; owns the processes it starts in them (see the module docstring)."""

    def __init__(self, count: int) -> None:
        reason = cannot_run_reason()
        if reason is not None:
            pytest.skip(reason)
        if not 1 <= count <= 200:
            raise ValueError(f"count must be 1..200, got {count}")
        self.tag = secrets.token_hex(3)
        self.bridge = f"ftb{self.tag}"
        self.processes = Processes()
        self.hosts: list[Host] = []
        self._blocked: dict[str, set[str]] = {}
        self._closed = False
        try:
            self._create(count)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            self.close()
            pytest.skip(f"cannot create simulated hosts here: {_failure(exc)}")

    def _create(self, count: int) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i in range(count):
            host = Host(name=f"h{i}", netns=f"ftl-{self.tag}-h{i}", address=f"{SUBNET}.{i + 2}",
                        veth=f"ftv{self.tag}{i}")
            peer = f"ftp{self.tag}{i}"
            _ip("netns", "add", host.netns)
            self.hosts.append(host)  # from here on, close() removes it
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            inside = ("ip", "-n", host.netns)
            subprocess.run([*inside, "link", "set", "lo", "up"], check=True, capture_output=True, text=True,
                           timeout=IP_TIMEOUT_S)
            subprocess.run([*inside, "link", "set", peer, "name", host.interface], check=True, capture_output=True,
                           text=True, timeout=IP_TIMEOUT_S)
            subprocess.run([*inside, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.interface],
                           check=True, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
            subprocess.run([*inside, "link", "set", host.interface, "up"], check=True, capture_output=True,
                           text=True, timeout=IP_TIMEOUT_S)

    # ---- hosts -------------------------------------------------------------------------------------

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __len__(self) -> int:
        return len(self.hosts)

    # ---- processes ---------------------------------------------------------------------------------

    def spawn(self, host: Host, args: list[str], *, env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `args` inside `host` (its own session, ended at close())."""
        full_env = dict(env if env is not None else child_env())
        full_env.update(NETNS_ENV)
        return self.processes.spawn(["ip", "netns", "exec", host.netns, *args], env=full_env, **kwargs)

    def python(self, host: Host, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start this interpreter with `args` inside `host`."""
        return self.spawn(host, [sys.executable, *args], env=env, **kwargs)

    def run(self, host: Host, args: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a short command inside `host` to completion (raises on a non-zero exit)."""
        env = dict(child_env())
        env.update(NETNS_ENV)
        return subprocess.run(["ip", "netns", "exec", host.netns, *args], capture_output=True, text=True,
                              timeout=timeout, check=True, env=env)

    def free_port(self, host: Host) -> int:
        """A TCP port the OS hands out on `host`'s address (free when this returns)."""
        code = (f"import socket; s = socket.socket(); s.bind(({host.address!r}, 0)); print(s.getsockname()[1]); s.close()"
                )
        return int(self.run(host, [sys.executable, "-c", code]).stdout.strip())

    def pids(self, host: Host) -> list[int]:
        """Every process living in `host`'s namespace (all started here: the namespace is this run's own)."""
        listed = _ip("netns", "pids", host.netns, check=False).stdout.split()
        return [int(p) for p in listed if p.isdigit()]

    def kill_all(self, host: Host, timeout: float = 10.0) -> None:
        """SIGKILL every process on `host`, as when the machine dies: torchrun's workers live in sessions of
        their own, which a signal to the launcher's process group does not reach."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(host)
            if not pids:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {pids} on {host.name} survived SIGKILL for {timeout}s")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for proc in self.processes.handles:  # reap our direct children so they do not linger as zombies
                if proc.poll() is None:
                    try:
                        proc.wait(timeout=0.05)
                    except subprocess.TimeoutExpired:
                        pass
            time.sleep(0.05)

    # ---- faults ------------------------------------------------------------------------------------

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: its packets go nowhere, open connections just stall (no reset)."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        """Bring `host`'s link back up."""
        _ip("link", "set", host.veth, "up")

    def block(self, a: Host, b: Host) -> None:
        """Drop every packet between `a` and `b` (both directions), with nft rules inside `a`."""
        self._blocked.setdefault(a.netns, set()).add(b.address)
        self._apply_blocks(a)

    def unblock(self, a: Host, b: Host) -> None:
        """Lift a block(a, b)."""
        self._blocked.setdefault(a.netns, set()).discard(b.address)
        self._apply_blocks(a)

    def _apply_blocks(self, host: Host) -> None:
        if shutil.which("nft") is None:
            pytest.skip("no `nft` command (apt-get install nftables)")
        peers = sorted(self._blocked.get(host.netns, ()))
        script = ["table inet ftblock", "delete table inet ftblock"]  # create-then-delete: no error if absent
        if peers:
            addresses = ", ".join(peers)
            script += ["table inet ftblock {",
                       "  chain input { type filter hook input priority 0; policy accept;",
                       f"    ip saddr {{ {addresses} }} drop; }}",
                       "  chain output { type filter hook output priority 0; policy accept;",
                       f"    ip daddr {{ {addresses} }} drop; }}",
                       "}"]
        subprocess.run(["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input="\n".join(script) + "\n",
                       capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=True)

    # ---- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """End the processes started here, then remove namespaces, veths and the bridge (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.processes.end_all()
        for host in self.hosts:
            try:
                self.kill_all(host)  # what the handles did not reach (torchrun's workers)
            except AssertionError as exc:
                sys.stderr.write(f"netns teardown: {exc}\n")
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)  # normally gone with its peer's namespace
        _ip("link", "del", self.bridge, check=False)


@pytest.fixture
def simulated_hosts() -> Iterator[Callable[[int], SimulatedHosts]]:
    """A factory: `simulated_hosts(n)` makes n hosts, removed at teardown (also when the test fails)."""
    made: list[SimulatedHosts] = []

    def make(count: int) -> SimulatedHosts:
        hosts = SimulatedHosts(count)
        made.append(hosts)
        return hosts

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()
