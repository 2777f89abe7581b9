"""NCCL and BabyNCCL process groups. Skipped without CUDA; two-rank tests need 2 GPUs (NCCL refuses
two ranks on one device)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from test_process_group_helpers import run_ranks
from torch._C._distributed_c10d import ReduceOp, TCPStore

from ft_core.errors import FTTimeoutError
from ft_core.process_groups import ProcessGroupBabyNCCL, ProcessGroupNCCL
from ft_core.process_groups.child import nccl_version, supports_nonblocking_abort

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (NCCL allows one rank per device)")
GROUP_TYPES = [ProcessGroupNCCL, ProcessGroupBabyNCCL]
pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _baby_start_timeout(monkeypatch):
    # Short op timeouts here; a subprocess group's configure is bounded by `timeout` alone (torchft's rule),
    # and its child's CUDA start-up needs a deadline of its own.
    monkeypatch.setenv("FT_BABY_START_TIMEOUT_SEC", "60")


@pytest.fixture
def store():
    yield TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def addr(store: TCPStore, prefix: str) -> str:
    return f"127.0.0.1:{store.port}/{prefix}"


@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_single_rank_collectives_on_one_gpu(cls, store):
    torch.cuda.set_device(0)
    group = cls(timeout=timedelta(seconds=20))
    try:
        group.configure(addr(store, "one"), "a", 0, 1, quorum_id=1)
        x = torch.arange(8, dtype=torch.float32, device="cuda")
        y = x * 2  # produced on the current stream just before the op: the child must wait for it
        group.allreduce([y], ReduceOp.SUM).wait()
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.arange(8, dtype=torch.float32) * 2)
        out = torch.zeros(8, device="cuda", dtype=torch.bfloat16)
        group.allgather_into_tensor_coalesced([out], [x.to(torch.bfloat16)]).get_future().wait()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), x.cpu().to(torch.bfloat16))
        assert group.errored() is None
    finally:
        group.shutdown()


@needs_2_gpus
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_two_ranks_reduce_gather_broadcast_and_reconfigure(cls, store):
    groups = [cls(timeout=timedelta(seconds=20)) for _ in range(2)]

    def setup(rank: int) -> None:
        torch.cuda.set_device(rank)
        groups[rank].configure(addr(store, "two/1"), "a", rank, 2, quorum_id=1)

    def play(rank: int) -> tuple:
        torch.cuda.set_device(rank)
        t = torch.full((1024,), rank + 1.0, device=f"cuda:{rank}")
        groups[rank].allreduce([t], ReduceOp.SUM).wait()
        outs = [torch.zeros(4, device=f"cuda:{rank}") for _ in range(2)]
        groups[rank].allgather([outs], [torch.full((4,), float(rank), device=f"cuda:{rank}")]).wait()
        b = torch.full((4,), float(rank), device=f"cuda:{rank}")
        groups[rank].broadcast([b], 1).wait()
        rs = torch.zeros(2, device=f"cuda:{rank}")
        groups[rank].reduce_scatter_tensor_coalesced([rs], [torch.arange(4.0, device=f"cuda:{rank}")]).wait()
        torch.cuda.synchronize()
        return t[0].item(), [o[0].item() for o in outs], b[0].item(), rs.tolist()

    try:
        run_ranks(setup, [0, 1])
        for rank, (t, outs, b, rs) in enumerate(run_ranks(play, [0, 1])):
            assert t == 3.0 and outs == [0.0, 1.0] and b == 1.0
            assert rs == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        run_ranks(lambda r: (torch.cuda.set_device(r),
                             groups[r].configure(addr(store, "two/2"), "a", r, 2, quorum_id=2)), [0, 1])
        assert all(res[0] == 3.0 for res in run_ranks(play, [0, 1]))
    finally:
        for group in groups:
            group.shutdown()


@needs_2_gpus
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_hung_peer_is_an_error_within_timeout_and_the_process_survives(cls, store):
    if cls is ProcessGroupNCCL and not supports_nonblocking_abort(nccl_version()):
        pytest.skip(f"NCCL {nccl_version()} < 2.25: a hung op ends the process (blocking fallback), by design")
    timeout = 3.0
    groups = [cls(timeout=timedelta(seconds=timeout)) for _ in range(2)]
    try:
        run_ranks(lambda r: (torch.cuda.set_device(r),
                             groups[r].configure(addr(store, "hung"), "a", r, 2, quorum_id=1)), [0, 1])
        torch.cuda.set_device(0)
        started = time.monotonic()
        t = torch.ones(16, device="cuda:0")
        try:
            groups[0].allreduce([t], ReduceOp.SUM).wait()  # rank 1 never calls
            error = None
            while error is None and time.monotonic() - started < timeout + 2:
                error = groups[0].errored()  # NCCL: the deadline aborts the communicator
                time.sleep(0.05)
        except TimeoutError as exc:  # Baby: wait() itself fails and the child is killed
            error = exc
        assert isinstance(error, FTTimeoutError), error
        assert time.monotonic() - started <= timeout + 2
        groups[0].configure(addr(store, "hung-after"), "a", 0, 1, quorum_id=2)
        t = torch.ones(4, device="cuda:0")
        groups[0].allreduce([t], ReduceOp.SUM).wait()
        torch.cuda.synchronize()
        assert t.sum().item() == 4.0 and groups[0].errored() is None
    finally:
        for group in groups:
            group.shutdown()


@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", GROUP_TYPES, ids=lambda c: c.__name__)
def test_op_future_orders_a_reader_on_another_stream_without_synchronize(cls, store):
    """The op's future is made for its tensors' device: waiting on it from another stream orders that
    stream after the op (and the op after the producer's kernels), with no synchronize()."""
    torch.cuda.set_device(0)
    group = cls(timeout=timedelta(seconds=20))
    try:
        group.configure(addr(store, f"order-{cls.__name__}"), "a", 0, 1, quorum_id=1)
        producer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        t = torch.zeros(1 << 24, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)  # the producer lags: an unordered read sees zeros
            t.fill_(3.0)
            fut = group.allreduce([t], ReduceOp.SUM).get_future()
        with torch.cuda.stream(reader):
            fut.wait()
            wrong = int((t != 3.0).sum().item())  # waits for the reader stream only
        assert wrong == 0
        assert group.errored() is None
    finally:
        group.shutdown()
