"""PGTransport over a real Gloo group: one thread per rank, a TCPStore on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import assert_bounded
from ft_core.checkpointing import PGTransport
from ft_core.errors import CheckpointError, FTTimeoutError
from tests.test_serialization import assert_same, nasty_state

LONG = timedelta(seconds=20)


def gloo_group(world_size: int, timeout: timedelta = LONG) -> list[Any]:
    """One ProcessGroupGloo per rank, created concurrently (as separate processes would)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=LONG)
    groups: list[Any] = [None] * world_size

    def make(rank: int) -> None:
        # each rank its own store client: one client's blocking get would stall the others
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=LONG)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pgt", client), rank, world_size, options)

    threads = [threading.Thread(target=make, args=(r,), name=f"test-gloo-{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return groups


def run_ranks(jobs: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Run each rank's job in its own thread; returns results (or the exception each raised)."""
    results: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = jobs[rank]()
        except Exception as exc:  # noqa: BLE001 - inspected by the caller
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"test-rank-{r}") for r in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_one_source_heals_two_receivers_then_one() -> None:
    pgs = gloo_group(3)
    transports = [PGTransport(pg, timeout=LONG) for pg in pgs]
    first = nasty_state()
    results = run_ranks({
        0: lambda: transports[0].send_checkpoint([1, 2], 1, first, LONG),
        1: lambda: transports[1].recv_checkpoint(0, "<n/a>", 1, LONG),
        2: lambda: transports[2].recv_checkpoint(0, "<n/a>", 1, LONG),
    })
    assert results[0] is None
    assert_same(first, results[1])
    assert_same(first, results[2])
    assert results[1]["row_view"].untyped_storage().data_ptr() == results[1]["base"].untyped_storage().data_ptr()

    second = {"w": torch.randn(1000), "step": 2, "t": (1, "x")}
    results = run_ranks({
        0: lambda: transports[0].send_checkpoint([2], 2, second, LONG),
        2: lambda: transports[2].recv_checkpoint(0, "<n/a>", 2, LONG),
    })
    assert results[0] is None
    assert_same(second, results[2])


def test_in_place_receive_fills_the_local_tensors() -> None:
    pgs = gloo_group(2)
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "strided": torch.arange(8.0)[::2],
             "opt": {"lr": 0.1}}
    local = {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}, "strided": torch.zeros(4)}
    receiver = PGTransport(pgs[1], timeout=LONG, state_dict=lambda: local)
    results = run_ranks({0: lambda: PGTransport(pgs[0], timeout=LONG).send_checkpoint([1], 5, state, LONG),
                         1: lambda: receiver.recv_checkpoint(0, "<n/a>", 5, LONG)})
    out = results[1]
    assert_same(state, out)
    assert out["model"]["w"] is local["model"]["w"] and out["model"]["b"] is local["model"]["b"]
    assert out["strided"] is local["strided"] and torch.equal(local["strided"], torch.tensor([0.0, 2, 4, 6]))


def test_wrong_step_is_a_clear_error_and_the_group_stays_usable() -> None:
    pgs = gloo_group(2)
    sender, receiver = PGTransport(pgs[0], timeout=LONG), PGTransport(pgs[1], timeout=LONG)
    state = {"w": torch.randn(100)}
    results = run_ranks({0: lambda: sender.send_checkpoint([1], 3, state, LONG),
                         1: lambda: receiver.recv_checkpoint(0, "<n/a>", 4, LONG)})
    assert results[0] is None  # the source is not left hanging
    assert isinstance(results[1], CheckpointError) and "sent step 3 but step 4 was expected" in str(results[1])
    results = run_ranks({0: lambda: sender.send_checkpoint([1], 4, state, LONG),
                         1: lambda: receiver.recv_checkpoint(0, "<n/a>", 4, LONG)})
    assert_same(state, results[1])


def test_receive_timeout_of_10ms_raises_timeout_error_quickly() -> None:
    pgs = gloo_group(2)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        PGTransport(pgs[1], timeout=LONG).recv_checkpoint(0, "<n/a>", 1, timedelta(milliseconds=10))
    assert_bounded(start, 0.01, "a 10 ms receive")
    assert isinstance(info.value, FTTimeoutError)


def test_unsupported_state_is_refused_before_anything_is_sent() -> None:
    pgs = gloo_group(2)
    with pytest.raises(CheckpointError, match=r"state\['bad'\].*object"):
        PGTransport(pgs[0], timeout=LONG).send_checkpoint([1], 1, {"bad": object()}, LONG)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_over_gloo_arrives_on_the_cpu() -> None:
    pgs = gloo_group(2)
    state = {"w": torch.randn(1000, device="cuda")}
    results = run_ranks({0: lambda: PGTransport(pgs[0], timeout=LONG).send_checkpoint([1], 1, state, LONG),
                         1: lambda: PGTransport(pgs[1], timeout=LONG).recv_checkpoint(0, "<n/a>", 1, LONG)})
    assert results[1]["w"].device.type == "cpu" and torch.equal(results[1]["w"], state["w"].cpu())
