"""Reconfigurable process groups on CPU: results equal torch's Gloo, reconfiguration without leaks,
hung peers become TimeoutError, wrappers, registration for functional collectives."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from test_process_group_helpers import (
    resources,
    run_case,
    run_ranks,
    table_cases,
    torch_gloo_group,
)
from torch._C._distributed_c10d import ReduceOp, TCPStore

from conftest import assert_bounded
from ft_core.errors import ConfigError, FTTimeoutError, ProcessGroupError
from ft_core.process_groups import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
)
from ft_core.process_groups.child import ChildSpec, build_deadlines, is_timeout_message, parse_store_addr

GROUP_TYPES = [ProcessGroupGloo, ProcessGroupBabyGloo]


@pytest.fixture(autouse=True)
def _baby_start_timeout(monkeypatch):
    # These tests time ops with short timeouts; a subprocess group's configure is bounded by `timeout` alone
    # (torchft's rule, tested in test_torchft_compat.py), so give its child's start-up a deadline of its own.
    monkeypatch.setenv("FT_BABY_START_TIMEOUT_SEC", "60")


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master


def addr(store: TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{store.port}/{prefix}"


# ---------------------------------------------------------------- pure rules

@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:29500/ft/3/0", ("127.0.0.1", 29500, "ft/3/0")),
    ("[::1]:1234/p", ("::1", 1234, "p")),
    ("host.example:80/a/b", ("host.example", 80, "a/b")),
])
def test_store_address_parses_host_port_and_prefix(text, expected):
    assert parse_store_addr(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1:29500", "127.0.0.1/p", ":12/p", "h:0/p", "h:99999/p", "h:x/p", "h:1/"])
def test_bad_store_address_is_a_clear_error(text):
    with pytest.raises(ValueError, match="host:port/prefix|port"):
        parse_store_addr(text)


@pytest.mark.parametrize("message, is_timeout", [
    ("Timed out waiting 2000ms for recv operation to complete", True),
    ("wait timeout after 2000ms, keys: /b/0/1", True),
    ("Connection closed by peer [127.0.0.1]:1234", False),
    ("NCCL error: remote process exited", False),
])
def test_timeout_messages_are_classified(message, is_timeout):
    assert is_timeout_message(message) is is_timeout


@pytest.mark.parametrize("start_timeout_s, deadline, expected", [
    (None, 107.0, (7.0, 7.0)),     # torchft's rule: every stage gets what is left of `timeout`
    (None, 101.5, (1.5, 1.5)),
    (30.0, 0.0, (30.0, 30.0)),     # explicit start-up deadline; the build gets max(timeout, start)
    (2.0, 0.0, (2.0, 5.0)),
])
def test_subprocess_group_configure_deadlines(start_timeout_s, deadline, expected):
    spec = ChildSpec(backend="gloo", store_addr="127.0.0.1:1/p", rank=0, world_size=1, timeout_s=5.0,
                     start_timeout_s=start_timeout_s, deadline=deadline, device=None, group_name="g", global_ranks=None)
    assert tuple(d.total_seconds() for d in build_deadlines(spec, now=100.0)) == expected


def test_subprocess_group_configure_past_its_timeout_names_the_fix():
    spec = ChildSpec(backend="gloo", store_addr="127.0.0.1:1/p", rank=0, world_size=1, timeout_s=5.0,
                     start_timeout_s=None, deadline=99.0, device=None, group_name="g", global_ranks=None)
    with pytest.raises(TimeoutError, match="start_timeout"):
        build_deadlines(spec, now=100.0)


def test_timeout_comes_from_argument_unless_env_overrides(monkeypatch):
    monkeypatch.delenv("FT_TIMEOUT_SEC", raising=False)
    monkeypatch.delenv("TORCHFT_TIMEOUT_SEC", raising=False)
    assert ProcessGroupGloo(timeout=timedelta(seconds=7)).timeout == timedelta(seconds=7)
    monkeypatch.setenv("FT_TIMEOUT_SEC", "2.5")
    assert ProcessGroupGloo(timeout=timedelta(seconds=7)).timeout == timedelta(seconds=2.5)
    monkeypatch.setenv("FT_TIMEOUT_SEC", "soon")
    with pytest.raises(ConfigError, match="FT_TIMEOUT_SEC"):
        ProcessGroupGloo()


def test_groups_are_torch_process_groups():
    for cls in (ProcessGroupGloo, ProcessGroupBabyGloo, ProcessGroupDummy):
        pg = cls()
        assert isinstance(pg, dist.ProcessGroup) and isinstance(pg, ProcessGroup)
        assert pg.getBackendName().startswith("ft-")


# ---------------------------------------------------------------- the table, across reconfigurations

def _check_table(store: TCPStore, groups: list[ProcessGroup], world: int, stage: str) -> None:
    """Every collective x dtype on our groups equals torch's own Gloo on the same inputs."""
    ranks = list(range(world))
    refs = run_ranks(lambda r: torch_gloo_group(store.port, f"ref/{stage}", r, world), ranks)
    cases = table_cases(world)

    def play(rank: int) -> tuple[list, list]:
        ours, theirs = [], []
        for seed, (name, dtype) in enumerate(cases):
            ours.append(run_case(groups[rank], name, dtype, rank, world, seed, use_future=seed % 2 == 1))
            theirs.append(run_case(refs[rank], name, dtype, rank, world, seed))
        return ours, theirs

    for rank, (ours, theirs) in zip(ranks, run_ranks(play, ranks)):
        for (name, dtype), got, want in zip(cases, ours, theirs):
            for g, w in zip(got, want):
                assert g.dtype == dtype and torch.equal(g, w), f"{stage} rank {rank} {name} {dtype}: {g} != {w}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_collectives_match_torch_across_reconfigure_3_2_3_without_leaks(cls, store):
    timeout = timedelta(seconds=10)
    groups = [cls(timeout=timeout) for _ in range(3)]
    # World size 1 first: it also starts the stdlib's process-wide helpers (resource tracker and
    # fd sharer, used by the subprocess variant) so the leak baseline below is steady state.
    groups[0].configure(addr(store, "q0/0"), "a", 0, 1, quorum_id=0)
    _check_table(store, groups, 1, "q0")
    groups[0].shutdown()
    before = resources()

    for quorum_id, world in ((1, 3), (2, 2), (3, 3)):
        run_ranks(lambda r: groups[r].configure(addr(store, f"q{quorum_id}"), f"g{r}", r, world,
                                                quorum_id=quorum_id), list(range(world)))
        assert [g.size() for g in groups[:world]] == [world] * world
        assert [g.rank() for g in groups[:world]] == list(range(world))
        if world == 2:
            groups[2].shutdown()  # the dropped member leaves
        _check_table(store, groups, world, f"q{quorum_id}")
        assert all(g.errored() is None for g in groups[:world])

    for group in groups:
        group.shutdown()
    after = resources()
    assert after[2] == before[2], f"child processes left behind: {set(after[2]) - set(before[2])}"
    # No growth (earlier tests' helper threads and sockets may still be winding down, so the
    # counts can drop while this test runs), and none of the groups' own threads survive.
    assert after[1] <= before[1], f"threads: {before[1]} before, {after[1]} after shutdown"
    assert after[0] <= before[0], f"open fds (sockets): {before[0]} before, {after[0]} after shutdown"
    leftover = [t.name for t in threading.enumerate() if t.name.startswith(f"ft-{cls.BACKEND}")]
    assert not leftover, f"threads of the shut-down groups still alive: {leftover}"


# ---------------------------------------------------------------- faults (threads)

@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_hung_peer_becomes_timeout_error_within_timeout(cls, store):
    timeout = 2.0
    groups = [cls(timeout=timedelta(seconds=timeout)) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "hung"), "a", r, 2, quorum_id=1), [0, 1])
        run_ranks(lambda r: groups[r].allreduce([torch.ones(3)], ReduceOp.SUM).wait(), [0, 1])
        started = time.monotonic()
        with pytest.raises(TimeoutError) as info:  # rank 1 is alive but never calls
            groups[0].allreduce([torch.ones(3)], ReduceOp.SUM).wait()
        elapsed = time.monotonic() - started
        assert isinstance(info.value, FTTimeoutError)
        assert elapsed <= timeout + 2, f"took {elapsed:.2f}s"
        assert isinstance(groups[0].errored(), FTTimeoutError)
        # The survivors rebuild (here: rank 0 alone) and go on.
        groups[0].configure(addr(store, "hung-after"), "a", 0, 1, quorum_id=2)
        t = torch.full((3,), 4.0)
        groups[0].allreduce([t], ReduceOp.SUM).wait()
        assert torch.equal(t, torch.full((3,), 4.0)) and groups[0].errored() is None
    finally:
        for group in groups:
            group.shutdown()


@pytest.mark.timeout(60)
def test_baby_peer_process_killed_mid_allreduce_survivors_fail_then_continue(store):
    timeout = 2.0
    groups = [ProcessGroupBabyGloo(timeout=timedelta(seconds=timeout)) for _ in range(3)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "kill/1"), "a", r, 3, quorum_id=1), [0, 1, 2])
        big = [torch.ones(2_000_000) for _ in range(3)]
        works = [groups[r].allreduce([big[r]], ReduceOp.SUM) for r in range(3)]
        groups[2]._child.proc.kill()  # the peer's backend process dies with SIGKILL mid-collective
        killed = time.monotonic()

        def survivor(rank: int) -> float:
            with pytest.raises((ProcessGroupError, FTTimeoutError)):
                works[rank].wait()
                # a ring step may have finished before the kill: the next op must fail
                groups[rank].allreduce([big[rank]], ReduceOp.SUM).wait()
            return time.monotonic() - killed

        elapsed = run_ranks(survivor, [0, 1])
        assert max(elapsed) <= timeout + 2, elapsed
        run_ranks(lambda r: groups[r].configure(addr(store, "kill/2"), "a", r, 2, quorum_id=2), [0, 1])
        out = run_ranks(lambda r: (groups[r].allreduce([torch.full((4,), r + 1.0)], ReduceOp.SUM)
                                   .get_future().wait()[0]), [0, 1])
        assert all(torch.equal(t, torch.full((4,), 3.0)) for t in out)
    finally:
        for group in groups:
            group.shutdown()


def test_configure_without_peers_fails_within_timeout(store):
    group = ProcessGroupGloo(timeout=timedelta(seconds=1))
    started = time.monotonic()
    with pytest.raises(FTTimeoutError, match="configure"):
        group.configure(addr(store, "lonely"), "a", 0, 2)
    assert_bounded(started, 1, "configure without peers")
    group.shutdown()


def test_configure_with_unreachable_store_fails_within_timeout():
    probe = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = probe.port
    del probe  # nothing listens there now
    group = ProcessGroupGloo(timeout=timedelta(seconds=1))
    started = time.monotonic()
    with pytest.raises((FTTimeoutError, ProcessGroupError)):
        group.configure(f"127.0.0.1:{port}/x", "a", 0, 2)
    assert_bounded(started, 1, "configure with an unreachable store")


@pytest.mark.parametrize("store_addr, rank, world, match", [
    ("127.0.0.1:1", 0, 2, "host:port/prefix"),
    ("127.0.0.1:1/p", 2, 2, "rank 2 is outside"),
    ("127.0.0.1:1/p", 0, 0, "world_size"),
])
def test_configure_rejects_bad_arguments(store_addr, rank, world, match):
    for cls in GROUP_TYPES:
        with pytest.raises(ProcessGroupError, match=match):
            cls().configure(store_addr, "a", rank, world)


def test_ops_before_configure_are_a_clear_error():
    for cls in GROUP_TYPES:
        with pytest.raises(ProcessGroupError, match="not configured"):
            cls().allreduce([torch.ones(1)])


@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_an_op_that_cannot_be_issued_is_a_clear_error_and_leaves_the_group_healthy(cls, store):
    groups = [cls(timeout=timedelta(seconds=5)) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "bad-op"), "a", r, 2), [0, 1])

        def step(rank: int) -> torch.Tensor:
            with pytest.raises(ProcessGroupError, match="could not be issued"):
                groups[rank].allgather([[torch.ones(2)]], [torch.ones(2)]).wait()  # needs 2 outputs
            assert groups[rank].errored() is None
            t = torch.ones(2)
            groups[rank].allreduce([t], ReduceOp.SUM).wait()
            return t

        assert all(torch.equal(t, torch.full((2,), 2.0)) for t in run_ranks(step, [0, 1]))
    finally:
        for group in groups:
            group.shutdown()


def test_baby_children_can_also_be_spawned_from_scratch(store):
    group = ProcessGroupBabyGloo(timeout=timedelta(seconds=5), start_method="spawn")
    try:
        group.configure(addr(store, "spawned"), "a", 0, 1)
        t = torch.ones(2)
        group.allreduce([t], ReduceOp.SUM).wait()
        assert torch.equal(t, torch.ones(2))
    finally:
        group.shutdown()
    with pytest.raises(ConfigError, match="start_method"):
        ProcessGroupBabyGloo(start_method="fork")


# ---------------------------------------------------------------- torch integration

def test_torch_apis_accept_our_group_and_functional_collectives_resolve_it(store):
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "torch-api"), "a", r, 2), [0, 1])

        def use(rank: int) -> tuple:
            t = torch.full((3,), rank + 1.0)
            dist.all_reduce(t, group=groups[rank])  # torch's Python API
            registered = groups[rank].register(f"test-{rank}")
            assert registered.group_name == f"ft-gloo:test-{rank}"
            f = funcol.all_reduce(torch.full((2,), rank + 1.0), "sum", registered)  # through torch's C++ registry
            f = funcol.wait_tensor(f)
            groups[rank].unregister()
            return t, f

        for t, f in run_ranks(use, [0, 1]):
            assert torch.equal(t, torch.full((3,), 3.0)) and torch.equal(f, torch.full((2,), 3.0))
    finally:
        for group in groups:
            group.shutdown()


def test_ddp_over_dummy_group_with_comm_hook_averages_through_our_group(store):
    """torch's C++ reads a c10d group's size once, at construction, so DDP takes a ProcessGroupDummy
    (size 1, fixed) and a comm hook sends the buckets over the reconfigurable group (as ft_core.ddp does)."""
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "ddp"), "a", r, 2), [0, 1])

        def train(rank: int) -> torch.Tensor:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ProcessGroupDummy())

            def hook(pg, bucket):  # (no annotations: DDP checks them literally)
                grads = bucket.buffer()
                fut = pg.allreduce([grads], ReduceOp.SUM).get_future()
                return fut.then(lambda f: f.value()[0] / pg.size())

            ddp.register_comm_hook(groups[rank], hook)
            ddp(torch.full((2, 4), rank + 1.0)).sum().backward()
            return model.weight.grad.clone()

        g0, g1 = run_ranks(train, [0, 1])
        # The mean of the two ranks' gradients: (2*1 + 2*2) / 2 per weight.
        assert torch.allclose(g0, g1) and torch.allclose(g0, torch.full((1, 4), 3.0))
    finally:
        for group in groups:
            group.shutdown()


# ---------------------------------------------------------------- wrappers

def test_fake_wrapper_injects_an_error_into_the_next_op_only(store):
    groups = [FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10))) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "fake"), "a", r, 2), [0, 1])
        groups[0].report_future_error(RuntimeError("injected"))

        def step(rank: int) -> tuple:
            first = groups[rank].allreduce([torch.ones(2)], ReduceOp.SUM)
            try:
                first.get_future().wait()
                failed = None
            except RuntimeError as exc:
                failed = str(exc)
            t = torch.ones(2)
            groups[rank].allreduce([t], ReduceOp.SUM).wait()
            return failed, t

        (failed0, t0), (failed1, t1) = run_ranks(step, [0, 1])
        assert failed0 is not None and "injected" in failed0 and failed1 is None
        assert torch.equal(t0, torch.full((2,), 2.0)) and torch.equal(t1, torch.full((2,), 2.0))
    finally:
        for group in groups:
            group.shutdown()


def test_error_swallowing_wrapper_turns_ops_into_noops_until_configure(store):
    fakes = [FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=10))) for _ in range(2)]
    groups = [ErrorSwallowingProcessGroupWrapper(f) for f in fakes]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "swallow/1"), "a", r, 2), [0, 1])
        for fake in fakes:  # both see the failure, as both would when a collective breaks
            fake.report_future_error(ProcessGroupError("peer lost"))

        def step(rank: int) -> tuple:
            t = torch.ones(2)
            assert groups[rank].allreduce([t], ReduceOp.SUM).wait()
            later = torch.ones(2)
            value = groups[rank].allreduce([later], ReduceOp.SUM).get_future().wait()
            return t, later, value

        (t0, later0, value0), _ = run_ranks(step, [0, 1])
        assert isinstance(groups[0].error(), ProcessGroupError) and groups[0].errored() is groups[0].error()
        assert torch.equal(later0, torch.ones(2)) and value0[0] is later0  # a no-op returning its input
        run_ranks(lambda r: groups[r].configure(addr(store, "swallow/2"), "a", r, 2), [0, 1])
        assert groups[0].error() is None
        out = run_ranks(lambda r: groups[r].allreduce([torch.ones(2)], ReduceOp.SUM).get_future().wait()[0], [0, 1])
        assert all(torch.equal(t, torch.full((2,), 2.0)) for t in out)
    finally:
        for group in groups:
            group.shutdown()


class _TinyManager:
    """The two methods ManagedProcessGroup needs, over a real Gloo group (AVG = SUM / participants)."""

    def __init__(self, pg: ProcessGroup, participants: int) -> None:
        self.pg = pg
        self.participants = participants
        self.calls = 0

    def num_participants(self) -> int:
        return self.participants

    def allreduce(self, tensor: torch.Tensor, reduce_op=ReduceOp.AVG):
        self.calls += 1
        work = self.pg.allreduce([tensor], ReduceOp.SUM)
        if reduce_op == ReduceOp.AVG:
            work.wait()
            tensor /= self.participants
        return work


def test_managed_group_routes_allreduce_through_the_manager(store):
    groups = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    try:
        run_ranks(lambda r: groups[r].configure(addr(store, "managed"), "a", r, 2), [0, 1])
        managers = [_TinyManager(g, 2) for g in groups]
        managed = [ManagedProcessGroup(m) for m in managers]
        assert managed[0].size() == 2 and managed[0].getBackendName() == "ft-managed"

        def step(rank: int) -> torch.Tensor:
            t = torch.full((3,), rank * 2.0)
            dist.all_reduce(t, op=ReduceOp.AVG, group=managed[rank])
            return t

        out = run_ranks(step, [0, 1])
        assert all(torch.equal(t, torch.full((3,), 1.0)) for t in out)
        assert [m.calls for m in managers] == [1, 1]
        # other collectives go to the manager's own group (torchft); this tiny manager has none
        with pytest.raises(ProcessGroupError, match="no process group to forward to"):
            managed[0].broadcast([torch.ones(1)])
    finally:
        for group in groups:
            group.shutdown()


def test_dummy_group_is_world_size_one_and_completes_at_once():
    pg = ProcessGroupDummy()
    assert pg.size() == 1 and pg.rank() == 0
    t = torch.arange(3.0)
    assert pg.allreduce([t]).get_future().wait()[0] is t
    outs = [torch.zeros(3)]
    pg.allgather([outs], [t]).wait()
    assert torch.equal(outs[0], t)
    flat = torch.zeros(3)
    pg.allgather_into_tensor_coalesced([flat], [t]).wait()
    assert torch.equal(flat, t)
    pg.barrier().wait()
    pg.configure("127.0.0.1:1/x", "a", 0, 1)
    assert pg.configure_count == 1
