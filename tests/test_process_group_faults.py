"""A peer SIGKILLed in the middle of an allreduce, with real processes: the survivors' op fails within
timeout + 2 s, they reconfigure without it and go on."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import pytest

TIMEOUT_S = 2.0
REBUILD_TIMEOUT_S = 20.0


def worker(store_addr: str, rank: int, world: int, cls_name: str) -> None:
    """Loop allreduces on a large tensor until one fails; then rebuild with ranks 0..world-2 and go on."""
    import torch
    from torch._C._distributed_c10d import ReduceOp, TCPStore

    import ft_core.process_groups as pgs

    torch.set_num_threads(1)
    host, rest = store_addr.split(":", 1)
    port = int(rest.split("/", 1)[0])
    progress = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    # The first rendezvous has the op's 2 s deadline: start it once every worker has imported torch (on a busy
    # machine the imports end seconds apart, and the first one to configure timed out waiting for the last).
    progress.set(f"imported/{rank}", "1")
    progress.wait([f"imported/{r}" for r in range(world)], timedelta(seconds=60))
    group = getattr(pgs, cls_name)(timeout=timedelta(seconds=TIMEOUT_S))
    group.configure(f"{store_addr}/q1", f"r{rank}", rank, world, quorum_id=1)
    big = torch.ones(4_000_000)
    step = 0
    while True:
        big.fill_(1.0)
        try:
            group.allreduce([big], ReduceOp.SUM).wait()
        except Exception as exc:  # the failure under test
            failed_at = time.time()
            error = type(exc).__name__
            break
        assert big[0].item() == world
        step += 1
        progress.set(f"step/{rank}", str(step))
    # The survivors notice the loss up to TIMEOUT_S apart (a reset connection, or the op's deadline), so the
    # rebuild's rendezvous waits longer than that for the other one (on a busy machine 2 s was too short).
    group.set_timeout(timedelta(seconds=REBUILD_TIMEOUT_S))
    group.configure(f"{store_addr}/q2", f"r{rank}", rank, world - 1, quorum_id=2)
    results = []
    for _ in range(3):
        t = torch.full((8,), rank + 1.0)
        group.allreduce([t], ReduceOp.SUM).wait()
        results.append(t[0].item())
    group.shutdown()
    print(json.dumps({"rank": rank, "failed_at": failed_at, "error": error, "steps": step, "after": results}))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls_name", ["ProcessGroupGloo"])
def test_peer_sigkilled_mid_allreduce_survivors_fail_in_time_then_continue(processes, cls_name):
    import subprocess

    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store_addr = f"127.0.0.1:{store.port}"
    world = 3
    procs = [processes.python(os.path.abspath(__file__), store_addr, str(r), str(world), cls_name,
                              stdout=subprocess.PIPE) for r in range(world)]
    deadline = time.monotonic() + 60
    while True:  # every rank has completed a few allreduces: they are looping on the collective
        steps = [int(store.get(f"step/{r}")) if store.check([f"step/{r}"]) else 0 for r in range(world)]
        if min(steps) >= 3:
            break
        assert time.monotonic() < deadline, f"workers made no progress: {steps}"
        assert all(p.poll() is None for p in procs), "a worker exited early"
        time.sleep(0.05)
    procs[2].kill()  # SIGKILL, mid-allreduce
    killed_at = time.time()
    procs[2].wait(10)
    reports = []
    for proc in procs[:2]:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"survivor exited with {proc.returncode}"
        reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    for report in reports:
        assert report["error"] in ("FTTimeoutError", "ProcessGroupError"), report
        assert report["failed_at"] - killed_at <= TIMEOUT_S + 2, report
        assert report["after"] == [3.0, 3.0, 3.0], report  # ranks 0 and 1 only: 1 + 2


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
