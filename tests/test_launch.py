"""`ftl launch` and the Launcher: real processes, real signals, nothing left behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
from conftest import child_env, communicate_or_interrupt
from proctree import descendants, still_running

from ft_core.tools.launch_command import (
    FaultInjector,
    GroupState,
    Launcher,
    choose_victim,
    describe_exit,
    finished_job_verdict,
    group_env,
    group_of_replica,
    next_kill_delay,
    parse_args,
    quorum_wait_note,
)
from ft_core.tools.launcher import restart_delay_after
from ft_core.tools.ports import free_port

# A replica group stand-in: prints its identity, spawns a grandchild (to check a kill takes the
# whole process group), then sleeps `argv[1]` seconds (or $SLEEP_G<group>) and exits `argv[2]` (default 0).
SLEEPER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    group = os.environ["REPLICA_GROUP_ID"]
    print("up", group, os.environ["RANK"], os.environ["FT_RESTART_COUNT"], os.environ["MASTER_PORT"], child.pid,
          flush=True)
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"up.{group}"), "w").close()  # printed
    time.sleep(float(os.environ.get("SLEEP_G" + group, sys.argv[1])))
    child.kill()
    child.wait()
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")


@pytest.fixture
def sleeper(tmp_path: Path) -> str:
    path = tmp_path / "sleeper.py"
    path.write_text(SLEEPER)
    return str(path)


@pytest.mark.timeout(10)
def test_a_free_port_is_one_no_outgoing_connection_can_take_before_it_is_bound():
    """A group's rank 0 binds its MASTER_PORT seconds after the launcher picked it (after its imports): a port
    from the OS's range for outgoing connections could be taken meanwhile (a chaos run's group died with
    EADDRINUSE), so the launcher picks below that range, at random, confirmed free."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= port < low for port in ports), (low, ports)
    assert len(set(ports)) > 1, ports


# ----------------------------------------------------------------------------- pure rules

@pytest.mark.parametrize("rank, nproc, token, lighthouse, expect", [
    (0, 1, None, "127.0.0.1:9",
     {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "FT_LIGHTHOUSE": "127.0.0.1:9"}),
    (1, 2, "s3cret", "127.0.0.1:9", {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "FT_TOKEN": "s3cret"}),
    (0, 1, None, None, {"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "3", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "4242", "FT_RESTART_COUNT": "5", "GROUP_RANK": "0"}),
])
def test_group_env_sets_torchrun_and_replica_group_variables(rank, nproc, token, lighthouse, expect):
    env = group_env({"PATH": "/bin"}, group=2, num_groups=3, rank=rank, nproc_per_group=nproc, master_port=4242,
                    lighthouse=lighthouse, token=token, restart_count=5)
    for key, value in expect.items():
        assert env[key] == value
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1" and env["RES_OPTIONS"]
    if token is None:
        assert "FT_TOKEN" not in env
    if lighthouse is None:
        assert "FT_LIGHTHOUSE" not in env


@pytest.mark.parametrize("given, group, port", [("9100", 0, "9100"), ("9100", 2, "9102"), ("0", 3, "0")])
def test_group_env_gives_each_group_its_own_metrics_port(given, group, port):
    env = group_env({"FT_METRICS_PORT": given}, group=group, num_groups=4, rank=0, nproc_per_group=1,
                    master_port=1, lighthouse=None, token=None, restart_count=0)
    assert env["FT_METRICS_PORT"] == port


def test_group_env_keeps_thread_and_resolver_settings_the_user_chose():
    env = group_env({"OMP_NUM_THREADS": "4", "RES_OPTIONS": "attempts:2"}, group=0, num_groups=1, rank=0,
                    nproc_per_group=1, master_port=1, lighthouse=None, token=None, restart_count=0)
    assert env["OMP_NUM_THREADS"] == "4" and env["RES_OPTIONS"] == "attempts:2"


@pytest.mark.parametrize("eligible, running, min_survivors, allowed", [
    ([0, 1, 2], [0, 1, 2], 1, {0, 1, 2}),
    ([1], [0, 1, 2], 1, {1}),
    ([0], [0], 1, set()),  # the last running group is never killed
    ([0, 1], [0, 1], 2, set()),  # killing either would leave fewer than 2 running
    ([3], [0, 1], 1, set()),  # eligible but not running
    ([], [0, 1, 2], 1, set()),
])
def test_choose_victim_keeps_survivors(eligible, running, min_survivors, allowed):
    picks = {choose_victim(random.Random(seed), eligible, running, min_survivors) for seed in range(20)}
    assert picks == (allowed or {None})


def test_kill_schedule_is_seeded_and_near_the_interval():
    a = [next_kill_delay(random.Random(7), 10.0) for _ in range(3)]
    b = [next_kill_delay(random.Random(7), 10.0) for _ in range(3)]
    assert a == b
    rng = random.Random(1)
    delays = [next_kill_delay(rng, 10.0, jitter=0.15) for _ in range(200)]
    assert all(8.5 <= d <= 11.5 for d in delays) and len(set(delays)) > 100


@pytest.mark.parametrize("code, text", [(0, "exit 0"), (3, "exit 3"), (-9, "killed by SIGKILL"),
                                        (-15, "killed by SIGTERM"), (None, "running")])
def test_describe_exit(code, text):
    assert describe_exit(code) == text


@pytest.mark.parametrize("argv, message", [
    (["--groups", "2"], "no script given"),
    (["--groups", "0", "--", "x.py"], "--groups must be at least 1"),
    (["--groups", "2", "--kill-every", "0", "--", "-m", "x"], "--kill-every must be > 0"),
    (["--groups", "2", "--", "/no/such/train.py"], "not found"),
])
def test_bad_arguments_are_refused_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_script_and_its_arguments_follow_the_double_dash(sleeper):
    args = parse_args(["--groups", "3", "--nproc-per-group", "2", "--no-restart", "--", sleeper, "--lr", "0.1"])
    assert (args.groups, args.nproc_per_group, args.no_restart) == (3, 2, True)
    assert args.command == [sleeper, "--lr", "0.1"]


# ----------------------------------------------------------------------------- Launcher, in-process

def _wait(predicate, timeout: float, launcher: Launcher | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher is not None:
            launcher.poll()
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout} s")


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _grandchildren(log: Path) -> list[int]:
    return [int(line.split()[5]) for line in log.read_text().splitlines() if line.startswith("up ")]


@pytest.mark.timeout(30)
def test_a_killed_group_loses_every_process_and_restarts_as_a_new_incarnation(sleeper, tmp_path):
    with Launcher([sys.executable, sleeper, "60"], 2, nproc_per_group=2, env=child_env(), restart_delay=0.1,
                  log_dir=str(tmp_path / "logs")) as launcher:
        launcher.start()
        log = Path(launcher.log_path(1, 1))
        _wait(lambda: len(_grandchildren(log)) == 1, 15, launcher)
        pids = launcher.status(1).pids
        grandchild = _grandchildren(log)[0]
        assert launcher.kill_group(1, "test kill")
        _wait(lambda: not any(_alive(p) for p in (*pids, grandchild)), 5)  # SIGKILL lands asynchronously
        _wait(lambda: launcher.status(1).state == GroupState.RUNNING and launcher.status(1).incarnation == 1,
              10, launcher)
        _wait(lambda: len(_grandchildren(log)) == 2, 15, launcher)
        restarted = log.read_text().splitlines()[-1].split()
        assert restarted[1:4] == ["1", "1", "1"]  # group 1, rank 1, restart count 1
        assert launcher.status(0).incarnation == 0 and launcher.status(0).state == GroupState.RUNNING
        kinds = [(e.kind, e.group) for e in launcher.events]
        assert ("killed", 1) in kinds and ("restarting", 1) in kinds
        s = launcher.status(1)
        assert (s.kills, s.deaths) == (1, 1)
        live = [p for g in (0, 1) for p in launcher.status(g).pids]
    _wait(lambda: not any(_alive(p) for p in live), 5)  # shutdown on exit


@pytest.mark.timeout(30)
def test_a_crash_is_detected_restarted_and_success_needs_every_group_done(sleeper):
    with Launcher([sys.executable, sleeper, "0.5", "3"], 1, env=child_env(), restart=False) as launcher:
        launcher.start()
        assert launcher.run_until_done() is True
        assert launcher.lost_groups() == [0] and not launcher.succeeded
        assert "exit 3" in launcher.status(0).detail
    with Launcher([sys.executable, sleeper, "0.2"], 2, env=child_env()) as launcher:
        launcher.start()
        assert launcher.run_until_done() is True
        assert launcher.succeeded and [e.kind for e in launcher.events].count("done") == 2


@pytest.mark.timeout(30)
def test_a_group_that_dies_after_another_finished_is_lost_not_restarted(sleeper):
    # Its peers are gone: a restarted group would have nobody to heal from and train alone from scratch.
    with Launcher([sys.executable, sleeper, "0.3"], 2, env=child_env(SLEEP_G1="60"), restart_delay=0.5) as launcher:
        launcher.start()
        _wait(lambda: launcher.status(0).state == GroupState.DONE, 15, launcher)
        launcher.kill_group(1, "test kill")
        assert launcher.run_until_done() is True
        assert launcher.lost_groups() == [1] and "other groups already finished" in launcher.status(1).detail
        assert launcher.status(1).incarnation == 0


@pytest.mark.timeout(30)
def test_fault_injector_kills_seeded_up_to_max_kills_and_spares_the_last_group(sleeper):
    with Launcher([sys.executable, sleeper, "60"], 3, env=child_env(), restart_delay=0.1) as launcher:
        launcher.start()
        injector = FaultInjector(0.3, max_kills=3, seed=11)
        deadline = time.monotonic() + 15
        while len(injector.kills) < 3 and time.monotonic() < deadline:
            launcher.poll()
            injector.tick(launcher)
            time.sleep(0.02)
        assert [k.index for k in injector.kills] == [1, 2, 3]
        assert sum(launcher.status(g).kills for g in range(3)) == 3
        time.sleep(0.5)
        launcher.poll()
        assert injector.tick(launcher) is None and injector.exhausted
    with Launcher([sys.executable, sleeper, "60"], 1, env=child_env()) as launcher:
        launcher.start()
        lone = FaultInjector(0.01, seed=1)
        lone.arm(time.monotonic() - 1)
        assert lone.tick(launcher) is None and launcher.status(0).kills == 0


# ----------------------------------------------------------------------------- `ftl launch` as a process

def _ftl(*args: str) -> list[str]:
    return [sys.executable, "-m", "ft_core.tools.cli", *args]


@contextmanager
def _sigint_as_in_a_terminal() -> Iterator[None]:
    """Children started inside get SIGINT at its default, as a terminal's foreground command does.

    A test run in the background of a script (`pytest ... &`, `nohup`) ignores SIGINT, and an ignored signal
    stays ignored across exec: a Ctrl-C reaching `ftl launch` before it installs its handler is then dropped by
    the kernel, and the launcher runs on. A handler (unlike SIG_IGN) is reset to the default by exec.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """This process ignores SIGINT meanwhile, as pytest does when a script starts it with `&`."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _sigint_ignored_in(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))


def _end_left_behind(launch: subprocess.Popen, seen: set[tuple[int, str]]) -> None:
    """SIGKILL a launcher that did not stop, then whatever it left (by pid and start time, so never a reused pid)."""
    seen |= descendants(launch.pid)
    launch.kill()
    launch.wait(10)
    for pid, _ in still_running(seen | descendants(launch.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("moment, parent", [
    ("at once", "default"),
    ("at once", "ignoring SIGINT"),  # pytest started with `&` by a script: its children inherit SIG_IGN
    ("as the first rank starts", "default"),
    ("all groups up", "default"),
    ("mid-run with restarts", "default"),
])
def test_sigint_at_any_moment_leaves_no_process_behind(moment, parent, sleeper, processes, tmp_path):
    kill_every = ["--kill-every", "0.4", "--restart-delay", "0"] if moment == "mid-run with restarts" else []
    errors = open(tmp_path / "stderr.txt", "w+")  # noqa: SIM115 - closed below
    with _sigint_ignored() if parent == "ignoring SIGINT" else nullcontext(), _sigint_as_in_a_terminal():
        launch = processes.spawn(_ftl("launch", "--groups", "2", "--nproc-per-group", "2", "--stop-grace", "2",
                                      *kill_every, "--", sleeper, "60"),
                                 stdout=subprocess.DEVNULL, stderr=errors)
    seen: set[tuple[int, str]] = set()
    # 2 groups x 2 ranks, each rank with a grandchild: 8 descendants once everything is up
    want = {"at once": 0, "as the first rank starts": 1, "all groups up": 8, "mid-run with restarts": 8}[moment]
    deadline = time.monotonic() + 20
    while want and time.monotonic() < deadline:
        seen |= descendants(launch.pid)
        if len(seen) >= want:
            break
        time.sleep(0.01)
    if moment == "mid-run with restarts":  # let a few kills and restarts happen first
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            seen |= descendants(launch.pid)
            time.sleep(0.02)
    appeared = len(seen)
    os.killpg(launch.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    end = time.monotonic() + 20
    while launch.poll() is None and time.monotonic() < end:
        seen |= descendants(launch.pid)
        time.sleep(0.02)
    errors.seek(0)
    stderr = errors.read()
    errors.close()
    code, left = launch.poll(), still_running(seen)
    if left or code is None:  # failed: end it all here, the ranks live in sessions of their own
        _end_left_behind(launch, set(seen))
    assert appeared >= want, f"only {appeared} descendants appeared before the SIGINT"
    assert left == set(), f"{len(left)} of {len(seen)} processes left behind (launcher exit {code}): {stderr[-3000:]}"
    if code == 1 and "Fatal Python error: init_" in stderr:
        # The SIGINT landed while the interpreter was still starting (init_sys_streams, init_import_site: a wide
        # window on a busy machine): CPython itself exits 1 then, before any ftl code runs, so nothing was started.
        assert moment == "at once" and "KeyboardInterrupt" in stderr, stderr[-2000:]
        return
    assert code in (130, -signal.SIGINT), f"exit code {code} 20 s after the SIGINT: {stderr[-2000:]}"


# Runs `ftl` as `python -m ft_core.tools.cli` does, with a Ctrl-C landing while `argv[1]` is being imported.
SIGINT_DURING_IMPORT = textwrap.dedent("""
    import os, signal, sys

    class SigintOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == sys.argv[1]:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, SigintOnImport())
    from ft_core.tools.cli import main
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["ft_core.tools.launch_command", "grpc", "rich.console"])
def test_a_sigint_while_launch_imports_its_modules_starts_nothing_and_exits_130(module, sleeper, processes,
                                                                                tmp_path):
    script = tmp_path / "sigint_during_import.py"
    script.write_text(SIGINT_DURING_IMPORT)
    with _sigint_as_in_a_terminal():
        launch = processes.spawn([sys.executable, str(script), module, "launch", "--groups", "2", "--", sleeper, "60"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert not _sigint_ignored_in(launch.pid)
    out = communicate_or_interrupt(launch, 45)
    assert launch.returncode == 130, f"exit {launch.returncode}: {out[-3000:]}"
    assert "KeyboardInterrupt" not in out and "lighthouse" not in out, out[-3000:]  # no traceback, nothing started


@pytest.mark.timeout(30)
def test_sigterm_ends_every_group_and_the_exit_code_says_so(sleeper, processes):
    launch = processes.spawn(_ftl("launch", "--groups", "2", "--", sleeper, "60"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[tuple[int, str]] = set()
    deadline = time.monotonic() + 20
    while len(seen) < 4 and time.monotonic() < deadline:
        seen |= descendants(launch.pid)
        time.sleep(0.02)
    printed = [os.path.join(os.path.dirname(sleeper), f"up.{g}") for g in (0, 1)]
    while not all(os.path.exists(p) for p in printed) and time.monotonic() < deadline:
        time.sleep(0.02)  # both groups wrote their line (a SIGTERM can otherwise land before it)
    launch.send_signal(signal.SIGTERM)
    out = communicate_or_interrupt(launch, 20)
    assert launch.returncode == 128 + signal.SIGTERM
    assert still_running(seen) == set()
    assert "status page: http://127.0.0.1:" in out and "stopped" in out
    assert "[g0] up 0 0 0" in out and "[g1] up 1 0 0" in out  # each group's output, prefixed with its id


# A real fault-tolerant job without Lightning: one Manager per group, a tiny model, `argv[1]` steps.
# (4 s timeouts: a survivor blocked in a collective with the dead group gives up quickly.)
TRAINER = textwrap.dedent("""
    import hashlib, sys, time
    from datetime import timedelta
    import torch
    from ft_core import Manager
    from ft_core.process_groups import ProcessGroupGloo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=4)), load_state_dict=model.load_state_dict,
                      state_dict=model.state_dict, timeout=timedelta(seconds=4),
                      connect_timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20))
    x = torch.randn(16, 8)
    while manager.current_step() < int(sys.argv[1]):
        manager.start_quorum()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        if manager.should_commit():
            opt.step()
        time.sleep(float(sys.argv[2]))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print("finished step", manager.current_step(), "weights", digest[:16], flush=True)
    manager.finish()
    manager.shutdown()
""")


@pytest.mark.timeout(60)
def test_no_restart_a_killed_group_is_lost_while_the_survivors_finish_training(tmp_path, processes):
    """Training lasts ~10 s (40 steps of 0.25 s) so that every group is in before it ends: a group still
    importing torch on a busy machine when the others finish is refused as late (JobFinishedError), rightly."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    launch = processes.spawn(_ftl("launch", "--groups", "3", "--no-restart", "--kill-every", "4", "--max-kills", "1",
                                  "--seed", "5", "--", str(script), "40", "0.25"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = communicate_or_interrupt(launch, 50)
    assert launch.returncode == 1, out[-3000:]
    killed = [line for line in out.splitlines() if "killed: fault injection 1/1" in line]
    assert len(killed) == 1, out[-3000:]
    victim = killed[0].split("group ")[1].split()[0]
    finished = [line for line in out.splitlines() if "finished step 40 weights" in line]
    assert len(finished) == 2 and f"[g{victim}]" not in "".join(finished), out[-3000:]
    assert len({line.split("weights ")[1] for line in finished}) == 1  # the survivors agree bit for bit
    assert f"group(s) {victim} lost" in out


# ----------------------------------------------------------------------------- restarts: backoff and limit

@pytest.mark.parametrize("base, streak, delay", [
    (1.0, 0, 1.0),  # after a kill by the launcher: the plain delay
    (1.0, 1, 1.0),  # a first crash
    (1.0, 2, 2.0), (1.0, 3, 4.0), (1.0, 6, 30.0),  # doubling, capped at 30 s
    (0.1, 2, 1.0), (0.1, 3, 2.0),  # a tiny delay still backs off from 0.5 s
    (45.0, 4, 45.0),  # never below the delay asked for
])
def test_restart_delay_doubles_with_each_crash_in_a_row(base, streak, delay):
    assert restart_delay_after(base, streak) == delay


@pytest.mark.timeout(60)
def test_a_script_that_always_crashes_backs_off_and_is_given_up_naming_the_group_and_the_cause(tmp_path, processes):
    script = tmp_path / "crash.py"
    script.write_text("import sys\nprint('ConfigError: FT_BACKEND=mpi is not one of auto|gloo|nccl', file=sys.stderr)\n"
                      "sys.exit(3)\n")
    launch = processes.spawn(_ftl("launch", "--groups", "2", "--restart-delay", "0.1", "--max-restarts", "2",
                                  "--", str(script)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = communicate_or_interrupt(launch, 50)
    assert launch.returncode == 1, out[-3000:]
    cause = "exit 3 (last output: ConfigError: FT_BACKEND=mpi is not one of auto|gloo|nccl)"
    for group in (0, 1):
        delays = [line.split("restarting in ")[1].split("s")[0] for line in out.splitlines()
                  if f"group {group} restarting" in line]
        assert delays == ["0.1", "1"], out[-3000:]  # backs off: 0.1 s, then 1 s; then the limit
        assert f"group {group} lost: {cause}; keeps crashing: 3 crashes, not restarted past --max-restarts 2" in out
    assert "run failed: group(s) 0, 1 lost" in out


def test_max_restarts_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--groups", "1", "--max-restarts", "-1", "--", "-m", "x"])
    assert "--max-restarts must be >= 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a job that has finished

@pytest.mark.parametrize("step, final, peers, stopped", [
    (0, 39, [], True),  # restarted after the others finished: alone at step 0
    (20, 39, [], True),  # far behind, nobody left to heal from
    (38, 39, [], False),  # one step behind: the normal skew at the end of a run
    (39, 39, [], False),
    (0, 39, [39], False),  # a live peer ahead: it heals from it
    (0, 39, [0], True),  # peers as far behind are no source either
    (None, 39, [], False),  # not seen on the lighthouse yet
    (0, None, [], False),  # nothing finished yet
])
def test_finished_job_verdict_stops_only_a_group_that_would_retrain_alone(step, final, peers, stopped):
    verdict = finished_job_verdict(1, step, final, [0], peers)
    assert (verdict is not None) == stopped
    if stopped:
        assert f"already finished at step {final}" in verdict and "no live peer to heal from" in verdict


@pytest.mark.parametrize("replica_id, group", [("3:9f2c1a", 3), ("g12", 12), ("replica_group_0:ab", 0),
                                               ("0", 0), ("trainer", None)])
def test_group_of_replica(replica_id, group):
    assert group_of_replica(replica_id) == group


@pytest.mark.timeout(90)
def test_a_group_restarted_after_the_job_finished_is_stopped_not_retrained_alone(tmp_path, processes):
    # The killed group's next incarnation waits until a survivor has finished, then starts at step 0 with
    # nobody to heal from. It must not train the whole job alone and end "finished" with other weights.
    script = tmp_path / "trainer.py"
    marker = tmp_path / "finished"
    wait = textwrap.dedent(f"""\
        import os, pathlib
        if os.environ["FT_RESTART_COUNT"] != "0":
            while not pathlib.Path({str(marker)!r}).exists():
                time.sleep(0.05)
        """)
    script.write_text(TRAINER.replace("manager = Manager(", wait + "manager = Manager(", 1)
                      .replace("manager.shutdown()\n", f"manager.shutdown()\npathlib.Path({str(marker)!r}).touch()\n"))
    assert "pathlib.Path" in script.read_text()
    launch = processes.spawn(_ftl("launch", "--groups", "2", "--kill-every", "3", "--max-kills", "1", "--seed", "1",
                                  "--restart-delay", "0", "--", str(script), "100", "0.05"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = communicate_or_interrupt(launch, 80)
    assert launch.returncode == 1, out[-3000:]
    killed = [line for line in out.splitlines() if "killed: fault injection 1/1" in line]
    assert len(killed) == 1, out[-3000:]
    victim = killed[0].split("group ")[1].split()[0]
    # The engine refuses it at its first quorum (Manager.finish told the lighthouse); `ftl launch`'s own watch
    # of the lighthouse is the second line of defence, for scripts that do not call finish().
    refused = f"group {victim} lost: refused, not restarted: replica group {victim}: the job finished at step 100"
    watched = f"group {victim} lost: the job already finished at step"
    assert refused in out or watched in out, out[-3000:]
    assert f"group(s) {victim} lost" in out
    assert len([line for line in out.splitlines() if "finished step 100 weights" in line]) == 1, out[-3000:]


# ----------------------------------------------------------------------------- a quorum that does not form

@pytest.mark.parametrize("since, now, note", [
    ({}, 10.0, None),
    ({"0:ab": 8.0}, 10.0, None),  # 2 s: a quorum may still come
    ({"0:ab": 4.0, "g1": 2.0}, 10.0, "group 1, group 0 waiting 8 s for a quorum: why"),
    ({"trainer": 0.0}, 10.0, "trainer waiting 10 s for a quorum: why"),
])
def test_quorum_wait_note_names_the_waiting_groups_and_the_lighthouses_reason(since, now, note):
    assert quorum_wait_note(since, "why", now) == note


@pytest.mark.timeout(60)
def test_launch_says_why_a_quorum_is_not_forming_while_groups_wait(tmp_path, processes):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    launch = processes.spawn(_ftl("launch", "--groups", "1", "--min-replicas", "2", "--", str(script), "5", "0"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launch.stdout), name="test-launch-output", daemon=True)
    reader.start()
    deadline = time.monotonic() + 40
    while not any("for a quorum" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    launch.send_signal(signal.SIGINT)
    launch.wait(timeout=30)
    reader.join(10)
    note = [line for line in lines if "for a quorum" in line]
    assert note, "".join(lines)[-3000:]
    assert note[0].startswith("[launch] group 0 waiting ") and "need min_replicas 2" in note[0], note


@pytest.mark.timeout(100)
def test_launch_reports_a_group_the_lighthouse_refused_because_the_job_had_finished(tmp_path, processes):
    # A lighthouse on its own; group 1 trains and finishes (Manager.finish); then `ftl launch` starts group 0
    # behind the end: the engine refuses it (JobFinishedError) and the launcher reports that, no restart.
    from ft_core.control.lighthouse import LighthouseServer

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_job_end_worker.py")
    with LighthouseServer(min_replicas=1, join_timeout_ms=500) as lighthouse:
        env = child_env(FT_LIGHTHOUSE=lighthouse.address())
        done = processes.spawn([sys.executable, worker, "--group", "1", "--steps", "6"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out1 = done.communicate(timeout=60)[0]
        assert done.returncode == 0 and "done at step 6" in out1, out1[-3000:]
        launch = processes.spawn(_ftl("launch", "--groups", "1", "--lighthouse", lighthouse.address(),
                                      "--restart-delay", "0", "--", worker, "--group", "0", "--steps", "6"),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = communicate_or_interrupt(launch, 60)
    assert launch.returncode == 1, out[-3000:]
    assert "group 0 lost: refused, not restarted: replica group replica_group_0: the job finished at step 6 " \
           "(group replica_group_1) while this group was at step 0" in out, out[-3000:]
    assert "restarting" not in out and "committed step" not in out and "run failed: group(s) 0 lost" in out
