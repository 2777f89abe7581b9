"""Shared test fixtures: loopback only, OS-chosen ports, one torch thread per process,
and every process a test starts is ended through the handle it was spawned with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

# Name lookups can stall 5 s on these machines: fail fast, and use literal 127.0.0.1 everywhere.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
# With 2 cores, more than one torch thread per process makes multi-process tests far slower.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

try:  # keep this process at one thread too (tests run threads of replicas in-process)
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: this interpreter's, single-threaded, repo importable."""
    env = dict(os.environ)
    env.update({"RES_OPTIONS": "timeout:1 attempts:1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


class Processes:
    """Spawns children and guarantees they are gone at teardown (by handle, never by pid)."""

    def __init__(self) -> None:
        self.handles: list[subprocess.Popen] = []

    def spawn(self, args: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(args, env=env or child_env(), **kwargs)
        self.handles.append(proc)
        return proc

    def python(self, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return self.spawn([sys.executable, *args], env=env, **kwargs)

    def end_all(self) -> None:
        for proc in self.handles:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes its children too
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self.handles:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.end_all()
