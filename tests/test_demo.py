"""`ftl demo`: the report's arithmetic on known event streams, the live view's rules, and one real
end-to-end run (3 Lightning replica groups on CPU, real SIGKILLs, real heals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import child_env, communicate_or_interrupt

from ft_core.tools.launch_command import GroupState
from ft_lightning.demo import JsonlTail, group_state, stop_margin
from ft_lightning.demo.report import (
    GroupSeries,
    build_report,
    load_series,
    percentile,
    write_report,
)

T0 = 1_000.0


def _write(path: Path, records: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")


def _commits(first: int, last: int, t_first: float, dt: float, participants: int, quorum: int) -> list[dict]:
    return [{"event": "commit", "t": t_first + i * dt, "step": step, "committed": True, "loss": 4.0 - 0.01 * step,
             "quorum_id": quorum, "num_participants": participants, "state": "training"}
            for i, step in enumerate(range(first, last + 1))]


@pytest.fixture
def story(tmp_path: Path) -> tuple[Path, list[dict]]:
    """Three groups train steps 1..100 at 10 steps/s; group 1 is killed at t=T0+5 (step 50), the
    others stall 2 s, then go on; group 1 restarts, heals at step 70 in 0.3 s and trains to 100."""
    d = tmp_path / "groups"
    d.mkdir()
    for g in range(3):
        _write(d / f"{g}.jsonl", [{"event": "start", "t": T0, "group": g, "incarnation": 0},
                                  {"event": "quorum", "t": T0, "step": 0, "quorum_id": 1, "num_participants": 1,
                                   "heal": g != 0}])
        if g != 0:
            _write(d / f"{g}.jsonl", [{"event": "heal", "t": T0 + 0.05, "step": 0, "seconds": 0.01, "nbytes": 10}])
    for g in (0, 2):  # survivors: 1..50 before the kill, 2 s gap, 51..100 after
        _write(d / f"{g}.jsonl", _commits(1, 50, T0 + 0.1, 0.1, 3, 1) + _commits(51, 100, T0 + 7.0, 0.1, 2, 2))
    _write(d / "1.jsonl", _commits(1, 50, T0 + 0.1, 0.1, 3, 1))
    with open(d / "1.jsonl", "a") as f:  # the SIGKILL tore a line; the restarted script starts a new one
        f.write('{"event": "commit", "t": 1005.0, "step": 51, "comm' + "\n")
    _write(d / "1.jsonl", [{"event": "start", "t": T0 + 6.0, "group": 1, "incarnation": 1},
                           {"event": "quorum", "t": T0 + 8.9, "step": 0, "quorum_id": 3, "num_participants": 2,
                            "heal": True},
                           {"event": "heal", "t": T0 + 9.0, "step": 69, "seconds": 0.3, "nbytes": 1000}]
           + _commits(70, 100, T0 + 9.0, 0.1, 3, 3))
    digest = "ab" * 32
    for g in range(3):
        _write(d / f"{g}.jsonl", [{"event": "end", "t": T0 + 12, "step": 100, "weights_sha256": digest}])
    kills = [{"index": 1, "group": 1, "incarnation": 0, "time": T0 + 5.05}]
    return d, kills


def test_report_counts_failures_heals_gaps_and_identical_weights(story, tmp_path):
    groups_dir, kills = story
    series = load_series(str(groups_dir), 3)
    report = build_report(series, kills, started_at=T0, duration_s=10, kill_every=5, seed=0)
    assert report["failures_injected"] == 1 and report["failures_survived"] == 1
    assert report["heals"] == 1 and report["initial_syncs"] == 2
    assert report["heal_time_s"] == {"p50": 0.3, "max": 0.3}
    assert report["steps_committed"] == 100
    assert report["longest_commit_gap_s"] == pytest.approx(2.0, abs=1e-6)  # step 50 at +5.0, step 51 at +7.0
    assert report["weights_identical"] is True and report["success"] is True
    assert report["failures"][0]["step"] == 50 and report["failures"][0]["recovery_s"] == pytest.approx(3.95)
    s1 = report["series"]["1"]
    assert s1["restarts"] == 1 and s1["step"][49:51] == [50, 70] and s1["incarnation"][49:51] == [0, 1]
    json_path, png_path = write_report(report, str(tmp_path / "out"))
    on_disk = json.loads(Path(json_path).read_text())
    for key in ("failures_injected", "failures_survived", "heals", "steps_committed", "heal_time_s",
                "longest_commit_gap_s", "weights_identical", "series"):
        assert key in on_disk
    png = Path(png_path).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_a_different_digest_is_not_identical_and_a_missing_end_is_not_compared(story):
    groups_dir, kills = story
    series = load_series(str(groups_dir), 3)
    series[2].end = {**series[2].end, "weights_sha256": "cd" * 32}
    report = build_report(series, kills, started_at=T0, duration_s=10, kill_every=5, seed=0)
    assert report["weights_identical"] is False and report["success"] is False
    series = load_series(str(groups_dir), 3)
    series[0].end = None  # e.g. interrupted: nothing to compare, and the summary must not say "NOT identical"
    report = build_report(series, kills, started_at=T0, duration_s=10, kill_every=5, seed=0)
    assert report["weights_identical"] is None and report["success"] is False
    assert report["weights"] == "not compared: group(s) 0 did not finish"


def test_a_late_groups_catch_up_at_start_is_not_counted_as_a_failure_healed(story):
    groups_dir, kills = story
    _write(groups_dir / "2.jsonl", [{"event": "heal", "t": T0 + 0.5, "step": 5, "seconds": 0.1, "nbytes": 10}])
    report = build_report(load_series(str(groups_dir), 3), kills, started_at=T0, duration_s=10, kill_every=5, seed=0)
    assert report["heals"] == 1 and report["initial_syncs"] == 3  # only group 1's heal after its restart


def test_a_victim_that_never_trains_again_is_not_a_survived_failure(story):
    groups_dir, kills = story
    series = load_series(str(groups_dir), 3)
    victim = series[1]
    for column in (victim.time, victim.step, victim.loss, victim.num_participants, victim.quorum_id,
                   victim.incarnation_of):
        del column[50:]  # group 1 never trained again after the kill
    report = build_report(series, kills, started_at=T0, duration_s=10, kill_every=5, seed=0)
    assert report["failures_survived"] == 0 and report["success"] is False
    assert report["failure_notes"] == ["failure 1 (group 1 killed at 5.0s): not survived, group 1 did not train "
                                       "again before the end"]
    no_restart = build_report(series, kills, started_at=T0, duration_s=10, kill_every=5, seed=0, restart=False)
    assert no_restart["failures_survived"] == 1  # without restarts, survivors going on is enough
    at_the_end = [{**k, "time": T0 + 11.95} for k in kills]  # nobody committed after it
    assert build_report(series, at_the_end, started_at=T0, duration_s=10, kill_every=5, seed=0,
                        restart=False)["failures_survived"] == 0


@pytest.mark.parametrize("values, q, expect", [([], 50, None), ([3.0], 50, 3.0), ([1, 2, 3, 4], 50, 2.5),
                                               ([5, 1, 3], 100, 5), ([5, 1, 3], 0, 1)])
def test_percentile(values, q, expect):
    assert percentile(values, q) == expect


def _series(*records: dict) -> GroupSeries:
    s = GroupSeries(0)
    for rec in records:
        s.add(rec)
    return s


START0 = {"event": "start", "t": 1, "incarnation": 0}
START1 = {"event": "start", "t": 1, "incarnation": 1}
QUORUM = {"event": "quorum", "t": 2, "step": 0, "quorum_id": 1, "num_participants": 2, "heal": False}
QUORUM_HEAL = {**QUORUM, "heal": True}
HEAL = {"event": "heal", "t": 3, "step": 40, "seconds": 0.1}
COMMIT = {"event": "commit", "t": 4, "step": 41, "committed": True, "loss": 2.0, "num_participants": 2}


@pytest.mark.parametrize("launch_state, records, incarnation, expect", [
    (GroupState.PENDING, [], 0, "starting"),
    (GroupState.RUNNING, [], 0, "starting"),
    (GroupState.RUNNING, [START0, QUORUM, COMMIT], 0, "training"),
    (GroupState.RESTARTING, [START0, QUORUM, COMMIT], 0, "dead"),
    (GroupState.RUNNING, [START0, QUORUM, COMMIT], 1, "restarting"),  # new process, no record yet
    (GroupState.RUNNING, [START0, COMMIT, START1], 1, "restarting"),
    (GroupState.RUNNING, [START1, QUORUM_HEAL], 1, "healing"),
    (GroupState.RUNNING, [START1, QUORUM_HEAL, HEAL], 1, "restarting"),  # loaded, not yet committed
    (GroupState.RUNNING, [START1, QUORUM_HEAL, HEAL, COMMIT], 1, "training"),
    (GroupState.DONE, [START0, COMMIT], 0, "done"),
    (GroupState.LOST, [START0], 0, "lost"),
])
def test_group_state_shown_in_the_table(launch_state, records, incarnation, expect):
    assert group_state(launch_state, _series(*records), incarnation) == expect


@pytest.mark.parametrize("seconds_since_commit, expect", [(0.5, "training"), (2.0, "training"), (3.0, "waiting")])
def test_a_group_that_stopped_committing_is_shown_waiting(seconds_since_commit, expect):
    series = _series(START0, QUORUM, COMMIT)
    assert group_state(GroupState.RUNNING, series, 0, now=COMMIT["t"] + seconds_since_commit) == expect


def test_a_healing_steps_loss_is_not_shown():
    series = _series(START1, QUORUM_HEAL, HEAL, {**COMMIT, "loss": None}, {**COMMIT, "step": 42, "loss": None})
    assert series.last_loss is None
    series.add({**COMMIT, "step": 43, "loss": 1.5})
    assert series.last_loss == 1.5


@pytest.mark.parametrize("rate, expect", [(0, 5), (1, 5), (10, 20), (40, 80)])
def test_stop_margin_is_about_two_seconds_of_progress(rate, expect):
    now = 100.0
    steps = [(i, now - 5 + (i + 0.5) / rate) for i in range(5 * rate)] if rate else []
    assert stop_margin(steps, now) == expect


def test_tail_returns_whole_lines_only_and_skips_torn_ones(tmp_path):
    path = tmp_path / "0.jsonl"
    tail = JsonlTail(str(path))
    assert tail.read() == []
    path.write_text('{"event": "start", "incarnation": 0}\n{"event": "com')
    assert tail.read() == [{"event": "start", "incarnation": 0}]
    with open(path, "a") as f:
        f.write('\n{"event": "start", "incarnation": 1}\n{"event": "quorum"')
    assert tail.read() == [{"event": "start", "incarnation": 1}]
    with open(path, "a") as f:
        f.write(', "quorum_id": 4}\n')
    assert tail.read() == [{"event": "quorum", "quorum_id": 4}]


# ----------------------------------------------------------------------------- the real thing


@pytest.mark.timeout(150)
def test_demo_survives_failures_and_ends_with_identical_weights(tmp_path, processes):
    out = tmp_path / "demo"
    proc = processes.spawn([sys.executable, "-m", "ft_core.tools.cli", "demo", "--duration", "18", "--kill-every", "5",
                            "--out", str(out)], env=child_env(COLUMNS="120"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    text = communicate_or_interrupt(proc, 130)
    assert proc.returncode == 0, text[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["failures_survived"] >= 2, text[-4000:]
    assert report["failures_survived"] == report["failures_injected"]
    assert report["weights_identical"] is True
    assert report["heals"] >= report["failures_survived"]
    assert report["steps_committed"] > 20
    finals = {f["weights_sha256"] for f in report["final"].values()}
    assert len(finals) == 1 and None not in finals
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "identical in every group" in text and "failures survived" in text
    assert sorted(os.listdir(out / "groups")) == ["0.jsonl", "1.jsonl", "2.jsonl"]


@pytest.mark.timeout(100)
def test_an_interrupted_demo_says_the_weights_were_not_compared(tmp_path, processes):
    out = tmp_path / "demo"
    proc = processes.spawn([sys.executable, "-m", "ft_core.tools.cli", "demo", "--groups", "2", "--duration", "60",
                            "--kill-every", "0", "--out", str(out)], env=child_env(COLUMNS="120"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout), name="test-demo-output", daemon=True)
    reader.start()
    deadline = time.monotonic() + 80
    while not any("training started" in line for line in seen) and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(seen)[-3000:]
        time.sleep(0.1)
    assert any("training started" in line for line in seen), "".join(seen)[-3000:]
    proc.send_signal(signal.SIGINT)  # Ctrl-C: the demo ends every group before they finish
    proc.wait(timeout=60)
    reader.join(10)
    text = "".join(seen)
    assert proc.returncode == 130, text[-3000:]
    assert "not compared: group(s) 0, 1 did not finish" in text and "NOT identical" not in text, text[-3000:]
    assert "failures survived" in text and "interrupted" in text
    report = json.loads((out / "report.json").read_text())
    assert report["weights_identical"] is None and report["failures_injected"] == 0
