"""torchft's public API as a torchft user calls it, against real servers and real process groups.

Each test ports one torchft call site unchanged (names, argument spelling, return shapes): the
lighthouse client's constructor and keyword quorum, QuorumMember.data as a dict, None for defaults
on LighthouseServer, PGTransport as a generic, wrappers' `parent`, ManagedProcessGroup forwarding
the other collectives, the DDP wrapper going through the public Manager.allreduce (so an override
is honoured), `should_quantize`, `num_active_work()`, and `torchft.local_sgd`'s names.
DTensor state in both transports: tests/test_dtensor_transport.py.
"""

from __future__ import annotations

import inspect
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ft_core
from torch.distributed import ReduceOp

from ft_core.checkpointing import HTTPTransport, PGTransport
from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.ddp import DistributedDataParallel
from ft_core.errors import ConfigError
from ft_core.local_sgd import DiLoCo, LocalSGD
from ft_core.manager import Manager
from ft_core.process_groups import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
)

TIMEOUT = timedelta(seconds=10)


@pytest.mark.timeout(30)
def test_lighthouse_client_keyword_quorum_with_dict_data():
    # torchft: LighthouseServer(bind=..., min_replicas=..., join_timeout_ms=None) takes the defaults
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=None, quorum_tick_ms=None,
                          heartbeat_timeout_ms=None) as lighthouse:
        assert lighthouse.config.join_timeout_ms == 60_000 and lighthouse.config.heartbeat_timeout_ms == 5_000
        client = LighthouseClient(addr=lighthouse.address(), connect_timeout=timedelta(seconds=5))
        try:
            quorum = client.quorum(replica_id="lighthouse_test", timeout=timedelta(seconds=5),
                                   address="127.0.0.1:1234", store_address="127.0.0.1:5678", step=10,
                                   world_size=2, shrink_only=False, data={"my_data": 1234})
            member = quorum.participants[0]
            assert (member.replica_id, member.address, member.store_address, member.step, member.world_size) == \
                ("lighthouse_test", "127.0.0.1:1234", "127.0.0.1:5678", 10, 2)
            assert member.data == {"my_data": 1234}  # a dict, as torchft gives it
            client.heartbeat("lighthouse_test")
            # no data: None, as in torchft
            again = client.quorum("lighthouse_test", timedelta(seconds=5), step=11)
            assert again.participants[0].data is None
            with pytest.raises(ConfigError, match="dict"):
                client.quorum("lighthouse_test", timedelta(seconds=5), data=[1, 2])
        finally:
            client.close()
        with pytest.raises(ConfigError, match="not both"):
            LighthouseClient(lighthouse.address(), addr=lighthouse.address())


def test_pg_transport_is_generic_and_wrappers_have_parent():
    inner = ProcessGroupDummy()
    transport = PGTransport[dict[str, object]](inner, timeout=timedelta(seconds=5))
    assert isinstance(transport, PGTransport)
    http = HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
    http.shutdown()
    swallowing = ErrorSwallowingProcessGroupWrapper(pg=inner)
    fake = FakeProcessGroupWrapper(pg=inner)
    assert swallowing.parent is inner and fake.parent is inner
    wrapped = ProcessGroupWrapper(pg=inner)  # torchft: a wrapper around any group
    assert isinstance(wrapped, ProcessGroupWrapper) and wrapped.parent is inner and wrapped.size() == 1
    t = torch.ones(2)
    wrapped.allreduce([t], ReduceOp.SUM).wait()
    assert torch.equal(t, torch.ones(2))
    assert type(ProcessGroupGloo(timeout=timedelta(seconds=5))) is ProcessGroupGloo  # backends unaffected


def _managers(lighthouse: LighthouseServer, n: int, body: Any, manager_cls: type = Manager) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        pg = ProcessGroupGloo(timeout=TIMEOUT)
        manager = manager_cls(pg, lighthouse_addr=lighthouse.address(), replica_id=f"r{i}", timeout=TIMEOUT,
                              quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, init_sync=False)
        try:
            results[i] = body(manager, i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        finally:
            manager.shutdown()
            pg.shutdown()

    threads = [threading.Thread(target=run, args=(i,), name=f"compat-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(60)
def test_managed_process_group_forwards_other_collectives_to_the_managers_group():
    def body(manager: Manager, i: int) -> dict[str, Any]:
        managed = ManagedProcessGroup(manager)
        manager.start_quorum()
        t = torch.tensor([float(i + 1)])
        managed.allreduce([t], ReduceOp.SUM).wait()  # through manager.allreduce (commit-gated)
        outputs = [[torch.zeros(1) for _ in range(2)]]
        managed.allgather(outputs, [torch.tensor([10.0 * (i + 1)])]).wait()  # forwarded to the manager's group
        b = torch.tensor([float(i)])
        managed.broadcast([b], 0).wait()
        return {"sum": t.item(), "gathered": [x.item() for x in outputs[0]], "broadcast": b.item(),
                "size": managed.size(), "parent": managed.parent is manager._pg, "commit": manager.should_commit()}

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000) as lighthouse:
        results = _managers(lighthouse, 2, body)
    for r in results:
        assert r == {"sum": 3.0, "gathered": [10.0, 20.0], "broadcast": 0.0, "size": 2, "parent": True,
                     "commit": True}


class CountingManager(Manager):
    """What torchft users do: wrap Manager.allreduce (here: count the calls)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG, should_quantize: bool = False):
        self.calls += 1
        return super().allreduce(tensor, reduce_op, should_quantize=should_quantize)


@pytest.mark.timeout(60)
def test_ddp_wrapper_goes_through_the_public_allreduce_and_should_quantize_is_accepted(caplog):
    def body(manager: CountingManager, i: int) -> dict[str, Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(manager, nn.Linear(3, 2))
        manager.start_quorum()
        model(torch.full((4, 3), float(i + 1))).sum().backward()
        grad = model.module.weight.grad.clone()
        t = torch.tensor([float(i)])
        with caplog.at_level(logging.WARNING, logger="ft_core.manager"):
            manager.allreduce(t, should_quantize=True).wait()
        return {"calls": manager.calls, "grad": grad, "avg": t.item(), "commit": manager.should_commit()}

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000) as lighthouse:
        a, b = _managers(lighthouse, 2, body, manager_cls=CountingManager)
    for r in (a, b):
        assert r["calls"] >= 2 and r["avg"] == 0.5 and r["commit"]
    assert torch.equal(a["grad"], b["grad"])  # averaged across the groups: (1 + 2) / 2 per input
    assert torch.allclose(a["grad"], torch.full((2, 3), 6.0))
    assert "should_quantize=True is ignored" in caplog.text


@pytest.mark.timeout(60)
def test_subprocess_group_counts_its_active_work():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    try:
        assert pg.num_active_work() == 0
        pg.configure(f"127.0.0.1:{store.port}/active", "r0", 0, 1)
        works = [pg.allreduce([torch.ones(4)], ReduceOp.SUM) for _ in range(3)]
        assert 0 <= pg.num_active_work() <= 3
        for work in works:
            work.wait()
        assert pg.num_active_work() == 0
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_subprocess_group_timeout_bounds_configure_against_a_store_that_never_completes():
    # torchft: ProcessGroupBabyGloo(timeout=...).configure(store_addr, replica_id, rank, world_size) raises
    # within `timeout` when the peers never arrive; no separate start-up timeout unless one is passed.
    import time

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = 3.0
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=timeout))
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="timeout|timed out|did not finish"):
            pg.configure(f"127.0.0.1:{store.port}/never", "r0", rank=0, world_size=2)  # rank 1 never comes
        assert time.monotonic() - started < timeout + 4  # about `timeout`: not 60 s of start-up allowance
        assert pg.num_active_work() == 0
        # An explicit start_timeout still gives start-up its own deadline, and the group then works.
        ok = ProcessGroupBabyGloo(timeout=timedelta(seconds=timeout), start_timeout=timedelta(seconds=60))
        try:
            ok.configure(f"127.0.0.1:{store.port}/alone", "r0", rank=0, world_size=1)
            t = torch.ones(2)
            ok.allreduce([t], ReduceOp.SUM).wait()
            assert torch.equal(t, torch.ones(2))
        finally:
            ok.shutdown()
    finally:
        pg.shutdown()


def test_local_sgd_names_and_knobs_match_torchft():
    params = inspect.signature(DiLoCo).parameters
    assert list(params)[:5] == ["manager", "model_fragments", "inner_optimizer", "outer_optimizer", "sync_every"]
    for knob in ("backup_device", "pin_memory", "use_bucketization", "bucket_cap_mb", "should_quantize",
                 "fragment_sync_delay", "fragment_update_alpha"):
        assert knob in params
    assert list(inspect.signature(LocalSGD).parameters) == ["manager", "model", "optimizer", "sync_every"]
    assert ft_core.DiLoCo is DiLoCo and ft_core.LocalSGD is LocalSGD


def test_kept_reductions_call_an_allreduce_with_torchfts_signature_without_keep_input():
    """DiLoCo, LocalSGD and Lightning's logged values ask for `keep_input` (ft_core.managed_work.allreduce_kept);
    a Manager whose allreduce was wrapped or overridden with torchft's signature is called without it."""
    from ft_core.managed_work import allreduce_kept

    calls: list[Any] = []

    class Wrapped:
        def allreduce(self, tensor, reduce_op=ReduceOp.AVG, should_quantize=False):  # torchft's
            calls.append(("torchft", reduce_op))

    class Forwarding:
        def allreduce(self, *args, **kwargs):
            calls.append(("forwarding", kwargs))

    class Ours:
        def allreduce(self, tensor, reduce_op=ReduceOp.AVG, should_quantize=False, *, divided_by=None,
                      keep_input=False):
            calls.append(("ours", keep_input))

    t = torch.zeros(2)
    allreduce_kept(Wrapped(), t, ReduceOp.SUM)
    allreduce_kept(Forwarding(), t)
    allreduce_kept(Ours(), t)
    assert calls == [("torchft", ReduceOp.SUM), ("forwarding", {"keep_input": True}), ("ours", True)]
