"""A configure cancelled while it waits for a member that never arrives (the lighthouse says that member is
lost: ft_core.redo.on_peer_lost): it ends at once, not at the collective timeout, and leaves no thread."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import assert_bounded
from ft_harness import wait_until
from torch.distributed import TCPStore

from ft_core.errors import ProcessGroupError
from ft_core.process_groups import ErrorSwallowingProcessGroupWrapper, ProcessGroupGloo

TIMEOUT = timedelta(seconds=30)
LOST = "replica group b of quorum 7 was lost while configuring"


def configure_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-configure") and t.is_alive()]


@pytest.mark.timeout(60)
def test_a_configure_whose_member_never_arrives_ends_at_once_when_cancelled_and_leaves_no_thread():
    """Rank 0 of a world of 2 at a real store; rank 1 never comes. A cancel for the configure's quorum, from
    another thread, ends it within a few seconds (the timeout is 30 s); the construction ends too."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))  # forwards the cancel
    try:
        threading.Timer(0.5, pg.cancel_configure, args=(6, "another quorum")).start()  # not this configure's
        threading.Timer(1.0, pg.cancel_configure, args=(7, LOST)).start()
        started = time.monotonic()
        with pytest.raises(ProcessGroupError, match=f"at 127.0.0.1:{store.port}/q7: {LOST}"):
            pg.configure(f"127.0.0.1:{store.port}/q7", "a", 0, 2, quorum_id=7)
        assert_bounded(started, 3.0, "a cancelled configure")  # not the 30 s timeout
        wait_until(lambda: not configure_threads(), 5, "the abandoned construction's thread ending")
        # Heard before a configure for that quorum starts (and not yet forgotten): it ends at once, builds nothing.
        with pytest.raises(ProcessGroupError, match=LOST):
            pg.configure(f"127.0.0.1:{store.port}/q7b", "a", 0, 2, quorum_id=7)
        assert not configure_threads()
        pg.forget_cancel(7, LOST)
        pg.forget_cancel(6, "another quorum")
        # The group is fine for the next quorum: both members arrive, and an allreduce sums.
        peer = ProcessGroupGloo(timeout=TIMEOUT)
        try:
            joined = threading.Thread(target=peer.configure, args=(f"127.0.0.1:{store.port}/q8", "b", 1, 2),
                                      kwargs={"quorum_id": 8})
            joined.start()
            pg.configure(f"127.0.0.1:{store.port}/q8", "a", 0, 2, quorum_id=8)
            joined.join(30)
            assert not joined.is_alive()
            mine, theirs = torch.ones(3), torch.full((3,), 2.0)
            works = [pg.allreduce([mine]), peer.allreduce([theirs])]
            for work in works:
                work.wait()
            assert mine.tolist() == theirs.tolist() == [3.0, 3.0, 3.0]
        finally:
            peer.shutdown()
    finally:
        pg.shutdown()
    assert not configure_threads()


@pytest.mark.timeout(60)
def test_a_construction_abandoned_just_before_exit_ends_before_the_interpreter_finalizes(tmp_path):
    """A configure abandoned at its deadline may still be inside the backend's C++ when the process exits;
    back in a finalizing interpreter its thread would be ended with pthread_exit, which aborts the process
    (SIGABRT in a chaos run: the group exited 2 s after abandoning a configure). The exit now waits for it,
    at most until its bound (twice the caller's deadline): here the construction (1 s, abandoned at 0.6 s)
    finishes and marks it before the process ends.
    Before: the process ended without the mark."""
    import subprocess
    import sys

    from conftest import child_env

    marker = tmp_path / "construction_ended"
    script = (
        "import time\n"
        "from ft_core.process_groups.cancel import ConfigureAttempt, run_attempt\n"
        "def build():\n"
        "    time.sleep(1.0)\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "try:\n"
        "    run_attempt(ConfigureAttempt(1), 'ft-test-configure', build, lambda backend: None, 0.6)\n"
        "except Exception as exc:\n"
        "    print('abandoned:', exc, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(), timeout=50, capture_output=True, text=True)
    assert proc.returncode == 0 and "abandoned: ft-test-configure did not end within 0.6s" in proc.stdout, proc
    assert marker.exists(), "the process exited while the abandoned construction was still running"
