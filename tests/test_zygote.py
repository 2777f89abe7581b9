"""The test processes forked from a preloaded interpreter (tests/zygote.py) behave as fresh ones for what the
tests rely on: exit codes and signals, a pid reserved until reaped, the environment, working directory,
output files, session and ignored signals asked for, a random state of their own, and (from one spawn to
the next) another hash seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zygote
from conftest import child_env
from proctree import proc_table, still_running

SCRIPT = """
import json, os, random, signal, sys, time
out = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_PROBE"), "pgid": os.getpgid(0),
       "pid": os.getpid(), "random": random.random(), "main": __name__,
       "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "torch": "torch" in sys.modules,
       "hash": hash("ft-lightning")}
print(json.dumps(out), flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise ValueError("raised in the child")
time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def _spawn(processes, script, tmp_path, *args: str, **kwargs):
    out = open(tmp_path / f"out{len(processes.handles)}.txt", "w+")  # noqa: SIM115 (read below)
    proc = processes.spawn([sys.executable, script, *args], env=child_env(ZYGOTE_PROBE="seen"), stdout=out,
                           stderr=subprocess.STDOUT, cwd=str(tmp_path), **kwargs)
    return proc, out


def _lines(out) -> list[str]:
    out.seek(0)
    return out.read().splitlines()


pytestmark = pytest.mark.skipif(os.environ.get("FT_TEST_FRESH_PROCESSES") == "1", reason="fresh processes asked for")


@pytest.mark.timeout(120)
def test_a_forked_test_process_behaves_as_a_fresh_one(processes, script, tmp_path):
    done, out = _spawn(processes, script, tmp_path, "exit", "3")
    assert isinstance(done, zygote.ForkedProcess)
    assert done.wait(timeout=60) == 3
    first = json.loads(_lines(out)[0])
    assert first["argv"] == ["exit", "3"] and first["cwd"] == str(tmp_path) and first["env"] == "seen"
    assert first["main"] == "__main__" and first["torch"]  # preloaded
    assert first["pgid"] == first["pid"] == done.pid  # its own session, as processes.spawn asks
    # as this process's, which it would inherit across exec (pytest started with `&` by a script ignores it)
    assert first["sigint_ignored"] == (signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

    failed, out = _spawn(processes, script, tmp_path, "raise")
    assert failed.wait(timeout=60) == 1
    assert "ValueError: raised in the child" in "\n".join(_lines(out))
    # the next spawn came from the other server: another hash seed, as another fresh interpreter would have
    assert json.loads(_lines(out)[0])["hash"] != first["hash"]

    sleeper, out = _spawn(processes, script, tmp_path, "sleep")
    deadline = time.monotonic() + 60
    while not _lines(out):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert json.loads(_lines(out)[0])["random"] != first["random"]  # reseeded, not the zygote's state
    os.killpg(sleeper.pid, signal.SIGKILL)
    time.sleep(0.5)  # dead, reported, not reaped: the pid is still this child's (a zombie), as with Popen
    with open(f"/proc/{sleeper.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    assert sleeper.wait(timeout=10) == -signal.SIGKILL

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a child inherits an ignored SIGINT across exec
    try:
        ignoring, out = _spawn(processes, script, tmp_path, "exit", "0")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ignoring.wait(timeout=60) == 0
    assert json.loads(_lines(out)[0])["sigint_ignored"]


@pytest.mark.timeout(120)
def test_fresh_processes_never_fork_from_the_zygote_and_the_benchmarks_use_them(script, tmp_path):
    """benchmarks/heal.py times process starts (a cold restart, a group started alone) through these helpers:
    forked from the zygote, a "cold" restart was ready in 0.27 s instead of ~3 s (the full run of
    2026-12-06 18:48). Processes(fresh=True) starts a new interpreter for every spawn, and every Processes
    the benchmarks make is fresh."""
    from conftest import Processes

    fresh, forked = Processes(fresh=True), Processes()
    try:
        outs = []
        for procs in (fresh, forked):
            proc, out = _spawn(procs, script, tmp_path, "sleep")
            deadline = time.monotonic() + 60
            while not _lines(out) and time.monotonic() < deadline:
                assert proc.poll() is None, _lines(out)
                time.sleep(0.05)
            outs.append(json.loads(_lines(out)[0]))
        assert isinstance(fresh.handles[0], subprocess.Popen) and not outs[0]["torch"], outs[0]
        assert outs[1]["torch"], outs[1]  # the zygote's child starts with torch imported
    finally:
        fresh.end_all()
        forked.end_all()
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    for name in sorted(os.listdir(benchmarks)):
        if name.endswith(".py"):
            with open(os.path.join(benchmarks, name)) as f:
                source = f.read()
            assert source.count("Processes(") == source.count("Processes(fresh=True)"), name


def test_only_plain_script_and_module_runs_with_output_to_files_are_forked():
    env = child_env()
    assert zygote.eligible([sys.executable, __file__], env, {"stdout": subprocess.DEVNULL})
    assert zygote.eligible([sys.executable, "-m", "ft_core", "x"], env, {})
    assert not zygote.eligible([sys.executable, "-c", "pass"], env, {})
    assert not zygote.eligible([sys.executable, "-u", __file__], env, {})
    assert not zygote.eligible(["ip", "netns", "exec", "h1", sys.executable, __file__], env, {})
    assert not zygote.eligible([sys.executable, __file__], env, {"stdout": subprocess.PIPE})
    assert not zygote.eligible([sys.executable, __file__], env, {"pass_fds": [3]})
    assert not zygote.eligible([sys.executable, __file__], {**env, "PYTHONHASHSEED": "0"}, {})


@pytest.mark.timeout(60)
def test_a_wait_on_a_child_of_a_zygote_that_died_fails_at_once_instead_of_hanging(script, tmp_path):
    server = zygote.Zygote(child_env())  # not the shared pool: this one is killed
    out = open(tmp_path / "out.txt", "w")  # noqa: SIM115 (closed below)
    try:
        child = server.spawn([sys.executable, script, "sleep"], child_env(), {"stdout": out, "stderr": out,
                                                                                "start_new_session": True})
        named = {(child.pid, proc_table()[child.pid][1])}  # (pid, start time): safe against pid reuse
        server._proc.kill()
        server._proc.wait(10)
        with pytest.raises(RuntimeError, match="zygote ended"):
            child.wait(timeout=30)
        for pid, _start in still_running(named):  # the orphan (its own session) is ended here
            os.killpg(pid, signal.SIGKILL)
    finally:
        server.shutdown()
        out.close()
