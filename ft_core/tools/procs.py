"""Our own child processes: how one ended, without reaping it, and signals to the session it leads.

A child is never reaped before its process group has been signalled: while we hold it unreaped its pid,
and so its process group id, cannot be reused by another process, so every signal lands on our own.
"""

from __future__ import annotations

import os
import signal
import subprocess


def describe_exit(returncode: int | None) -> str:
    """'exit 0', 'exit 3' or 'killed by SIGKILL' for a Popen returncode."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def exit_status(proc: subprocess.Popen) -> int | None:
    """The returncode if `proc` has ended, WITHOUT reaping it (its pid stays ours); None while it runs."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped elsewhere: let Popen tell us
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to the process group (= session) led by `proc`, which we have not reaped yet."""
    if proc.returncode is not None:  # reaped: its pid may belong to someone else now
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
