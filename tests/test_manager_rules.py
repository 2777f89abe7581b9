"""Pure rules of the Manager and its helpers: participation, sampler shards, canonical DDP chunks, futures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import assert_bounded
from ft_core import futures as ft_futures
from ft_core.data import DistributedSampler, global_shard
from ft_core.ddp import canonical_chunks, reducer_parameters
from ft_core.errors import ConfigError, FTTimeoutError
from ft_core.manager import WorldSizeMode, participation, resolve_config
from ft_core.control.recovery import QuorumResult

D, F = WorldSizeMode.DYNAMIC, WorldSizeMode.FIXED_WITH_SPARES


def result(replica_rank: int, world: int, max_step: int, max_replica_rank: int | None, max_world: int,
           heal: bool = False) -> QuorumResult:
    return QuorumResult(quorum_id=1, replica_rank=replica_rank, replica_world_size=world,
                        recover_src_manager_address="", recover_src_replica_rank=None, max_step=max_step,
                        max_replica_rank=max_replica_rank, max_world_size=max_world, heal=heal)


@pytest.mark.parametrize("res,use_async,allow_heal,init_sync,mode,min_size,expected", [
    # up to date, async: rank among the groups at max_step
    (result(1, 3, 5, 1, 3), True, True, True, D, 1, (1, 3)),
    # behind (healing) in async mode: not a participant; the others count
    (result(0, 3, 5, None, 2, heal=True), True, True, True, D, 1, (None, 2)),
    # sync mode heals before the forward pass: everyone contributes
    (result(0, 3, 5, None, 2, heal=True), False, True, True, D, 1, (0, 3)),
    # sync mode without healing: like async
    (result(0, 3, 5, None, 2), False, False, True, D, 1, (None, 2)),
    # step 0 with init_sync: only the first group contributes, the rest heal from it
    (result(0, 3, 0, 0, 3), True, True, True, D, 1, (0, 1)),
    (result(2, 3, 0, 2, 3, heal=True), True, True, True, D, 1, (None, 1)),
    # step 0 without init_sync: everyone contributes
    (result(2, 3, 0, 2, 3), True, True, False, D, 1, (2, 3)),
    # fixed with spares: exactly min_replica_size contribute, the rest are spares
    (result(2, 3, 7, 2, 3), True, True, True, F, 2, (None, 2)),
    (result(1, 3, 7, 1, 3), True, True, True, F, 2, (1, 2)),
    (result(0, 1, 7, 0, 1), True, True, True, F, 2, (0, 1)),
])
def test_participation_rules(res, use_async, allow_heal, init_sync, mode, min_size, expected):
    assert participation(res, use_async_quorum=use_async, allow_heal=allow_heal, init_sync=init_sync, mode=mode,
                         min_replica_size=min_size) == expected


def test_config_environment_overrides_arguments_and_names_bad_values(monkeypatch):
    base = dict(replica_id="g7", rank=None, world_size=None, min_replica_size=1, use_async_quorum=True, timeout=60,
                quorum_timeout=60, connect_timeout=60, world_size_mode=D, lighthouse_addr="127.0.0.1:1", port=None,
                hostname="127.0.0.1", heartbeat_interval=0.1, init_sync=True, max_retries=None, quorum_retries=0,
                token=None)
    monkeypatch.setenv("FT_TIMEOUT_SEC", "2.5")
    monkeypatch.setenv("FT_LIGHTHOUSE", "127.0.0.1:9,127.0.0.1:10")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = resolve_config(**base)
    assert cfg.timeout.total_seconds() == 2.5
    assert cfg.lighthouse_addr == "127.0.0.1:9,127.0.0.1:10"
    assert (cfg.group_rank, cfg.group_world_size) == (1, 2)
    assert cfg.replica_id.startswith("g7:") and resolve_config(**base).replica_id != cfg.replica_id  # fresh suffix
    monkeypatch.setenv("FT_QUORUM_TIMEOUT_SEC", "soon")
    with pytest.raises(ConfigError, match="FT_QUORUM_TIMEOUT_SEC"):
        resolve_config(**base)
    monkeypatch.delenv("FT_QUORUM_TIMEOUT_SEC")
    with pytest.raises(ConfigError, match="min_replica_size"):
        resolve_config(**{**base, "min_replica_size": 0})
    with pytest.raises(ConfigError, match="group rank"):
        resolve_config(**{**base, "rank": 2, "world_size": 2})


@pytest.mark.parametrize("groups,ranks", [(1, 1), (2, 1), (3, 2)])
def test_sampler_shards_are_disjoint_and_cover_the_dataset(groups, ranks):
    data = list(range(97))
    seen: list[int] = []
    for g in range(groups):
        for r in range(ranks):
            sampler = DistributedSampler(data, replica_rank=g, num_replica_groups=groups, group_rank=r,
                                         num_replicas=ranks, shuffle=True, seed=3, drop_last=True)
            seen += list(sampler)
    assert len(seen) == len(set(seen)) == (97 // (groups * ranks)) * groups * ranks
    assert global_shard(1, 2, 1, 2) == (3, 4)
    with pytest.raises(ConfigError, match="replica_rank"):
        global_shard(2, 2, 0, 1)


def test_canonical_chunks_follow_reverse_parameter_order_and_caps():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    params = reducer_parameters(model)
    assert len(params) == 6
    everything = canonical_chunks(params, 10**9, 10**9)
    assert everything == [[5, 4, 3, 2, 1, 0]]
    # first chunk closes at >= 40 KB (10100 floats = 40.4 KB), later ones at >= 80 KB
    chunks = canonical_chunks(params, 40_000, 80_000)
    assert [i for c in chunks for i in c] == [5, 4, 3, 2, 1, 0]
    assert chunks[0] == [5, 4, 3, 2]
    # deterministic: a second model built the same way gives the same chunks
    again = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    assert canonical_chunks(reducer_parameters(again), 40_000, 80_000) == chunks


def test_future_timeout_fails_on_time_and_passes_values_through():
    slow: torch.futures.Future = torch.futures.Future()
    started = time.monotonic()
    timed = ft_futures.future_timeout(slow, 0.2, what="test op")
    with pytest.raises(FTTimeoutError, match="test op"):
        timed.wait()
    assert assert_bounded(started, 0.2, "a 0.2 s future timeout") > 0.15
    slow.set_result(1)  # completing late changes nothing
    assert any(t.name == "ft-timer" for t in threading.enumerate())

    fast: torch.futures.Future = torch.futures.Future()
    timed = ft_futures.future_timeout(fast, 5)
    fast.set_result(42)
    assert timed.wait() == 42


def test_recover_reports_error_and_returns_default():
    errors: list[BaseException] = []
    fut = ft_futures.recover(ft_futures.failed_future(ValueError("boom")), "default", errors.append)
    assert fut.wait() == "default"
    assert [str(e) for e in errors] == ["boom"]
    with pytest.raises(FTTimeoutError):
        ft_futures.future_wait(torch.futures.Future(), 0.05)
    assert ft_futures.future_wait(ft_futures.completed_future(3), 1) == 3


def _boom(_v: object) -> object:
    raise ValueError("boom")


@pytest.mark.parametrize("outcome,fn,timeout,expected,errors", [
    ("value", None, 5, "value", []),                        # passes the value through
    ("value", lambda v: v + "!", 5, "value!", []),          # the continuation's result
    ("value", _boom, 5, "default", ["ValueError"]),         # a failing continuation: default, reported
    (ValueError("x"), lambda v: v + "!", 5, "default", ["ValueError"]),  # a failed input skips fn
    (None, None, 0.05, "default", ["FTTimeoutError"]),      # never completes: default at the deadline
])
def test_settled_is_chain_timeout_and_recover_in_one(outcome, fn, timeout, expected, errors):
    source: torch.futures.Future = torch.futures.Future()
    seen: list[BaseException] = []
    out = ft_futures.settled(source, "default", seen.append, timeout, fn, what="test op")
    if isinstance(outcome, BaseException):
        source.set_exception(outcome)
    elif outcome is not None:
        source.set_result(outcome)
    assert out.wait() == expected
    assert [type(e).__name__ for e in seen] == errors
    if outcome is None:
        source.set_result("late")  # completing after the deadline changes nothing, reports nothing more
        assert out.wait() == "default" and len(seen) == 1


def test_context_timeout_runs_callback_only_when_block_overruns():
    fired = threading.Event()
    with ft_futures.context_timeout(fired.set, 5):
        pass
    time.sleep(0.05)
    assert not fired.is_set()
    with ft_futures.context_timeout(fired.set, 0.05):
        assert fired.wait(2)
