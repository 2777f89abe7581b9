"""Processes of a chaos run that the Launcher does not own: the lighthouse child process, and the
final sweep for anything a run left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ft_core.tools.ports import free_port


class LighthouseProcess:
    """`ftl lighthouse` as a child process in its own session: killed and restarted on one port. With
    `host` (an address) and `prefix` (`ip netns exec NAME`), it runs on a simulated host at that address."""

    def __init__(self, cfg: Any, log_path: str, *, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        self.port = free_port()  # any port is free in a simulated host's own namespace too
        self.address = f"{host}:{self.port}"
        self._prefix = list(prefix)
        self._cfg = cfg
        self._log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []
        self.starts = 0
        self.peers: list[str] = []  # the job's lighthouse list, passed as --peers (a primary and its standby)

    def start(self) -> None:
        cfg = self._cfg
        argv = [*self._prefix, sys.executable, "-m", "ft_core", "lighthouse", "--bind", self.address, "--http-bind", "off",
                "--min-replicas", str(cfg.min_replicas), "--join-timeout-ms", str(cfg.join_timeout_ms),
                "--heartbeat-timeout-ms", str(cfg.heartbeat_timeout_ms), "--log-level", "WARNING"]
        if self.peers:
            argv += ["--peers", ",".join(self.peers)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cfg.token:
            env["FT_TOKEN"] = cfg.token
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pids.append(self.proc.pid)
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        self.proc = None


def _environ_has(pid: str, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read: then it is no child of this run either
        return False


def leftovers(sessions: set[int], token: str | None = None) -> list[tuple[int, str]]:
    """Live processes whose session is one this run created (every child runs in its own session, whose
    id is the child's pid). Process ids are reused within seconds, so after a long run an unrelated
    process can lead a new session whose id one of ours once had: with `token` (the run's FT_TOKEN, which
    every process of the run inherits) only a process that carries it counts."""
    marker = f"FT_TOKEN={token}".encode() if token else None
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        state, session = fields[0], int(fields[3])
        if session in sessions and state != "Z" and (marker is None or _environ_has(entry, marker)):
            found.append((int(entry), name))
    return found
