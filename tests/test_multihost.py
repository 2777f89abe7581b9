"""Across machines with zero extra configuration: real replica groups on simulated hosts (network
namespaces on a private bridge, tests/netns.py), the lighthouse on a host of its own.

Each group gets only FT_LIGHTHOUSE, REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (as the README says),
so every address it advertises comes from the route toward the lighthouse. Nothing joins two hosts
but the bridge: a loopback address advertised by mistake fails the test. Skipped where namespaces
cannot be made (not root, no `ip netns`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, child_env
from ft_harness import TRAIN, Group, check_step_digests, stop_all, wait_until

LIGHTNING_WORKER = os.path.join(REPO_ROOT, "tests", "_lightning_worker.py")
FABRIC_WORKER = os.path.join(REPO_ROOT, "tests", "_fabric_worker.py")
ACCELERATE_EXAMPLE = os.path.join(REPO_ROOT, "examples", "accelerate_train.py")
README_VARIABLES = ("FT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")
# torch's own intra-group Gloo (torchrun's DDP inside a group spanning hosts) binds the host name's
# address, which is loopback on these machines (and 127.0.1.1 on many Debian hosts): as with plain
# torch, it needs the interface named. Our cross-group groups honour it too.
INTRA_GROUP_GLOO = {"GLOO_SOCKET_IFNAME": "eth0"}


def only_readme_env(**settings: str) -> dict[str, str]:
    """A child environment with no fault-tolerance variable but the README's three (and `settings`)."""
    env = child_env(PYTHONWARNINGS="ignore")
    for name in list(env):
        if name.startswith(("FT_", "TORCHFT_")) or name in README_VARIABLES or name.endswith("_SOCKET_IFNAME"):
            del env[name]
    env.update(settings)
    return env


def start_lighthouse(hosts, host, log: Path, *, port: int | None = None, min_replicas: int = 2):
    """`ftl lighthouse` inside `host`, bound to its address; returns (process, "address:port")."""
    port = port or hosts.free_port(host)
    address = f"{host.address}:{port}"
    with open(log, "ab") as out:
        proc = hosts.python(host, "-m", "ft_core", "lighthouse", "--bind", address, "--http-bind", "off",
                            "--min-replicas", str(min_replicas), "--join-timeout-ms", "2000",
                            "--heartbeat-timeout-ms", "2000", env=only_readme_env(), stdout=out,
                            stderr=subprocess.STDOUT)
    return proc, address


class OnHost:
    """The `processes` interface ft_harness.Group uses, starting the group inside one simulated host
    with only the README's variables."""

    def __init__(self, hosts, host) -> None:
        self.hosts, self.host = hosts, host

    def spawn(self, args: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        given = env or {}
        clean = only_readme_env(**{k: given[k] for k in README_VARIABLES if k in given})
        return self.hosts.spawn(self.host, args, env=clean, **kwargs)


def torchrun_on_nodes(hosts, nodes: list, port: int, script: list[str], env: dict[str, str],
                      log_path: Callable[[int], str | Path], mode: str = "ab") -> list[subprocess.Popen]:
    """One `torchrun --nnodes=len(nodes) --nproc-per-node=1` per host of `nodes` running `script`, node 0
    (the first host) holding the static rendezvous at `port`; node r's output goes to log_path(r)."""
    procs = []
    for rank, host in enumerate(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
                f"--node-rank={rank}", f"--master-addr={nodes[0].address}", f"--master-port={port}",
                "--max-restarts=0", *script]
        with open(log_path(rank), mode) as log:  # the child keeps its own copy of the descriptor
            procs.append(hosts.spawn(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


@dataclass
class MultiNodeGroup(Group):
    """One replica group of train_ddp.py spanning hosts: one `torchrun --nnodes=N` per host, node 0
    holding group rank 0 (and its manager server); static rendezvous at node 0's address."""

    nodes: list = field(default_factory=list)  # simulated hosts, node 0 first
    hosts: object = None
    procs: list = field(default_factory=list)

    def start(self, extra: list[str] | None = None) -> subprocess.Popen:
        self.incarnation += 1
        port = self.hosts.free_port(self.nodes[0])
        script = [TRAIN, "--step-log", self.path("steps.jsonl"), "--events", self.path("events.jsonl"),
                  "--digest-out", self.path("digest.json"), "--stop-file", self.stop_file, *self.args, *(extra or [])]
        env = only_readme_env(FT_LIGHTHOUSE=self.lighthouse, REPLICA_GROUP_ID=str(self.group_id),
                              NUM_REPLICA_GROUPS=str(self.num_groups), **INTRA_GROUP_GLOO)
        self.procs = torchrun_on_nodes(self.hosts, self.nodes, port, script, env, lambda rank: os.path.join(
            self.workdir, f"g{self.group_id}.i{self.incarnation}.n{rank}.out"), mode="w")
        self.proc = self.procs[0]
        self.spawned_at = time.time()
        return self.proc

    def kill(self) -> None:
        """Every process of the group dies at once, as when its machines fail."""
        for host in self.nodes:
            self.hosts.kill_all(host)
        for proc in self.procs:
            proc.wait(timeout=10)

    def wait_exit(self, timeout: float) -> int:
        codes = [proc.wait(timeout=timeout) for proc in self.procs]
        return next((c for c in codes if c != 0), 0)

    def output(self) -> str:
        out = []
        for rank in range(len(self.nodes)):
            path = os.path.join(self.workdir, f"g{self.group_id}.i{self.incarnation}.n{rank}.out")
            if os.path.exists(path):
                out.append(f"[node {rank}]\n" + Path(path).read_text(errors="replace"))
        return "\n".join(out)


def train_group(hosts, host, workdir: str, group_id: int, lighthouse: str, num_groups: int = 2) -> Group:
    return Group(OnHost(hosts, host), workdir, group_id, num_groups, lighthouse,
                 args=["--steps", "100000", "--step-sleep", "0.05", "--dataset-size", "512"])


def final_digests(groups: list[Group]) -> set[str]:
    return {d["digest"] for g in groups for d in g.digests()}


def assert_all_end_identical_at(groups: list[Group], target: int, ranks: int = 1) -> None:
    """Every rank of every group agreed on each step's digest and wrote the same final state at `target`."""
    check_step_digests(groups, ranks=ranks)
    digests = [d for g in groups for d in g.digests()]
    assert len(digests) == len(groups) * ranks and {d["step"] for d in digests} == {target}, digests
    assert len(final_digests(groups)) == 1, digests


def healed(group: Group, incarnation: int | None = None, rank: int = 0) -> bool:
    return any(e.get("type") == "heal" for e in group.events(incarnation, rank))


# ---- core API ------------------------------------------------------------------------------------

@pytest.mark.timeout(110)
def test_core_api_groups_on_two_hosts_end_identical_and_a_killed_group_heals_across_hosts(simulated_hosts,
                                                                                          tmp_path):
    hosts = simulated_hosts(3)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    groups = [train_group(hosts, hosts[1 + g], str(tmp_path), g, lighthouse) for g in (0, 1)]
    for g in groups:
        g.start()
    wait_until(lambda: all(len(g.commits()) >= 5 for g in groups), 60, "both groups to commit 5 steps", groups)

    groups[1].kill()
    groups[1].start()  # on its own host again, with a fresh incarnation
    wait_until(lambda: len(groups[1].commits()) >= 3, 60, "the restarted group to commit 3 steps", groups)
    target = stop_all(groups)

    assert healed(groups[1]), "the restarted group never healed from its peer on the other host"
    assert_all_end_identical_at(groups, target)


# ---- Lightning Trainer and Fabric ----------------------------------------------------------------

def start_worker(hosts, host, script: str, out: Path, group: int, lighthouse: str, *args: str) -> subprocess.Popen:
    env = only_readme_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2")
    with open(out / f"group{group}.log", "ab") as log:
        return hosts.python(host, script, "--out", str(out), "--group", str(group), *args, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log")))


def wait_ok(procs: list[subprocess.Popen], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a group did not finish within {timeout}s; logs:\n{logs(out)}")
        assert code == 0, f"exit code {code}; logs:\n{logs(out)}"


def assert_same_tensors(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_identical_files(out: Path, pattern: str, expected: int) -> None:
    files = sorted(out.glob(pattern))
    assert len(files) == expected, [f.name for f in files]
    reference = torch.load(files[0], weights_only=False)
    for f in files[1:]:
        assert_same_tensors(reference, torch.load(f, weights_only=False), f"{f.name} vs {files[0].name}")


def assert_identical_state(out: Path, pattern: str, expected: int) -> None:
    """`expected` weights_PATTERN files, all equal, and as many optimizer_PATTERN files, all equal."""
    for kind in ("weights", "optimizer"):
        assert_identical_files(out, f"{kind}_{pattern}", expected)


@pytest.mark.timeout(115)
def test_lightning_groups_on_two_hosts_end_identical_and_a_killed_group_heals_across_hosts(simulated_hosts,
                                                                                          tmp_path):
    hosts = simulated_hosts(3)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    args = ("--epochs", "2", "--samples", "64", "--sleep", "0.05", "--checkpoint")
    survivor = start_worker(hosts, hosts[1], LIGHTNING_WORKER, tmp_path, 0, lighthouse, *args)
    victim = start_worker(hosts, hosts[2], LIGHTNING_WORKER, tmp_path, 1, lighthouse, *args, "--kill-at-step", "3")
    assert victim.wait(timeout=80) == -9, logs(tmp_path)
    restarted = start_worker(hosts, hosts[2], LIGHTNING_WORKER, tmp_path, 1, lighthouse, *args)
    wait_ok([survivor, restarted], tmp_path, 90)

    runs = {g: json.loads((tmp_path / f"summary_g{g}_r0.json").read_text()) for g in (0, 1)}
    steps = 2 * (64 // 2 // 4)  # epochs * batches of a group's shard
    assert [runs[g]["manager_step"] for g in (0, 1)] == [steps, steps], runs
    assert runs[1]["events"].get("heal", 0) >= 1, runs[1]
    assert_identical_state(tmp_path, "g*_r0.pt", 2)


@pytest.mark.timeout(100)
def test_fabric_groups_on_two_hosts_end_identical(simulated_hosts, tmp_path):
    hosts = simulated_hosts(3)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    procs = [start_worker(hosts, hosts[1 + g], FABRIC_WORKER, tmp_path, g, lighthouse, "--steps", "6")
             for g in (0, 1)]
    wait_ok(procs, tmp_path, 90)
    runs = {g: json.loads((tmp_path / f"summary_g{g}.json").read_text()) for g in (0, 1)}
    assert [runs[g]["step"] for g in (0, 1)] == [6, 6]
    assert_identical_state(tmp_path, "g*.pt", 2)


# ---- Accelerate ----------------------------------------------------------------------------------

@pytest.mark.timeout(100)
def test_accelerate_groups_on_two_hosts_end_identical(simulated_hosts, tmp_path):
    hosts = simulated_hosts(3)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    for g in (0, 1):
        env = only_readme_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS="2",
                              HF_HOME=str(tmp_path / f"hf{g}"))
        with open(tmp_path / f"group{g}.log", "ab") as log:
            procs.append(hosts.python(hosts[1 + g], "-m", "ft_core", "accelerate", "launch", "--cpu",
                                      "--num_processes", "1", ACCELERATE_EXAMPLE, "--steps", "4", "--out-dir",
                                      str(out), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path)))
    wait_ok(procs, tmp_path, 90)
    states = sorted(out.glob("*.pt"))
    assert [p.stem for p in states] == ["group0_rank0", "group1_rank0"]
    for p in states:
        assert json.loads(p.with_suffix(".json").read_text())["step"] == 4
    assert_identical_files(out, "*.pt", 2)


@pytest.mark.timeout(115)
def test_an_accelerate_group_with_num_machines_2_spans_two_hosts_and_ends_identical(simulated_hosts, tmp_path):
    """Group 0: `ftl accelerate launch --num_machines 2` (one process on h1, one on h2, machine 0 holding the
    rendezvous and the group's manager server); group 1: 2 processes on h3. Every rank of both groups ends
    with the same state at the same step."""
    hosts = simulated_hosts(4)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    out = tmp_path / "out"
    out.mkdir()
    port = hosts.free_port(hosts[1])
    launches = [(hosts[1], 0, ["--num_machines", "2", "--machine_rank", "0", "--main_process_ip", hosts[1].address,
                               "--main_process_port", str(port)]),
                (hosts[2], 0, ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", hosts[1].address,
                               "--main_process_port", str(port)]),
                (hosts[3], 1, [])]
    procs = []
    for i, (host, group, machine) in enumerate(launches):
        env = only_readme_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2",
                              HF_HOME=str(tmp_path / f"hf{i}"), **INTRA_GROUP_GLOO)
        with open(tmp_path / f"launch{i}.log", "ab") as log:
            procs.append(hosts.python(host, "-m", "ft_core", "accelerate", "launch", "--cpu", "--num_processes", "2",
                                      *machine, ACCELERATE_EXAMPLE, "--steps", "4", "--out-dir", str(out), env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path)))
    for i, proc in enumerate(procs):
        code = proc.wait(timeout=100)
        assert code == 0, f"launch {i} exited {code}:\n{(tmp_path / f'launch{i}.log').read_text()[-3000:]}"
    states = sorted(out.glob("*.pt"))
    assert [p.stem for p in states] == ["group0_rank0", "group0_rank1", "group1_rank0", "group1_rank1"], states
    for p in states:
        assert json.loads(p.with_suffix(".json").read_text())["step"] == 4
    assert_identical_files(out, "*.pt", 4)


# ---- a group spanning two hosts ------------------------------------------------------------------

@pytest.mark.timeout(115)
def test_a_group_spanning_two_hosts_ends_identical_also_after_the_whole_group_is_killed_and_restarted(
        simulated_hosts, tmp_path):
    """Group 0 is torchrun --nnodes=2 (one process on h1, one on h2); group 1 is torchrun --standalone with
    two processes on h3 (every group runs the same number of ranks: rank r reduces with rank r)."""
    hosts = simulated_hosts(4)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    wide = MultiNodeGroup(None, str(tmp_path), 0, 2, lighthouse, nproc=2, nodes=[hosts[1], hosts[2]], hosts=hosts,
                          args=["--steps", "100000", "--step-sleep", "0.05", "--dataset-size", "512"])
    local = Group(OnHost(hosts, hosts[3]), str(tmp_path), 1, 2, lighthouse, nproc=2,
                  args=["--steps", "100000", "--step-sleep", "0.05", "--dataset-size", "512"])
    groups: list[Group] = [wide, local]
    for g in groups:
        g.start()
    wait_until(lambda: all(len(g.commits(rank=r)) >= 4 for g in groups for r in (0, 1)), 60,
               "both ranks of both groups to commit 4 steps", groups)

    wide.kill()
    wide.start()
    wait_until(lambda: len(wide.commits()) >= 3 and len(wide.commits(rank=1)) >= 3, 60,
               "the restarted wide group to commit 3 steps on both hosts", groups)
    target = stop_all(groups)

    assert healed(wide, rank=0) and healed(wide, rank=1), "the restarted wide group did not heal on both hosts"
    assert_all_end_identical_at(groups, target, ranks=2)


@pytest.mark.timeout(115)
def test_a_lightning_group_with_num_nodes_2_spans_two_hosts_and_ends_identical(simulated_hosts, tmp_path):
    """Group 0: Trainer(num_nodes=2, devices=1) under torchrun --nnodes=2 on h1 and h2; group 1: devices=2
    on h3. Every rank of both groups ends with the same weights and optimizer state."""
    hosts = simulated_hosts(4)
    _, lighthouse = start_lighthouse(hosts, hosts[0], tmp_path / "lighthouse.log")
    args = ("--epochs", "1", "--samples", "64")
    env = only_readme_env(FT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="2", **INTRA_GROUP_GLOO)
    procs = torchrun_on_nodes(hosts, [hosts[1], hosts[2]], hosts.free_port(hosts[1]),
                              [LIGHTNING_WORKER, "--out", str(tmp_path), "--group", "0", "--num-nodes", "2", *args],
                              env, lambda rank: tmp_path / f"group0_node{rank}.log")
    procs.append(start_worker(hosts, hosts[3], LIGHTNING_WORKER, tmp_path, 1, lighthouse, "--devices", "2", *args))
    wait_ok(procs, tmp_path, 100)

    runs = {(s["group"], s["rank"]): s for s in (json.loads(p.read_text()) for p in tmp_path.glob("summary_*.json"))}
    assert sorted(runs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {run["world_size"] for run in runs.values()} == {2}
    assert len({run["manager_step"] for run in runs.values()}) == 1 and runs[(0, 0)]["manager_step"] > 0, runs
    assert_identical_state(tmp_path, "g*_r*.pt", 4)


# ---- a standby lighthouse on another host ---------------------------------------------------------

@pytest.mark.timeout(115)
def test_commits_resume_through_the_standby_lighthouse_when_the_primary_host_is_cut(simulated_hosts, tmp_path):
    hosts = simulated_hosts(4)
    _, primary = start_lighthouse(hosts, hosts[0], tmp_path / "primary.log")
    _, standby = start_lighthouse(hosts, hosts[3], tmp_path / "standby.log")
    both = f"{primary},{standby}"
    groups = [train_group(hosts, hosts[1 + g], str(tmp_path), g, both) for g in (0, 1)]
    for g in groups:
        g.start()
    wait_until(lambda: all(len(g.commits()) >= 5 for g in groups), 60, "both groups to commit 5 steps", groups)

    hosts.cut(hosts[0])
    before = {g.group_id: g.last_step() for g in groups}
    wait_until(lambda: all(g.last_step() >= before[g.group_id] + 5 for g in groups), 60,
               "both groups to commit 5 more steps through the standby", groups)
    stop_all(groups)
    check_step_digests(groups)
    assert len(final_digests(groups)) == 1
    for g in groups:
        steps = [c["step"] for c in g.commits()]
        assert steps == list(range(1, len(steps) + 1)), f"group {g.group_id} lost or skipped a step: {steps}"


# ---- the host= argument reaches the Manager (loopback, in this process) -------------------------------

def test_the_integrations_host_argument_is_what_the_manager_advertises(monkeypatch):
    """host= (Lightning/Fabric strategies via FTSettings, the Accelerate plugin) is advertised as given,
    a name included, while the servers bind its address; FT_HOST overrides the argument."""
    from ft_core.control.lighthouse import LighthouseServer
    from ft_lightning._common import FTSettings, create_manager
    from ft_lightning.accelerate import FaultTolerancePlugin

    for name in ("FT_HOST", "FT_BIND_ALL", "FT_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(name, raising=False)
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind=None) as lighthouse:
        settings = FTSettings.resolve(lighthouse_addr=lighthouse.address(), host="localhost", connect_timeout=10)
        manager = create_manager(settings, group_rank=0, group_world_size=1, device=torch.device("cpu"))
        try:
            assert (manager.config.hostname, manager.config.bind_host) == ("localhost", "127.0.0.1")
            assert manager.store_address.startswith("localhost:")
            assert manager.checkpoint_transport.metadata().startswith("http://localhost:")
        finally:
            manager.shutdown()
    assert FaultTolerancePlugin(lighthouse="127.0.0.1:1", host="10.1.2.3").host == "10.1.2.3"
    monkeypatch.setenv("FT_HOST", "10.4.5.6")
    assert FTSettings.resolve(host="10.1.2.3").host == "10.4.5.6"
    assert FaultTolerancePlugin(lighthouse="127.0.0.1:1", host="10.1.2.3").host == "10.4.5.6"
