"""The redo at the wait must not hold its lock while it issues a collective (ft_core.redo.issue).

Found by `python -m benchmarks run` (failure benchmark, FT_REDO_COPY=1, about 1 kill in 40): a survivor
hung for good in the step after a peer's SIGKILL, and the other survivor's redo quorum then timed out
waiting for it. py-spy showed the hung survivor's main thread in `redo.issue`, holding the reduction log's
lock, inside `ProcessGroup.allreduce` (Gloo's C++ issue, GIL released), while Gloo's completion thread ran
the failed first reduction's callback, `redo._first_done`, waiting for that same lock: issuing a Gloo
collective can wait for the thread that runs the completion callbacks.

The process group here reproduces exactly that property of Gloo, deterministically: its second allreduce
fails the first on its own completion thread, and returns only once that thread has run the first one's
callbacks (bounded, so that before the fix the test fails instead of hanging). The Manager, the lighthouse
and the redo are the real ones.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ft_core.control.lighthouse import LighthouseServer
from ft_core.manager import Manager
from ft_core.process_groups import ProcessGroupDummy
from ft_core.process_groups.base import CompletedWork, FutureWork, op_result

TIMEOUT = timedelta(seconds=10)
CALLBACKS_WAIT_S = 3.0  # how long the second issue waits for the completion thread (Gloo: for ever)


class CompletionThreadGroup(ProcessGroupDummy):
    """A one-rank group whose allreduces complete on a completion thread of its own, as Gloo's do; the
    first allreduce of the test step fails there ("connection closed", a lost peer) when the second is
    issued, and that issue returns only after the completion thread ran the first one's callbacks."""

    def __init__(self) -> None:
        super().__init__(timeout=TIMEOUT)
        self.armed = False
        self.pending: torch.futures.Future | None = None
        self.callbacks_ran = threading.Event()
        self.issue_waited_for_callbacks: bool | None = None

    def _collective(self, name: str, args: tuple, opts: Any) -> dist.Work:
        if name != "allreduce" or not self.armed:
            return super()._collective(name, args, opts)
        if self.pending is None:  # the first reduction of the step: in flight until the second is issued
            self.pending = torch.futures.Future()
            return FutureWork(self.pending, TIMEOUT, lambda: TimeoutError("allreduce timed out"))
        self.armed = False
        first = self.pending

        def complete_first() -> None:  # the completion thread: the peer died, its callbacks run here
            first.set_exception(RuntimeError("Connection closed by peer (the remote worker crashed)"))
            self.callbacks_ran.set()

        threading.Thread(target=complete_first, name="completion-thread", daemon=True).start()
        self.issue_waited_for_callbacks = self.callbacks_ran.wait(CALLBACKS_WAIT_S)
        return CompletedWork(op_result(name, args))


@pytest.mark.timeout(90)
def test_issuing_a_reduction_while_the_completion_thread_delivers_a_failed_one_does_not_deadlock(monkeypatch):
    monkeypatch.delenv("FT_REDO_STEP", raising=False)  # the default: a one-rank group redoes at the wait
    monkeypatch.delenv("FT_REDO_COPY", raising=False)
    pg = CompletionThreadGroup()
    with LighthouseServer(min_replicas=1) as lighthouse:
        manager = Manager(pg, lighthouse_addr=lighthouse.address(), replica_id="solo", min_replica_size=1,
                          timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, hostname="127.0.0.1")
        try:
            manager.start_quorum()
            manager.wait_quorum()
            pg.armed = True
            first, second = torch.ones(4), torch.ones(4)
            work_first = manager.allreduce(first)
            work_second = manager.allreduce(second)  # issued while the first one fails on the other thread
            assert pg.issue_waited_for_callbacks is True, (
                "the first reduction's completion callbacks could not run while the second was being issued: "
                "redo.issue held the reduction log's lock across the collective")
            work_first.wait()
            work_second.wait()
            failed_step = manager.should_commit()  # ends: no peer was really lost, so nothing to redo with
            manager.start_quorum()  # and the loop goes on: the next step commits
            again = torch.ones(4)
            manager.allreduce(again).wait()
            next_step = manager.should_commit()
        finally:
            manager.shutdown()
            pg.shutdown()
    assert failed_step is False
    assert next_step is True and torch.equal(again, torch.ones(4))
