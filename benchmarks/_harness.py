"""Helpers shared by the benchmarks: spawning workers in one process tree, stats, torchft detection."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust servers log every quorum at info otherwise


def torchft_available() -> bool:
    """True when Meta's torchft is importable (`pip install torchft-nightly`, the `bench` extra)."""
    return importlib.util.find_spec("torchft") is not None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RES_OPTIONS": "timeout:1 attempts:1",
                "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_workers(argvs: Sequence[list[str]], timeout_s: float) -> None:
    """Start one python process per argv, wait for all (`timeout_s` for the whole set); on failure or
    timeout end them all and raise."""
    deadline = time.monotonic() + timeout_s
    procs = [subprocess.Popen([sys.executable, *argv], env=worker_env(), cwd=REPO_ROOT, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for argv in argvs]
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"benchmark worker {proc.args[1:]} failed ({proc.returncode}):\n{out[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100], nearest-rank on sorted values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[idx]
