"""Warm spares: a process that imported torch and ft_core ahead becomes a rank on its activation.

Real processes throughout: the spare module as `python -m ft_core.tools.spares`, and the Launcher
restarting a killed group from its spare (`ftl launch --spares`).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import child_env

from ft_core.tools.launch_command import parse_args
from ft_core.tools.launcher import GroupState, Launcher
from ft_core.tools.spares import Activation, Spare, script_of

# Writes what it was started as to $REPORT (one JSON line per start), then sleeps $SLEEP_S and exits $EXIT_CODE.
REPORTER = textwrap.dedent("""
    import json, os, sys, time
    with open(os.environ["REPORT"], "a") as f:
        f.write(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                            "preloaded": "torch._dynamo" in sys.modules, "stdin": sys.stdin.read(),
                            "restart": os.environ.get("FT_RESTART_COUNT"), "port": os.environ.get("MASTER_PORT"),
                            "rank": os.environ.get("RANK"), "marker": os.environ.get("MARKER")}) + "\\n")
    print("reporter output", flush=True)
    time.sleep(float(os.environ.get("SLEEP_S", "0")))
    sys.exit(int(os.environ.get("EXIT_CODE", "0")))
""")


def _reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def reporter(tmp_path: Path) -> Path:
    path = tmp_path / "reporter.py"
    path.write_text(REPORTER)
    return path


@pytest.mark.parametrize("argv, expect", [
    (["/usr/bin/python3", "train.py", "--lr", "1"], ("path", "train.py")),
    (["python", "-m", "pkg.train", "x"], ("module", "pkg.train")),
    (["/venv/bin/python3.12", "dir/s.py"], ("path", "dir/s.py")),
])
def test_a_spare_becomes_a_python_script_or_module(argv, expect):
    assert script_of(argv) == expect


@pytest.mark.parametrize("argv, says", [
    (["bash", "run.sh"], "must be [python, SCRIPT"),
    (["python"], "must be [python, SCRIPT"),
    (["python", "-m"], "without a module name"),
    (["python", "-u", "train.py"], "interpreter options ('-u')"),
])
def test_a_spare_refuses_commands_it_cannot_become(argv, says):
    with pytest.raises(ValueError, match=".*" + says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        script_of(argv)


@pytest.mark.parametrize("line, says", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"argv": "python s.py", "env": {}}', "argv is not a list"),
    (b'{"argv": ["python", "s.py"], "env": {"A": 1}}', "env is not an object of strings"),
    (b'{"argv": ["python", "s.py"], "env": {}, "output": 3}', "output is not a path"),
    (b'{"argv": ["sh", "s.py"], "env": {}}', "must be"),
])
def test_a_bad_activation_is_refused_with_its_reason(line, says):
    with pytest.raises(ValueError, match=says):
        Activation.decode(line)


@pytest.mark.timeout(90)
def test_a_spare_imports_ahead_then_becomes_the_script_with_its_argv_env_and_output(tmp_path, reporter):
    report, out, ready = tmp_path / "report.jsonl", tmp_path / "rank.out", tmp_path / "ready"
    spare = Spare([sys.executable, str(reporter)], child_env(), ready_file=str(ready))
    try:
        _wait(ready.exists, 60, "the spare's imports")
        proc = spare.activate([sys.executable, str(reporter), "a", "b"],
                              child_env(REPORT=str(report), MARKER="m1", EXIT_CODE="3"), output=str(out))
        assert proc.wait(timeout=30) == 3
    finally:
        spare.dismiss()
    (seen,) = _reports(report)
    assert seen == {"name": "__main__", "argv": [str(reporter), "a", "b"], "path0": str(tmp_path), "preloaded": True,
                    "stdin": "", "restart": None, "port": None, "rank": None, "marker": "m1"}
    assert "reporter output" in out.read_text()


@pytest.mark.timeout(90)
def test_a_spare_runs_a_module_given_with_dash_m(tmp_path, reporter):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(reporter.read_text())
    report = tmp_path / "report.jsonl"
    env = child_env(REPORT=str(report))
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    spare = Spare([sys.executable, "-m", "pkg.job"], env)
    try:
        assert spare.activate([sys.executable, "-m", "pkg.job", "x"], env).wait(timeout=60) == 0
    finally:
        spare.dismiss()
    (seen,) = _reports(report)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(pkg / "job.py"), "x"]


@pytest.mark.timeout(90)
def test_an_uncaught_error_in_the_script_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom in the rank')\n")
    out = tmp_path / "out"
    spare = Spare([sys.executable, str(script)], child_env())
    try:
        assert spare.activate([sys.executable, str(script)], child_env(), output=str(out)).wait(timeout=60) == 1
    finally:
        spare.dismiss()
    assert "RuntimeError: boom in the rank" in out.read_text()


@pytest.mark.timeout(60)
def test_a_spare_told_nothing_exits_without_running_the_script(tmp_path, reporter):
    report = tmp_path / "report.jsonl"
    spare = Spare([sys.executable, str(reporter)], child_env(REPORT=str(report)))
    try:
        assert spare.proc.stdin is not None
        spare.proc.stdin.close()  # end of input: dismissed
        assert spare.proc.wait(timeout=45) == 0
    finally:
        spare.dismiss()
    assert not report.exists()


@pytest.mark.timeout(60)
def test_a_dismissed_spare_is_ended_and_reaped_at_once(reporter):
    spare = Spare([sys.executable, str(reporter)], child_env())
    spare.dismiss()
    assert spare.proc.returncode is not None


def test_spares_need_a_python_command():
    with pytest.raises(ValueError, match="must be"):
        Launcher(["/bin/sleep", "10"], 1, spares=True)


def test_spare_imports_need_spares(reporter):
    with pytest.raises(SystemExit):
        parse_args(["--groups", "1", "--spare-import", "lightning", "--", str(reporter)])
    args = parse_args(["--groups", "1", "--spares", "--spare-import", "lightning", "--", str(reporter)])
    assert args.spares and args.spare_import == ["lightning"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_killed_group_restarts_from_its_warm_spares(tmp_path, reporter, nproc):
    report = tmp_path / "report.jsonl"
    env = child_env(REPORT=str(report), SLEEP_S="60")
    with Launcher([sys.executable, str(reporter)], 1, nproc_per_group=nproc, env=env, restart_delay=0.0,
                  spares=True, spare_delay=0.0, log_dir=str(tmp_path / "logs")) as launcher:
        launcher.start()
        _wait(lambda: launcher.poll() is not None and len(launcher.status(0).spare_pids) == nproc, 30, "spares")
        _wait(lambda: len(_reports(report)) == nproc, 60, "the first incarnation")
        spare_pids = launcher.status(0).spare_pids
        assert launcher.kill_group(0)
        _wait(lambda: any(e.kind == "started" and e.incarnation == 1 for e in launcher.poll() + launcher.events), 30,
              "the restart")
        started = [e for e in launcher.events if e.kind == "started"]
        assert "from warm spares" in started[1].detail and "from warm spares" not in started[0].detail
        assert launcher.status(0).pids == spare_pids  # the spares became the ranks
        _wait(lambda: len(_reports(report)) == 2 * nproc, 60, "the restarted incarnation")
        port = started[1].detail.split("MASTER_PORT ")[1].split(",")[0]
        second = _reports(report)[nproc:]
        assert sorted(r["rank"] for r in second) == [str(r) for r in range(nproc)]
        assert all(r["preloaded"] and r["restart"] == "1" and r["port"] == port for r in second)
        for rank in range(nproc):
            log = Path(launcher.log_path(0, rank)).read_text()
            assert log.count("reporter output") == 2 and "incarnation 1 started" in log and "(warm spare)" in log
        _wait(lambda: launcher.poll() is not None and len(launcher.status(0).spare_pids) == nproc, 30,
              "the next spares")
        launcher.shutdown(grace=0.0)
        assert launcher.status(0).spare_pids == ()
    assert launcher.status(0).state == GroupState.STOPPED


@pytest.mark.timeout(120)
def test_a_spare_that_dies_turns_its_groups_spares_off_and_the_restart_is_cold(tmp_path, reporter):
    report = tmp_path / "report.jsonl"
    env = child_env(REPORT=str(report), SLEEP_S="60")
    with Launcher([sys.executable, str(reporter)], 1, env=env, restart_delay=0.0, spares=True,
                  spare_delay=0.0, log_dir=str(tmp_path / "logs")) as launcher:
        launcher.start()
        _wait(lambda: launcher.poll() is not None and launcher.status(0).spare_pids, 30, "a spare")
        launcher._groups[0].spares[0].proc.kill()  # through the launcher's own handle (the OOM killer, say)
        _wait(lambda: any(e.kind == "spare" for e in launcher.poll() + launcher.events), 30, "the spare's loss")
        note = next(e for e in launcher.events if e.kind == "spare").detail
        assert "killed by SIGKILL" in note and "restarts cold" in note
        _wait(lambda: len(_reports(report)) == 1, 60, "the first incarnation")
        assert launcher.kill_group(0)
        _wait(lambda: launcher.poll() is not None and len(_reports(report)) == 2, 60, "the cold restart")
        started = [e for e in launcher.events if e.kind == "started"]
        assert len(started) == 2 and "warm" not in started[1].detail
        assert not _reports(report)[1]["preloaded"]
        launcher.poll()
        assert launcher.status(0).spare_pids == ()  # no new spares for this group


@pytest.mark.timeout(60)
def test_an_activation_larger_than_the_pipe_is_refused_at_once_not_waited_on(reporter):
    spare = Spare([sys.executable, str(reporter)], child_env())
    try:
        with pytest.raises(OSError, match="larger than its pipe takes at once"):  # a blocking write would hang here
            spare.activate([sys.executable, str(reporter)], child_env(BIG="x" * (1 << 20)))
    finally:
        spare.dismiss()
    assert spare.proc.returncode is not None
