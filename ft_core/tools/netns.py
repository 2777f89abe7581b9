"""Simulated hosts: Linux network namespaces joined by a private bridge, and the network faults on them.

    with Namespaces(["lh", "g0", "g1"], subnet="10.214.0") as net:   # lh, g0, g1 at 10.214.0.2, .3, .4
        argv = net.exec_prefix(net["g0"]) + [sys.executable, "train.py"]
        net.cut(net["g0"]); net.restore(net["g0"])        # the host's link down / up
        net.block(net["g0"], net["g1"]); net.unblock_all() # nft drop between two hosts

Each host is a namespace with `lo` up and one veth (named eth0 inside) on a bridge made here. The
private addresses exist only inside the namespaces: the root namespace gets none on the bridge, so
nothing started there can reach them, and no loopback path joins two hosts. Names carry a random tag
(a crashed run cannot collide with the next one). `close()` (also on any failure while creating)
kills whatever still lives in the namespaces, then deletes the namespaces, veths, nft tables and the
bridge. Needs root, `ip` (iproute2), and `nft` for blocks: `cannot_run_reason()` says what is missing.
Used by `ftl chaos --network` and by the `simulated_hosts` test fixture (tests/netns.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

logger = logging.getLogger(__name__)

SUBNET = "10.213.0"  # /24; host i gets SUBNET.(i + 2)
PREFIX_LEN = 24
IP_TIMEOUT_S = 20.0
MAX_HOSTS = 200
# Name lookups inside a namespace have no resolver to reach: fail in one second, not five.
NETNS_ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


class NetnsError(RuntimeError):
    """Simulated hosts cannot be made or changed here (the message names the command and its error)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address on the bridge, its veth in the root namespace."""

    name: str
    netns: str
    address: str
    veth: str
    interface: str = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], *, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check, input=stdin)
    except subprocess.CalledProcessError as exc:
        raise NetnsError(f"`{' '.join(argv)}` failed: {(exc.stderr or '').strip() or exc.returncode}") from None
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise NetnsError(f"`{' '.join(argv)}` failed: {exc}") from None


def netns_name(tag: str, host: str) -> str:
    """The namespace of host `host` in the set tagged `tag`."""
    return f"ftl-{tag}-{host}"


def cannot_run_reason(*, need_nft: bool = False) -> str | None:
    """Why this machine cannot make simulated hosts (None when it can); `need_nft` for pairwise blocks."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if need_nft and shutil.which("nft") is None:
        return "no `nft` command for pairwise blocks (apt-get install nftables)"
    return None


class Namespaces:
    """Hosts named `names` on one bridge (see the module docstring); a context manager that always cleans up."""

    def __init__(self, names: Sequence[str], *, subnet: str = SUBNET, tag: str | None = None) -> None:
        reason = cannot_run_reason()
        if reason is not None:
            raise NetnsError(reason)
        if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise ValueError(f"give 1..{MAX_HOSTS} distinct host names, got {list(names)}")
        self.tag = tag or secrets.token_hex(3)
        self.bridge = f"ftb{self.tag}"
        self.hosts: list[Host] = []
        self._by_name: dict[str, Host] = {}
        self._blocked: dict[str, set[str]] = {}
        self._cut: set[str] = set()
        self._closed = False
        try:
            self._create(list(names), subnet)
        except BaseException:
            self.close()
            raise

    def _create(self, names: list[str], subnet: str) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names):
            host = Host(name=name, netns=netns_name(self.tag, name), address=f"{subnet}.{i + 2}",
                        veth=f"ftv{self.tag}{i}")
            peer = f"ftp{self.tag}{i}"
            _ip("netns", "add", host.netns)
            self.hosts.append(host)  # from here on, close() removes it
            self._by_name[name] = host
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", peer, "name", host.interface)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- hosts -------------------------------------------------------------------------------------

    def __getitem__(self, key: int | str) -> Host:
        return self.hosts[key] if isinstance(key, int) else self._by_name[key]

    def __len__(self) -> int:
        return len(self.hosts)

    @staticmethod
    def exec_prefix(host: Host) -> list[str]:
        """The argv prefix that runs a command inside `host` (`ip netns exec` execs it: the pid stays)."""
        return ["ip", "netns", "exec", host.netns]

    def run(self, host: Host, args: list[str], timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a short command inside `host` to completion (raises CalledProcessError on a non-zero exit)."""
        full_env = dict(os.environ if env is None else env)
        full_env.update(NETNS_ENV)
        return subprocess.run([*self.exec_prefix(host), *args], capture_output=True, text=True, timeout=timeout,
                              check=True, env=full_env)

    def free_port(self, host: Host, env: dict[str, str] | None = None) -> int:
        """A TCP port the OS hands out on `host`'s address (free when this returns)."""
        code = f"import socket; s = socket.socket(); s.bind(({host.address!r}, 0)); print(s.getsockname()[1])"
        return int(self.run(host, [sys.executable, "-c", code], env=env).stdout.strip())

    def pids(self, host: Host) -> list[int]:
        """Every process living in `host`'s namespace (all started by this run: the namespace is its own)."""
        listed = _ip("netns", "pids", host.netns, check=False).stdout.split()
        return [int(p) for p in listed if p.isdigit()]

    def kill_all(self, host: Host, timeout: float = 10.0, reap: Sequence[subprocess.Popen] = ()) -> None:
        """SIGKILL every process on `host`, as when the machine dies (processes in sessions of their own
        included); `reap` are this process's children, waited for so they do not linger as zombies."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids(host)
            if not pids:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"processes {pids} on {host.name} survived SIGKILL for {timeout}s")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for proc in reap:
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
        self._cut.add(host.name)

    def restore(self, host: Host) -> None:
        """Bring `host`'s link back up."""
        _ip("link", "set", host.veth, "up")
        self._cut.discard(host.name)

    def block(self, a: Host, b: Host) -> None:
        """Drop every packet between `a` and `b` (both directions), with nft rules inside `a`."""
        self._blocked.setdefault(a.netns, set()).add(b.address)
        self._apply_blocks(a)

    def unblock(self, a: Host, b: Host) -> None:
        """Lift a block(a, b)."""
        self._blocked.setdefault(a.netns, set()).discard(b.address)
        self._apply_blocks(a)

    def heal_all(self) -> None:
        """Every link up and every block lifted (what close() does first; safe to call at any time)."""
        for name in sorted(self._cut):
            self.restore(self._by_name[name])
        for netns, peers in list(self._blocked.items()):
            if peers:
                peers.clear()
                self._apply_blocks(next(h for h in self.hosts if h.netns == netns))

    def _apply_blocks(self, host: Host) -> None:
        if shutil.which("nft") is None:
            raise NetnsError("no `nft` command for pairwise blocks (apt-get install nftables)")
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
        _run([*self.exec_prefix(host), "nft", "-f", "-"], stdin="\n".join(script) + "\n")

    # ---- teardown ----------------------------------------------------------------------------------

    def close(self, reap: Sequence[subprocess.Popen] = ()) -> None:
        """Kill what still runs in the namespaces, then remove namespaces (their nft tables with them),
        veths and the bridge. Idempotent; every step is tried even when an earlier one failed."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            self._quietly(Namespaces.kill_all, self, host, reap=reap)  # not an override that raises otherwise
            self._quietly(_ip, "netns", "del", host.netns, check=False)
            self._quietly(_ip, "link", "del", host.veth, check=False)  # normally gone with its peer's namespace
        self._quietly(_ip, "link", "del", self.bridge, check=False)

    @staticmethod
    def _quietly(fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except NetnsError as exc:
            logger.warning("netns teardown: %s", exc)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this set that still exist (empty after close(): the cleanup check)."""
        names = set(_ip("netns", "list", check=False).stdout.split())
        links = _ip("-o", "link", "show", check=False).stdout
        found = [h.netns for h in self.hosts if h.netns in names]
        found += [dev for dev in [self.bridge, *(h.veth for h in self.hosts)] if f" {dev}:" in links or
                  f" {dev}@" in links]
        return found
