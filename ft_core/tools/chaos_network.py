"""Network faults of `ftl chaos --network`: the job on simulated hosts (ft_core.tools.netns) and the
faults a network has that a process death does not show.

Layout: a primary lighthouse on host `lh0`, a standby on `lh1` (every group gets FT_LIGHTHOUSE=lh0,lh1),
and each replica group on a host of its own (`g0`, `g1`, ...; a group's ranks share its host). The
harness stays in the root namespace: it only reads the workers' files and signals their pids.

- `host_cut`: a group's link goes down (its open connections stall, no reset) for 1.5-2.5x the
  longer of the collective and heartbeat timeouts, then comes back up; the group must commit
  nothing while cut, and rejoin (heal) afterwards.
- `partition`: nft drops every packet between two groups' hosts (both still reach the lighthouse)
  for 3-4x the collective timeout; the others must settle on a set that can all reach each other,
  so the two never commit a step together while blocked.
- `lighthouse_cut`: a lighthouse host's link goes down for 4-6x the longer timeout (alternately the
  primary's and the standby's, the primary first); commits must go on through the other one.

Every namespace, veth, nft table and the bridge are removed at the end of the run, also on failure.
"""

from __future__ import annotations

import itertools
import random
import secrets
from dataclasses import dataclass
from typing import Any

from ft_core.tools.chaos_matrix import MATRIX, NETWORK_KINDS
from ft_core.tools.netns import Namespaces, NetnsError, cannot_run_reason, netns_name

SUBNET = "10.214.0"  # the tests' hosts use 10.213.0; every run has a bridge of its own anyway
LIGHTHOUSE_HOSTS = ("lh0", "lh1")


def network_order(seed: int) -> tuple[str, ...]:
    """The order of the CI variant's three network faults for `seed`: one of the 6 orders, by `seed // 8`, as
    the cell is `seed % 8` (chaos_matrix.cell_for), so 48 successive day numbers run every order in every cell
    and a rerun with the same seed injects the same order."""
    orders = list(itertools.permutations(NETWORK_KINDS))
    return orders[(seed // len(MATRIX)) % len(orders)]


def network_unavailable() -> str | None:
    """Why `--network` cannot run here (None when it can): root, `ip netns` and `nft` are needed."""
    return cannot_run_reason(need_nft=True)


@dataclass
class NetFault:
    """The network fault in force: what to undo, and when."""

    kind: str
    hosts: tuple[str, ...]  # host names: one cut host, or the blocked pair
    until: float  # monotonic time to undo it


class Network:
    """The simulated hosts of one run and its network faults (one at a time)."""

    def __init__(self, groups: int, rng: random.Random) -> None:
        self.rng = rng
        self.tag = secrets.token_hex(3)
        self.names = [*LIGHTHOUSE_HOSTS, *(f"g{g}" for g in range(groups))]
        self.namespaces: Namespaces | None = None
        self.active: NetFault | None = None
        self.lighthouse_cuts = 0

    def create(self) -> None:
        self.namespaces = Namespaces(self.names, subnet=SUBNET, tag=self.tag)
        assert all(self.namespaces[n].address == self.address(n) for n in self.names)

    def address(self, name: str) -> str:
        """A host's address (known before the hosts exist: host i is SUBNET.(i + 2))."""
        return f"{SUBNET}.{self.names.index(name) + 2}"

    def prefix(self, name: str) -> list[str]:
        """The argv prefix that runs a command on host `name` (usable before the hosts exist)."""
        return ["ip", "netns", "exec", netns_name(self.tag, name)]

    def worker_command(self, argv: list[str]) -> list[str]:
        """`argv` run on the host of the group in its environment (REPLICA_GROUP_ID, set by the Launcher);
        `sh` and `ip netns exec` exec in turn, so the Launcher's pid is the worker's."""
        ns = netns_name(self.tag, "g")  # + the group id
        return ["sh", "-c", f'exec ip netns exec "{ns}$REPLICA_GROUP_ID" "$@"', "ftl-chaos-host", *argv]

    # ---- faults ------------------------------------------------------------------------------------

    def cut_group(self, group: int, seconds: float, now: float) -> None:
        self._cut(f"g{group}", "host_cut", seconds, now)

    def cut_lighthouse(self, seconds: float, now: float) -> str:
        """Cut the next lighthouse host (lh0 first, then alternately); returns its name."""
        name = LIGHTHOUSE_HOSTS[self.lighthouse_cuts % len(LIGHTHOUSE_HOSTS)]
        self.lighthouse_cuts += 1
        self._cut(name, "lighthouse_cut", seconds, now)
        return name

    def _cut(self, name: str, kind: str, seconds: float, now: float) -> None:
        assert self.namespaces is not None and self.active is None
        self.namespaces.cut(self.namespaces[name])
        self.active = NetFault(kind, (name,), now + seconds)

    def block(self, a: int, b: int, seconds: float, now: float) -> None:
        assert self.namespaces is not None and self.active is None
        ns = self.namespaces
        ns.block(ns[f"g{a}"], ns[f"g{b}"])
        self.active = NetFault("partition", (f"g{a}", f"g{b}"), now + seconds)

    def due(self, now: float) -> NetFault | None:
        """Undo the fault in force if its time is up; returns the fault undone."""
        if self.active is None or now < self.active.until:
            return None
        return self.undo()

    def undo(self) -> NetFault | None:
        fault, self.active = self.active, None
        if fault is not None and self.namespaces is not None:
            ns = self.namespaces
            if fault.kind == "partition":
                ns.unblock(ns[fault.hosts[0]], ns[fault.hosts[1]])
            else:
                ns.restore(ns[fault.hosts[0]])
        return fault

    def close(self) -> list[str]:
        """Lift the fault in force, remove every namespace, link and rule; returns what went wrong (empty:
        nothing is left)."""
        if self.namespaces is None:
            return []
        ns, self.namespaces = self.namespaces, None
        problems = []
        try:
            ns.heal_all()
        except NetnsError as exc:
            problems.append(f"lifting the network fault failed: {exc}")
        finally:
            ns.close()
        return problems + [f"left behind after the run: {name}" for name in ns.leftovers()]


def durations(cfg: Any, rng: random.Random) -> dict[str, float]:
    """How long each network fault lasts (seconds), drawn for the next fault."""
    longer = max(cfg.timeout, cfg.heartbeat_timeout_ms / 1000.0)
    return {"host_cut": rng.uniform(1.5, 2.5) * longer, "partition": rng.uniform(3.0, 4.0) * cfg.timeout,
            "lighthouse_cut": rng.uniform(4.0, 6.0) * longer}


def graces(cfg: Any) -> dict[str, float]:
    """After a network fault starts, how long before its promise is checked: a step in flight at the cut
    ends (commits or times out) within the collective timeout; a failover to the other lighthouse takes
    the heartbeat timeout and a call's deadline more (ft_core.tools.chaos_checks.check_network_faults)."""
    hb = cfg.heartbeat_timeout_ms / 1000.0
    return {"host_cut": cfg.timeout + 1.0, "partition": cfg.timeout + 1.0,
            "lighthouse_cut": cfg.timeout + 2 * hb + 1.0}
