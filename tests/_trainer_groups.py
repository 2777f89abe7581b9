"""Trainer replica groups as child processes, for the Lightning callback and collective tests: each group
is one worker script with the README's environment, its output in OUT/group<N>.log, its records in
OUT/record_g*.jsonl."""

from __future__ import annotations

import json
import subprocess
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
