"""What a chaos run must never violate, as pure functions over the workers' JSON records.

Each worker incarnation (ft_core.tools.chaos_worker) writes `g<group>.i<incarnation>.jsonl`. `read_run`
loads them into `Incarnation`s; `check_run` returns every broken promise as a sentence:
- every group that committed step s holds the same digest for s (so do all participants of s);
- committed steps strictly increase within an incarnation, and quorum ids never go backward;
- no step commits with fewer than min_replicas participants;
- training completes: every group reaches the target step.
Table-tested in tests/chaos/test_chaos.py; nothing here touches processes or the network.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TRANSFER_KINDS = ("recv_start", "recv_done", "recv_failed")
LOG_NAME = re.compile(r"^g(?P<group>[^.]+)\.i(?P<incarnation>\d+)\.jsonl$")


@dataclass
class Incarnation:
    """The records of one process of one replica group, in file order."""

    group: str
    incarnation: int
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"group {self.group} incarnation {self.incarnation}"

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.of_kind("step")

    def last_step(self) -> int | None:
        steps = self.steps
        return int(steps[-1]["step"]) if steps else None

    def quorum_ids(self) -> list[int]:
        return [int(r["event"]["quorum_id"]) for r in self.of_kind("event")
                if r["event"].get("type") == "quorum" and r["event"].get("quorum_id") is not None]


class LogTail:
    """Reads the new complete lines of one JSONL file on each call (a line cut by SIGKILL is skipped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        return list(parse_lines(lines))


def parse_lines(lines: Iterable[bytes | str]) -> Iterable[dict[str, Any]]:
    for line in lines:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:  # a line torn by SIGKILL and later appended to: never a result
            continue
        if isinstance(record, dict):
            yield record


def read_run(out_dir: str) -> list[Incarnation]:
    """Every incarnation's records from a run folder, sorted by (group, incarnation)."""
    found = []
    for name in os.listdir(out_dir):
        match = LOG_NAME.match(name)
        if match is None:
            continue
        with open(os.path.join(out_dir, name), "rb") as f:
            records = list(parse_lines(f.read().split(b"\n")))
        found.append(Incarnation(match["group"], int(match["incarnation"]), records))
    return sorted(found, key=lambda inc: (inc.group, inc.incarnation))


def check_digests(incarnations: list[Incarnation]) -> list[str]:
    """Every incarnation that committed step s has the same digest for s (reported as step ranges)."""
    first: dict[int, tuple[str, str]] = {}
    clashes: dict[tuple[str, str], list[int]] = {}
    for inc in incarnations:
        for rec in inc.steps:
            step, digest = int(rec["step"]), str(rec["digest"])
            seen = first.setdefault(step, (digest, inc.name))
            if seen[0] != digest:
                clashes.setdefault((seen[1], inc.name), []).append(step)
    return [f"divergence: {a} and {b} hold different digests for {len(steps)} committed step(s) "
            f"{format_steps(steps)}" for (a, b), steps in clashes.items()]


def format_steps(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3..5, 9'."""
    ranges: list[list[int]] = []
    for step in sorted(steps):
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in ranges)


def check_monotonic(incarnations: list[Incarnation]) -> list[str]:
    """Committed steps strictly increase, and quorum ids never decrease, within each incarnation."""
    problems = []
    for inc in incarnations:
        steps = [int(r["step"]) for r in inc.steps]
        for before, after in zip(steps, steps[1:]):
            if after <= before:
                problems.append(f"{inc.name}: committed step {after} after step {before} (steps must strictly "
                                f"increase)")
        ids = inc.quorum_ids()
        for before, after in zip(ids, ids[1:]):
            if after < before:
                problems.append(f"{inc.name}: quorum id went backward from {before} to {after}")
    return problems


def check_min_replicas(incarnations: list[Incarnation], min_replicas: int) -> list[str]:
    """No step commits with fewer than min_replicas participants."""
    return [f"{inc.name}: step {rec['step']} committed with {rec.get('participants')} participants, "
            f"fewer than min_replicas {min_replicas}"
            for inc in incarnations for rec in inc.steps
            if not isinstance(rec.get("participants"), int) or rec["participants"] < min_replicas]


def check_completion(incarnations: list[Incarnation], groups: Iterable[str], target: int | None) -> list[str]:
    """Every group reached the target step (in some incarnation)."""
    if target is None:
        return ["training did not complete: the run never reached its final phase (no target step was set)"]
    problems = []
    for group in groups:
        reached = max((inc.last_step() or 0 for inc in incarnations if inc.group == group), default=0)
        if reached < target:
            problems.append(f"training did not complete: group {group} reached step {reached}, target {target}")
    return problems


def check_run(incarnations: list[Incarnation], *, min_replicas: int, groups: Iterable[str],
              target: int | None) -> list[str]:
    """Every broken promise of a run, as sentences (empty: the run kept all of them)."""
    return (check_digests(incarnations) + check_monotonic(incarnations)
            + check_min_replicas(incarnations, min_replicas) + check_completion(incarnations, groups, target))


def heal_stats(incarnations: list[Incarnation]) -> dict[str, int]:
    """Counts of checkpoint transfers started, completed and failed, and of dropped requests."""
    count = {kind: sum(len(inc.of_kind(kind)) for inc in incarnations)
             for kind in ("recv_start", "recv_done", "recv_failed", "drop", "send", "step_error")}
    count["heals_loaded"] = sum(1 for inc in incarnations for r in inc.of_kind("event")
                                if r["event"].get("type") == "heal")
    return count


def heal_fault_outcomes(faults: list[dict[str, Any]], incarnations: list[Incarnation]) -> dict[str, dict[str, int]]:
    """How each heal fault landed, read back from the receiver's records.

    kill_heal_receiver: "mid_transfer" when the killed receiver never logged the end of its transfer.
    kill_heal_source: "transfer_failed" when the receiver's transfer of that step then failed,
    "transfer_done" when it had completed before the kill landed (the state was still to be loaded).
    """
    by_key = {(inc.group, inc.incarnation): inc for inc in incarnations}
    outcomes: dict[str, dict[str, int]] = {"kill_heal_receiver": {}, "kill_heal_source": {}}
    for fault in faults:
        kind, receiver = fault.get("kind"), fault.get("receiver")
        if kind not in outcomes or not receiver:
            continue
        inc = by_key.get((str(receiver[0]), int(receiver[1])))
        transfer = [r for r in (inc.records if inc else [])
                    if r.get("kind") in TRANSFER_KINDS and r.get("step") == fault.get("step")]
        if kind == "kill_heal_receiver":
            label = "mid_transfer" if transfer and transfer[-1]["kind"] == "recv_start" else "after_transfer"
        else:
            ends = [r["kind"] for r in transfer if float(r["time"]) >= float(fault["time"]) - 5.0
                    and r["kind"] != "recv_start"]
            label = {"recv_failed": "transfer_failed", "recv_done": "transfer_done"}.get(ends[0] if ends else "",
                                                                                     "receiver_gone")
        outcomes[kind][label] = outcomes[kind].get(label, 0) + 1
    return outcomes
