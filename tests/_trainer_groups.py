"""Trainer replica groups as child processes, for the Lightning callback and collective tests: each group
is one worker script with the README's environment, its output in OUT/group<N>.log, its records in
OUT/record_g*.jsonl."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from conftest import child_env


def start_group(processes, worker: str, address: str, out: Path, group: int, groups: int, *args: str,
                restart: int = 0, quorum_timeout_s: int = 90) -> subprocess.Popen:
    env = child_env(FT_LIGHTHOUSE=address, REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(groups),
                    FT_TIMEOUT_SEC="30", FT_QUORUM_TIMEOUT_SEC=str(quorum_timeout_s), FT_CONNECT_TIMEOUT_SEC="30",
                    FT_RESTART_COUNT=str(restart), PYTHONWARNINGS="ignore")
    with open(out / f"group{group}.log", "ab") as log:
        return processes.python(worker, "--out", str(out), "--group", str(group), *args, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("group*.log")))


def records(out: Path) -> list[dict]:
    rows = []
    for path in sorted(out.glob("record_g*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def committers(rows: list[dict]) -> dict[int, set[int]]:
    """Per step, the groups that committed it as participants (the callbacks worker's `commit` records)."""
    out: dict[int, set[int]] = {}
    for r in rows:
        if r["kind"] == "commit" and r["participating_rank"] is not None:
            out.setdefault(r["step"], set()).add(r["group"])
    return out


def assert_one_writer_per_event(rows: list[dict]) -> dict[int, dict]:
    """Every checkpoint file written (the worker's `save` records) was written once, and every file of a step's
    checkpoint event by one process: group rank 0 of the lowest group that committed that step (rank zero).
    Returns, per step, one save record of its event."""
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        if r["kind"] == "save":
            by_step.setdefault(r["step"], []).append(r)
    assert by_step, "no checkpoint was written"
    lowest = committers(rows)
    for step, saves in sorted(by_step.items()):
        paths = [s["path"] for s in saves]
        assert len(paths) == len(set(paths)), (step, saves)  # no file written twice
        assert len({(s["group"], s["pid"]) for s in saves}) == 1, (step, saves)  # one process per event
        assert saves[0]["rank"] == 0 and saves[0]["group"] == min(lowest[step]), (step, saves, lowest.get(step))
    return {step: saves[0] for step, saves in by_step.items()}


def group_of(log_dir: str) -> int:
    """The replica group whose folder (`.../replica_group_<id>/...`) holds `log_dir`."""
    for part in Path(log_dir).parts:
        if part.startswith("replica_group_"):
            return int(part.rsplit("_", 1)[1])
    raise AssertionError(f"{log_dir} is in no replica_group_<id> folder")


def lr_steps_by_group(summaries: dict[int, dict]) -> dict[int, list[int]]:
    """The steps whose learning rate each group's CSV logger wrote (a group's logs are in its own folder);
    asserts no step was written by two groups (each logged step's line comes from that step's rank zero)."""
    steps_by_group: dict[int, list[int]] = {}
    for s in summaries.values():
        metrics = os.path.join(s["log_dir"], "metrics.csv")  # none where the group was never rank zero
        if os.path.exists(metrics):
            with open(metrics) as f:
                steps_by_group.setdefault(group_of(s["log_dir"]), []).extend(
                    int(row["step"]) for row in csv.DictReader(f) if row.get("lr-SGD"))
    seen: dict[int, int] = {}
    for group, steps in steps_by_group.items():
        for step in steps:
            assert seen.setdefault(step, group) == group, f"step {step} logged by groups {seen[step]} and {group}"
    return steps_by_group


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, out: Path) -> None:
    """Poll `condition` until it holds; fail naming `what` (with the groups' logs) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}\n{logs(out)}")
        time.sleep(0.2)
