"""Shared test fixtures: loopback only, OS-chosen ports, one torch thread per process,
and every process a test starts is ended through the handle it was spawned with."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zygote

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


# The slow tier (tests marked `slow`, see pytest_collection_modifyitems) is being run: its drivers may wait longer.
SLOW = os.environ.get("FT_RUN_SLOW") == "1"

# What a deadline test allows beyond the deadline itself: a busy 2-core CI machine can delay the raise by
# seconds. Each such test's alternative (the long timeout it must not wait for, or a hang) is far longer.
BUSY_SLACK_S = 6.0


def assert_bounded(started: float, deadline_s: float, what: str = "the call") -> float:
    """Assert that `what`, started at time.monotonic() `started`, ended within its `deadline_s` (plus
    BUSY_SLACK_S); the elapsed seconds."""
    elapsed = time.monotonic() - started
    assert elapsed <= deadline_s + BUSY_SLACK_S, (
        f"{what} took {elapsed:.2f}s; its deadline was {deadline_s:g}s (+{BUSY_SLACK_S:g}s allowed on a busy machine)")
    return elapsed


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a child process: this interpreter's, single-threaded, repo importable."""
    env = dict(os.environ)
    env.update({"RES_OPTIONS": "timeout:1 attempts:1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_calls(calls: list[Callable[[], Any]], join_s: float = 20.0) -> list[tuple[Any, float]]:
    """Run each call in its own named thread (like group ranks calling at once); returns
    (result or exception, monotonic end time) per call."""
    out: list[tuple[Any, float]] = [(None, 0.0)] * len(calls)

    def body(i: int) -> None:
        try:
            value: Any = calls[i]()
        except Exception as exc:  # collected and asserted on by the test
            value = exc
        out[i] = (value, time.monotonic())

    threads = [threading.Thread(target=body, args=(i,), name=f"test-rank-{i}") for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a rank's call did not return"
    return out


def communicate_or_interrupt(proc: subprocess.Popen, timeout: float) -> str:
    """Its output once it exits; past `timeout`, Ctrl-C it first so it ends the groups it started (they
    live in their own sessions: the fixture's SIGKILL of its process group would not reach them)."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
        raise AssertionError(f"still running after {timeout} s; output:\n{(out or '')[-3000:]}") from None


class Processes:
    """Spawns children and guarantees they are gone at teardown (by handle, never by pid)."""

    def __init__(self, fresh: bool = False) -> None:
        """fresh: every child is a new interpreter (the benchmarks time real process starts)."""
        self.handles: list[subprocess.Popen] = []
        self.fresh = fresh

    def spawn(self, args: list[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """`python script.py ...` and `python -m module ...` with output to files are forked from an
        interpreter that imported torch once (tests/zygote.py), unless `fresh`; anything else is a fresh
        process."""
        kwargs.setdefault("start_new_session", True)
        env = env or child_env()
        if not self.fresh and zygote.eligible(args, env, kwargs):
            proc: Any = zygote.Zygote.get(child_env()).spawn(list(args), env, kwargs)
            self.handles.append(proc)
            return proc
        proc = subprocess.Popen(args, env=env, **kwargs)
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


from netns import simulated_hosts  # noqa: E402,F401  (multi-host fixture: simulated hosts, tests/netns.py)


@pytest.fixture(autouse=True)
def _restore_the_events_logger() -> Iterator[None]:
    """The integrations attach a console handler to "ft_core.events" (once per process); an in-process
    test must not leave it, or its level and propagation, to the tests after it."""
    events = logging.getLogger("ft_core.events")
    saved = (list(events.handlers), events.level, events.propagate)
    yield
    events.handlers[:] = saved[0]
    events.setLevel(saved[1])  # setLevel, not the attribute: it clears the loggers' enabled-for caches
    events.propagate = saved[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` (the acceptance-size variants: more kills, longer runs) run only with
    FT_RUN_SLOW=1; each has a smaller sibling in the default tier that checks the same promise."""
    if SLOW:
        return
    skip = pytest.mark.skip(reason="acceptance-size run: set FT_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ TLS test certificates

@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA), made with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return {"FT_TLS_CERT": cert, "FT_TLS_KEY": key, "FT_TLS_CA": cert}


@pytest.fixture
def tls_env(certs, monkeypatch):
    for var, value in certs.items():
        monkeypatch.setenv(var, value)
    return certs
