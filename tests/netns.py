"""Simulated hosts for multi-host tests: Linux network namespaces joined by a bridge.

    def test_something(simulated_hosts):
        hosts = simulated_hosts(3)                      # h0, h1, h2 at 10.213.0.2, .3, .4
        proc = hosts.python(hosts[1], "train.py", env=child_env(FT_LIGHTHOUSE=f"{hosts[0].address}:{port}"))
        hosts.cut(hosts[1]); hosts.restore(hosts[1])    # the host's link down / up
        hosts.block(hosts[1], hosts[2]); hosts.unblock(hosts[1], hosts[2])   # nft drop between two hosts

The namespaces, the bridge and the faults are `ft_core.tools.netns.Namespaces` (shared with
`ftl chaos --network`); this adds the test side: processes owned by the fixture (started with the
tests' child environment, ended at teardown) and a skip with the reason where hosts cannot be made
(not root, no `ip netns`, no bridge support; no `nft` for a block). Teardown always ends the
processes started here, then deletes the namespaces, veths and the bridge, also when the test fails.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from conftest import Processes, child_env

from ft_core.tools.netns import (
    NETNS_ENV,
    SUBNET,
    Host,
    Namespaces,
    NetnsError,
    cannot_run_reason,
)

__all__ = ["NETNS_ENV", "SUBNET", "Host", "SimulatedHosts", "cannot_run_reason", "simulated_hosts"]


class SimulatedHosts(Namespaces):
    """N hosts h0..h(N-1) on one bridge; owns the processes it starts in them (see the module docstring)."""

    def __init__(self, count: int) -> None:
        reason = cannot_run_reason()
        if reason is not None:
            pytest.skip(reason)
        if not 1 <= count <= 200:
            raise ValueError(f"count must be 1..200, got {count}")
        self.processes = Processes()
        try:
            super().__init__([f"h{i}" for i in range(count)])
        except NetnsError as exc:
            pytest.skip(f"cannot create simulated hosts here: {exc}")

    # ---- processes ---------------------------------------------------------------------------------

    def spawn(self, host: Host, args: list[str], *, env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `args` inside `host` (its own session, ended at close())."""
        full_env = dict(env if env is not None else child_env())
        full_env.update(NETNS_ENV)
        return self.processes.spawn([*self.exec_prefix(host), *args], env=full_env, **kwargs)

    def python(self, host: Host, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start this interpreter with `args` inside `host`."""
        return self.spawn(host, [sys.executable, *args], env=env, **kwargs)

    def run(self, host: Host, args: list[str], timeout: float = 30.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a short command inside `host` to completion (raises on a non-zero exit)."""
        return super().run(host, args, timeout, env=dict(child_env()) if env is None else env)

    def free_port(self, host: Host, env: dict[str, str] | None = None) -> int:
        return super().free_port(host, env=dict(child_env()) if env is None else env)

    def kill_all(self, host: Host, timeout: float = 10.0, reap=()) -> None:
        """SIGKILL every process on `host`, as when the machine dies: torchrun's workers live in sessions of
        their own, which a signal to the launcher's process group does not reach."""
        try:
            super().kill_all(host, timeout, reap=list(reap) or self.processes.handles)
        except NetnsError as exc:
            raise AssertionError(str(exc)) from None

    # ---- faults ------------------------------------------------------------------------------------

    def _apply_blocks(self, host: Host) -> None:
        reason = cannot_run_reason(need_nft=True)
        if reason is not None:
            pytest.skip(reason)
        super()._apply_blocks(host)

    # ---- teardown ----------------------------------------------------------------------------------

    def close(self, reap=()) -> None:
        """End the processes started here, then remove namespaces, veths and the bridge (idempotent)."""
        if self._closed:
            return
        if hasattr(self, "processes"):
            self.processes.end_all()
        super().close(reap=getattr(self, "processes", None) and self.processes.handles or ())


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
