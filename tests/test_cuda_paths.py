"""GPU stream order and device placement of the step protocol, plus the CPU behaviour of the same code.

The CUDA tests read results on the current stream WITHOUT torch.cuda.synchronize(): a future that
is not device-aware (or a continuation on a stream nobody waits for) makes them read the value
before the collective or its AVG division ran. They skip without CUDA (and the multi-GPU ones
without enough GPUs); scripts/gpu_check.sh runs them on a GPU machine (docs/gpu.md).
This file is also the worker of its multi-process tests: `python tests/test_cuda_paths.py MODE ...`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from ft_core import futures as ft_futures
from ft_core.checkpointing import HTTPTransport
from ft_core.errors import FTError, FTTimeoutError, ProcessGroupError
from ft_core.managed_work import ManagedWork
from ft_core.process_groups import (
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from ft_core.process_groups.child import (
    NONBLOCKING_ABORT_MIN_NCCL,
    parse_nccl_version,
    supports_nonblocking_abort,
)
from ft_lightning._common import from_transport, to_transport

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (the device must differ from cuda:0 to tell)")
needs_4_gpus = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs (2 groups x devices=2; NCCL allows one rank "
                                                   "of a communicator per GPU)")
TIMEOUT = timedelta(seconds=30)
BIG = 1 << 24  # 64 MB of float32: long enough in flight that an unordered read sees it unfinished
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- CPU: the same code paths

def test_cpu_futures_stay_plain_and_carry_values_and_errors():
    x = torch.ones(3)
    done = ft_futures.completed_future(x)
    assert ft_futures.future_devices(done) == [] and ft_futures.devices_of(x) == []
    doubled = ft_futures.chain(done, lambda v: v * 2)
    assert doubled.wait().tolist() == [2.0, 2.0, 2.0]
    timed = ft_futures.future_timeout(doubled, 5)
    assert timed.wait().tolist() == [2.0, 2.0, 2.0]
    # errors keep their type through chain and timeout; recover turns them into the default
    failed = ft_futures.chain(ft_futures.failed_future(FTTimeoutError("late")), lambda v: v)
    with pytest.raises(FTTimeoutError, match="late"):
        ft_futures.future_timeout(failed, 5).wait()
    seen: list[BaseException] = []
    assert ft_futures.recover(failed, x, seen.append).wait() is x
    assert isinstance(seen[0], FTTimeoutError)


def test_future_devices_are_known_for_our_futures_and_completed_foreign_ones():
    ours = ft_futures.device_future()
    assert ft_futures.future_devices(ours) == []
    pending: torch.futures.Future = torch.futures.Future()
    assert ft_futures.future_devices(pending) == []  # unknown yet: a plain future, as before
    pending.set_result([torch.zeros(1)])
    assert ft_futures.future_devices(pending) == []  # CPU values need no devices
    cf: concurrent.futures.Future = concurrent.futures.Future()
    cf.set_exception(ValueError("x"))
    assert ft_futures.future_devices(cf) == []
    assert ft_futures.devices_of({"a": [torch.zeros(1), (torch.zeros(1),)], "b": 3}) == []


def test_a_non_exception_error_still_completes_the_future():
    out = ft_futures.chain(ft_futures.completed_future(1), lambda _v: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(FTError, match="KeyboardInterrupt"):
        out.wait()


def test_device_initializers_are_no_ops_without_cuda_in_use():
    if CUDA and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process: covered by the CUDA tests")
    init = ft_futures.current_device_initializer()
    with concurrent.futures.ThreadPoolExecutor(1, initializer=init) as pool:
        assert pool.submit(lambda: 7).result(timeout=10) == 7
    assert ft_futures.with_current_device(len) is len
    assert not (CUDA and torch.cuda.is_initialized())  # asking for the device must not initialize CUDA


def test_managed_work_runs_continuations_once_at_wait_on_cpu():
    x = torch.full((4,), 3.0)
    work = ManagedWork(None, ft_futures.chain(ft_futures.completed_future(x), lambda v: v.div_(2)), x)  # type: ignore[arg-type]
    fut = work.get_future().then(lambda f: f.value() + 1)
    assert x.tolist() == [1.5] * 4  # the eager chain ran; the continuation waits for wait()
    assert fut.wait().tolist() == [2.5] * 4
    assert work.wait() and work.value().tolist() == [2.5] * 4


@pytest.mark.parametrize("raw, parsed, nonblocking", [
    ((2, 25, 1), (2, 25, 1), True),
    ((2, 26, 2, "+cuda12.8"), (2, 26, 2), True),
    ((3, 0, 0), (3, 0, 0), True),
    ((2, 21, 5), (2, 21, 5), False),
    ((2, 24, 99), (2, 24, 99), False),
    (22005, (2, 20, 5), False),  # the old int code, NCCL >= 2.9
    (2708, (2, 7, 8), False),  # the old int code, NCCL < 2.9
])
def test_nccl_version_guard_table(raw, parsed, nonblocking):
    assert parse_nccl_version(raw) == parsed
    assert supports_nonblocking_abort(parsed) is nonblocking
    assert NONBLOCKING_ABORT_MIN_NCCL == (2, 25)


def test_nccl_without_version_is_not_trusted_with_nonblocking_abort():
    assert supports_nonblocking_abort(None) is False


def test_blocking_fallback_refuses_to_run_without_a_process_level_timeout(monkeypatch):
    from ft_core.process_groups.backends import _check_blocking_fallback

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    with pytest.raises(ProcessGroupError, match=r"NCCL 2\.21\.5 .*needs NCCL >= 2\.25.*TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        _check_blocking_fallback((2, 21, 5))
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    _check_blocking_fallback((2, 21, 5))  # allowed: torch's watchdog ends a hung op's process


@pytest.mark.parametrize("cls", [ProcessGroupNCCL, ProcessGroupBabyNCCL], ids=lambda c: c.__name__)
def test_accelerator_groups_refuse_a_device_of_another_kind(cls):
    with pytest.raises(ProcessGroupError, match="cuda"):
        cls(timeout=TIMEOUT, device="cpu")


def test_heal_snapshot_is_a_host_copy_the_owner_can_keep_training_on():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    snap = to_transport({"model": model.state_dict(), "opt": optimizer.state_dict()}, clone=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    back = from_transport(snap)
    for name, tensor in expected.items():
        assert torch.equal(back["model"][name], tensor)
    assert back["opt"]["state"][0]["exp_avg"].device.type == "cpu"


def test_heal_leaves_no_pinned_staging_memory_held_on_cpu():
    with HTTPTransport(timeout=TIMEOUT) as src, HTTPTransport(timeout=TIMEOUT) as healer:
        src.send_checkpoint([1], 1, {"w": torch.arange(6.0)}, TIMEOUT)
        out = healer.recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
        src.disallow_checkpoint()
        assert torch.equal(out["w"], torch.arange(6.0))
        assert src._stager.pinned_bytes == 0


# ---------------------------------------------------------------- CUDA: stream order

@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(60)
def test_chained_division_is_ordered_for_a_reader_on_another_stream():
    torch.cuda.set_device(0)
    producer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(BIG, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # the producer stream lags well behind the CPU
        x.fill_(3.0)
        halved = ft_futures.chain(ft_futures.completed_future(x), lambda v: v.div_(2))
        assert ft_futures.future_devices(halved) == [x.device]
    with torch.cuda.stream(reader):
        value = halved.wait()
        wrong = int((value != 1.5).sum().item())  # .item() waits for the reader stream only
    assert wrong == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(60)
def test_managed_work_wait_orders_the_waiting_stream_after_the_chain():
    torch.cuda.set_device(0)
    issuing, other = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(BIG, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(issuing):
        torch.cuda._sleep(200_000_000)
        x.fill_(3.0)
        fut = ft_futures.recover(ft_futures.chain(ft_futures.completed_future(x), lambda v: v.div_(2)), x,
                                 lambda exc: None)
        work = ManagedWork(None, fut, x)  # type: ignore[arg-type]  # the manager is only told of callback errors
        plus = work.get_future().then(lambda f: f.value().add_(1))
    with torch.cuda.stream(other):
        value = plus.wait()
        wrong = int((value != 2.5).sum().item())
    assert wrong == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(90)
def test_manager_allreduce_of_a_large_tensor_is_read_without_synchronize():
    from test_manager import run_groups

    from ft_core.control.lighthouse import LighthouseServer

    def body(manager: Any, i: int) -> dict[str, Any]:
        torch.cuda.set_device(0)
        issuing, other = torch.cuda.Stream(), torch.cuda.Stream()
        out: dict[str, Any] = {}
        with torch.cuda.stream(issuing):
            manager.start_quorum()
            t = torch.full((BIG,), float(i + 1), device="cuda")
            manager.allreduce(t).wait()
            out["wrong_on_issuing"] = int((t.clone() != 1.5).sum().item())
            u = torch.full((BIG,), float(i + 1), device="cuda")
            work = manager.allreduce(u)
        with torch.cuda.stream(other):  # waited on from another stream than the one that issued it
            work.wait()
            out["wrong_on_other"] = int((u != 1.5).sum().item())
        out["commit"] = manager.should_commit()
        return out

    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
        results = run_groups(2, lighthouse, body, init_sync=False, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
                             connect_timeout=TIMEOUT)
    for r in results:
        assert r == {"wrong_on_issuing": 0, "wrong_on_other": 0, "commit": True}


class _Wide(torch.nn.Module):
    """Three independent bias-free layers summed: d(loss)/dW = x everywhere, whatever the weights."""

    def __init__(self, n_in: int = 4096, n_out: int = 1024) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(n_in, n_out, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).sum() for layer in self.layers)  # type: ignore[return-value]


def _ddp_worker(lighthouse_addr: str, group: int, out_path: str) -> None:
    """One replica group on cuda:0: DDP over the Manager (Gloo across groups), grads read unsynchronized."""
    from ft_core.ddp import DistributedDataParallel
    from ft_core.manager import Manager

    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    manager = Manager(pg, lighthouse_addr=lighthouse_addr, replica_id=f"cuda-ddp-{group}", min_replica_size=2,
                      timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, init_sync=False)
    results = []
    try:
        model = _Wide().cuda()
        ddp = DistributedDataParallel(manager, model)
        with torch.cuda.stream(torch.cuda.Stream()):  # not the default stream: nothing orders it implicitly
            for _ in range(2):  # the first backward uses DDP's initial buckets (copy path), the second its rebuilt ones
                manager.start_quorum()
                for p in model.parameters():
                    p.grad = None
                ddp(torch.full((1, 4096), float(group + 1), device="cuda")).backward()
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
                results.append({"wrong": int((grads != 1.5).sum().item()), "numel": grads.numel(),
                                "commit": manager.should_commit()})
    finally:
        manager.shutdown()
        pg.shutdown()
    Path(out_path).write_text(json.dumps(results))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(110)
def test_ddp_wrapper_gradients_are_read_without_synchronize(processes, tmp_path):
    from conftest import child_env

    from ft_core.control.lighthouse import LighthouseServer

    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
        procs = []
        for g in (0, 1):
            with open(tmp_path / f"g{g}.log", "wb") as log:  # the child keeps its own descriptor
                procs.append(processes.python(str(HERE), "ddp", lighthouse.address(), str(g),
                                              str(tmp_path / f"g{g}.json"), env=child_env(), stdout=log,
                                              stderr=subprocess.STDOUT))
        for proc in procs:
            proc.wait(timeout=100)
    logs = "\n".join((tmp_path / f"g{g}.log").read_text(errors="replace")[-3000:] for g in (0, 1))
    assert [p.returncode for p in procs] == [0, 0], logs
    for g in (0, 1):
        runs = json.loads((tmp_path / f"g{g}.json").read_text())
        assert [r["wrong"] for r in runs] == [0, 0] and all(r["commit"] for r in runs), (runs, logs)


# ---------------------------------------------------------------- CUDA: heal staging

@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(60)
def test_lightning_heal_snapshot_allocates_no_gpu_memory():
    torch.cuda.set_device(0)
    model = torch.nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    snap = to_transport({"model": model.state_dict(), "opt": optimizer.state_dict()}, clone=True)
    assert torch.cuda.memory_allocated() == before  # no GPU clone of the state
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # the owner trains on: the snapshot has already landed on the host
    back = from_transport(snap)
    for name, tensor in expected.items():
        got = back["model"][name]
        assert got.device.type == "cpu" and got.is_pinned() and torch.equal(got, tensor)
    assert back["opt"]["state"][0]["exp_avg"].device.type == "cpu"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.timeout(60)
def test_pinned_staging_memory_is_released_after_the_heal():
    torch.cuda.set_device(0)
    state = {"w": torch.randn(1 << 22, device="cuda"), "b": torch.arange(5, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    torch._C._host_emptyCache()
    baseline = _pinned_bytes()
    with HTTPTransport(timeout=TIMEOUT) as src, HTTPTransport(timeout=TIMEOUT) as healer:
        src.send_checkpoint([1], 1, state, TIMEOUT)
        assert src._stager.pinned_bytes >= state["w"].numel() * 4
        out = healer.recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
        src.disallow_checkpoint()  # the heal is over
        assert src._stager.pinned_bytes == 0
        if baseline is not None:
            assert _pinned_bytes() <= baseline, torch.cuda.host_memory_stats()
    for name, tensor in expected.items():
        assert torch.equal(out[name], tensor)


def _pinned_bytes() -> int | None:
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return None


# ---------------------------------------------------------------- CUDA: device placement

@pytest.mark.cuda
@needs_2_gpus
@pytest.mark.timeout(60)
def test_quorum_thread_initializer_sets_the_creators_device():
    torch.cuda.set_device(1)
    try:
        plain = concurrent.futures.ThreadPoolExecutor(1)
        with plain, concurrent.futures.ThreadPoolExecutor(1, initializer=ft_futures.current_device_initializer()) as ours:
            assert plain.submit(torch.cuda.current_device).result(timeout=30) == 0  # what the bug looked like
            assert ours.submit(torch.cuda.current_device).result(timeout=30) == 1
        seen: list[int] = []
        thread = threading.Thread(target=ft_futures.with_current_device(lambda: seen.append(torch.cuda.current_device())))
        thread.start()
        thread.join(30)
        assert seen == [1]
    finally:
        torch.cuda.set_device(0)


def _groups_device_worker(store_port: str) -> None:
    """Configure NCCL and BabyNCCL from a quorum-like thread after set_device(1); NCCL_DEBUG shows the device."""
    torch.cuda.set_device(1)
    init = ft_futures.current_device_initializer()
    for i, cls in enumerate((ProcessGroupNCCL, ProcessGroupBabyNCCL)):
        group = cls(timeout=TIMEOUT)
        try:
            with concurrent.futures.ThreadPoolExecutor(1, initializer=init) as pool:
                pool.submit(group.configure, f"127.0.0.1:{store_port}/dev/{i}", "a", 0, 1, quorum_id=1).result(60)
            t = torch.ones(1024, device="cuda:1")
            group.allreduce([t], ReduceOp.SUM).wait()
            assert int((t != 1).sum().item()) == 0
        finally:
            group.shutdown()
    print("groups-device-worker done", flush=True)


@pytest.mark.cuda
@needs_2_gpus
@pytest.mark.timeout(110)
def test_nccl_and_baby_nccl_communicators_use_the_configuring_processes_device(processes, tmp_path):
    from conftest import child_env
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = processes.python(str(HERE), "groups-device", str(store.port), env=child_env(NCCL_DEBUG="INFO"),
                                stdout=out, stderr=subprocess.STDOUT)
    proc.wait(timeout=100)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    devices = _nccl_devices_by_pid(text)
    assert len(devices) == 2, text[-4000:]  # the process's own communicator and the BabyNCCL child's
    assert all(devs == {1} for devs in devices.values()), devices


def _nccl_devices_by_pid(text: str) -> dict[str, set[int]]:
    """cudaDev of every communicator NCCL reports up (NCCL_DEBUG=INFO "Init COMPLETE"), per process."""
    out: dict[str, set[int]] = {}
    for line in text.splitlines():
        if "Init COMPLETE" not in line:
            continue
        pid = re.match(r"\S+?:(\d+):", line)
        dev = re.search(r"cudaDev (\d+)", line)
        if pid and dev:
            out.setdefault(pid.group(1), set()).add(int(dev.group(1)))
    return out


@pytest.mark.cuda
@needs_4_gpus
@pytest.mark.timeout(240)
def test_two_lightning_groups_of_two_devices_each_use_their_own_gpu_for_nccl(processes, tmp_path):
    """2 groups x devices=2 on one node, NCCL inside and across groups: every process's communicators
    (Lightning's group DDP and the Manager's cross-group one, built on the quorum thread) are on the
    process's own GPU."""
    from test_lightning_strategy import assert_identical_weights, start_group, wait_all

    from ft_core.control.lighthouse import LighthouseServer

    os.environ["NCCL_DEBUG"] = "INFO"  # inherited by start_group's child_env
    try:
        with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2_000, heartbeat_timeout_ms=2_000,
                              http_bind=None) as lighthouse:
            procs = [start_group(processes, lighthouse, tmp_path, g, "--accelerator", "gpu", "--devices", "2",
                                 "--epochs", "1", "--samples", "32", cuda_device=("0,1", "2,3")[g]) for g in (0, 1)]
            wait_all(procs, tmp_path, timeout=220)
    finally:
        os.environ.pop("NCCL_DEBUG", None)
    assert_identical_weights(tmp_path, 4)
    text = "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("group*.log")))
    devices = _nccl_devices_by_pid(text)
    assert len(devices) == 4, devices  # one entry per rank process
    assert sorted(d for devs in devices.values() for d in devs) == [0, 0, 1, 1], devices
    assert all(len(devs) == 1 for devs in devices.values()), devices


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ddp":
        _ddp_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif mode == "groups-device":
        _groups_device_worker(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {mode!r}; expected 'ddp' or 'groups-device'")
