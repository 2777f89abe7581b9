"""What a chaos run must never violate, as pure functions over the workers' JSON records.

Each rank of each worker incarnation (ft_core.tools.chaos_worker) writes
`g<group>.r<rank>.i<incarnation>.jsonl` (`g<group>.i<incarnation>.jsonl`: rank 0). `read_run` loads them
into `Incarnation`s; `check_run` returns every broken promise as a sentence:
- rank r of every group that committed step s holds the same digest for s (parameters, optimizer
  state, buffers; so do all participants of s);
- every checked reduction of a committed step (AVG of the participants' ranks, MAX, MIN) has its
  expected value, on participants and non-participants alike;
- committed steps strictly increase within an incarnation, and quorum ids never go backward;
- the ranks of one group incarnation commit the same steps (a group whose ranks part is wedged);
- no step commits unless at least min_replicas groups commit it (hold its state);
- training completes: every group reaches the target step.
Table-tested in tests/chaos/test_chaos.py; nothing here touches processes or the network.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TRANSFER_KINDS = ("recv_start", "recv_done", "recv_failed")
LOG_NAME = re.compile(r"^g(?P<group>[^.]+)(\.r(?P<rank>\d+))?\.i(?P<incarnation>\d+)\.jsonl$")


@dataclass
class Incarnation:
    """The records of one process of one replica group, in file order."""

    group: str
    incarnation: int
    records: list[dict[str, Any]] = field(default_factory=list)
    rank: int = 0

    @property
    def name(self) -> str:
        return f"group {self.group} incarnation {self.incarnation}" + (f" rank {self.rank}" if self.rank else "")

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
        found.append(Incarnation(match["group"], int(match["incarnation"]), records, int(match["rank"] or 0)))
    return sorted(found, key=lambda inc: (inc.group, inc.incarnation, inc.rank))


def parse_log_name(name: str) -> tuple[str, int, int] | None:
    """(group, rank, incarnation) of a worker's log file name, or None for another file."""
    match = LOG_NAME.match(name)
    return None if match is None else (match["group"], int(match["rank"] or 0), int(match["incarnation"]))


def check_digests(incarnations: list[Incarnation]) -> list[str]:
    """Rank r of every incarnation that committed step s has the same digest for s (as step ranges)."""
    first: dict[tuple[int, int], tuple[str, str]] = {}
    clashes: dict[tuple[str, str], list[int]] = {}
    for inc in incarnations:
        for rec in inc.steps:
            step, digest = int(rec["step"]), str(rec["digest"])
            seen = first.setdefault((step, inc.rank), (digest, inc.name))
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


def divergent_commits(incarnations: list[Incarnation]) -> int:
    """How many (step, rank) commits disagree with the first digest logged for that step and rank."""
    first: dict[tuple[int, int], str] = {}
    bad = 0
    for inc in incarnations:
        for rec in inc.steps:
            digest = first.setdefault((int(rec["step"]), inc.rank), str(rec["digest"]))
            bad += digest != str(rec["digest"])
    return bad


def reduced_as_expected(got: float, expected: float) -> bool:
    """A checked reduction's value matches its expectation (float64 sums of small integers: 1e-9 relative)."""
    return abs(got - expected) <= 1e-9 * max(1.0, abs(expected))


def check_reductions(incarnations: list[Incarnation]) -> list[str]:
    """Every checked reduction of a committed step ({name: [got, expected]}) got its expected value."""
    problems: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
    for inc in incarnations:
        for rec in inc.steps:
            for name, pair in (rec.get("reduce") or {}).items():
                got, expected = float(pair[0]), float(pair[1])
                if not reduced_as_expected(got, expected):
                    problems.setdefault((inc.name, name), []).append((int(rec["step"]), got, expected))
    return [f"wrong reduction: {who} committed {len(bad)} step(s) {format_steps([b[0] for b in bad])} with a "
            f"wrong {name.upper()} (first: step {bad[0][0]} got {bad[0][1]:g}, expected {bad[0][2]:g})"
            for (who, name), bad in problems.items()]


def check_group_ranks(incarnations: list[Incarnation]) -> list[str]:
    """The ranks of one group incarnation commit the same steps, up to where the first of them stopped
    logging (a kill ends the ranks at slightly different points): ranks at different steps are wedged."""
    by_key: dict[tuple[str, int], list[Incarnation]] = {}
    for inc in incarnations:
        by_key.setdefault((inc.group, inc.incarnation), []).append(inc)
    problems = []
    for (group, number), ranks in sorted(by_key.items()):
        if len(ranks) < 2:
            continue
        upto = min((inc.last_step() or 0) for inc in ranks)
        steps = {inc.rank: [int(r["step"]) for r in inc.steps if int(r["step"]) <= upto] for inc in ranks}
        reference = steps[min(steps)]
        for rank, mine in sorted(steps.items()):
            if mine != reference:
                extra = sorted(set(mine) ^ set(reference))
                problems.append(f"wedged: group {group} incarnation {number} rank {rank} committed other steps than "
                                f"rank {min(steps)} up to step {upto} (differing: {format_steps(extra)})")
    return problems


UNDER_REPLICATED = "under-replicated"


def under_replicated_steps(incarnations: list[Incarnation], min_replicas: int) -> list[tuple[int, list[str]]]:
    """Committed steps that fewer than min_replicas groups committed: (step, the groups that did).

    A group incarnation that ended (was killed) right after step s-1 may have committed s without
    logging it: such a step is not counted (the window is the few milliseconds between the vote and
    the record)."""
    holders: dict[int, set[str]] = {}
    ended_after: dict[int, set[str]] = {}  # step -> groups with an incarnation whose last record is step-1
    for inc in incarnations:
        if inc.rank != 0:
            continue
        for rec in inc.steps:
            holders.setdefault(int(rec["step"]), set()).add(inc.group)
        last = inc.last_step()
        if last is not None and not inc.of_kind("exit"):
            ended_after.setdefault(last + 1, set()).add(inc.group)
    return [(step, sorted(groups)) for step, groups in sorted(holders.items())
            if len(groups) < min_replicas and not (ended_after.get(step, set()) - groups)]


def ledger(incarnations: list[Incarnation], dataset_size: int) -> dict[int, dict[str, int]]:
    """Per epoch of the exactly-once sampler (runs with --ledger): steps, samples lost (never consumed,
    counted for complete epochs only) and duplicated (consumed twice), from the "consumed" indices each
    committed step logged per rank column, and "conflicts": steps whose committers logged different
    consumptions (the same step committed twice with other data: never expected)."""
    by_step: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}  # (step, rank) -> (epoch, consumed)
    conflicts: dict[int, int] = {}
    for inc in incarnations:
        for rec in inc.steps:
            if "consumed" not in rec:
                continue
            entry = (int(rec["epoch"]), tuple(int(i) for i in rec["consumed"]))
            seen = by_step.setdefault((int(rec["step"]), inc.rank), entry)
            if seen != entry:
                conflicts[entry[0]] = conflicts.get(entry[0], 0) + 1
    if not by_step:
        return {}
    counts: dict[int, dict[int, int]] = {}
    steps: dict[int, set[int]] = {}
    for (step, _rank), (epoch, consumed) in by_step.items():
        steps.setdefault(epoch, set()).add(step)
        bucket = counts.setdefault(epoch, {})
        for i in consumed:
            bucket[i] = bucket.get(i, 0) + 1
    last = max(counts)
    return {epoch: {"steps": len(steps[epoch]),
                    "lost": sum(1 for i in range(dataset_size) if i not in counts[epoch]) if epoch < last else 0,
                    "duplicated": sum(1 for c in counts[epoch].values() if c > 1),
                    "conflicts": conflicts.get(epoch, 0), "complete": epoch < last}
            for epoch in sorted(counts)}


def check_ledger(incarnations: list[Incarnation], dataset_size: int) -> list[str]:
    """Every complete epoch consumed each sample exactly once (nothing lost, nothing duplicated)."""
    problems = []
    for epoch, row in ledger(incarnations, dataset_size).items():
        if row["lost"] or row["duplicated"] or row["conflicts"]:
            problems.append(f"ledger: epoch {epoch} lost {row['lost']}, duplicated {row['duplicated']} sample(s), "
                            f"{row['conflicts']} step(s) logged with other consumptions")
    return problems


def check_min_replicas(incarnations: list[Incarnation], min_replicas: int) -> list[str]:
    """No step commits unless at least min_replicas groups commit it (and so hold its state). The
    participants a record logs (AVG's divisor) may be fewer: healers that load the state at commit
    count, but only if their commit happens; a healer whose load failed does not hold the step."""
    problems = [f"{inc.name}: step {rec['step']} logged without a participant count"
                for inc in incarnations for rec in inc.steps if not isinstance(rec.get("participants"), int)]
    low = under_replicated_steps(incarnations, min_replicas)
    if low:
        worst = min(low, key=lambda item: len(item[1]))
        problems.append(f"{UNDER_REPLICATED}: {len(low)} committed step(s) {format_steps([s for s, _ in low])} were "
                        f"committed by fewer than min_replicas {min_replicas} groups (e.g. step {worst[0]} by "
                        f"group(s) {', '.join(worst[1]) or 'none'} only)")
    return problems


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
    return (check_digests(incarnations) + check_reductions(incarnations) + check_monotonic(incarnations)
            + check_group_ranks(incarnations) + check_min_replicas(incarnations, min_replicas)
            + check_completion(incarnations, groups, target))


def heal_stats(incarnations: list[Incarnation]) -> dict[str, int]:
    """Counts of checkpoint transfers started, completed and failed, and of dropped requests."""
    count = {kind: sum(len(inc.of_kind(kind)) for inc in incarnations)
             for kind in ("recv_start", "recv_done", "recv_failed", "drop", "send", "step_error", "skip",
                          "load_failed", "recv_injected", "sampler_empty")}
    count["heals_loaded"] = sum(1 for inc in incarnations for r in inc.of_kind("event")
                                if r["event"].get("type") == "heal")
    return count


def heal_fault_outcomes(faults: list[dict[str, Any]], incarnations: list[Incarnation]) -> dict[str, dict[str, int]]:
    """How each heal fault landed, read back from the receiver's records.

    kill_heal_receiver: "mid_transfer" when the killed receiver never logged the end of its transfer.
    kill_heal_source: "transfer_failed" when the receiver's transfer of that step then failed,
    "transfer_done" when it had completed before the kill landed (the state was still to be loaded).
    """
    by_key = {(inc.group, inc.incarnation): inc for inc in incarnations if inc.rank == 0}
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


def membership_changes(incarnations: list[Incarnation]) -> int:
    """How many times the quorum's members (replica ids: a restarted group has a new one) changed from one
    quorum id to the next, over the quorums any worker logged."""
    members: dict[int, frozenset[str]] = {}
    for inc in incarnations:
        for rec in inc.of_kind("event"):
            event = rec["event"]
            if event.get("type") == "quorum" and event.get("quorum_id") is not None and event.get("replica_ids"):
                members.setdefault(int(event["quorum_id"]), frozenset(str(r) for r in event["replica_ids"]))
    sets = [members[q] for q in sorted(members)]
    return sum(1 for before, after in itertools.pairwise(sets) if before != after)


def _commits(incarnations: list[Incarnation], group: str | None, after: float, before: float) -> set[int]:
    """Steps that `group` (any group: None) committed with a record time strictly inside (after, before)."""
    return {int(r["step"]) for inc in incarnations if group is None or inc.group == group
            for r in inc.steps if after < float(r["time"]) < before}


def _healed_after(incarnations: list[Incarnation], group: str, after: float) -> bool:
    return any(r["event"].get("type") == "heal" and float(r["time"]) > after
               for inc in incarnations if inc.group == group for r in inc.of_kind("event"))


def network_fault_outcomes(incarnations: list[Incarnation], faults: list[dict[str, Any]],
                           graces: dict[str, float]) -> list[dict[str, Any]]:
    """What each network fault of a --network run did, and the promises it broke ("problems").

    A fault's promise is checked from `graces[kind]` seconds after it started (a step in flight at the
    cut ends within the collective timeout; a lighthouse failover takes the heartbeat timeout more)
    until it was lifted:
    - host_cut of group g: g commits nothing (it can reach no one); afterwards it commits again;
    - partition of groups a and b: a and b never commit the same step (no quorum can hold both: they
      cannot reach each other); afterwards both commit again;
    - lighthouse_cut: steps keep committing (through the other lighthouse).
    """
    outcomes = []
    for fault in faults:
        kind, start = fault["kind"], float(fault["time"])
        end = float(fault["end"]) if fault.get("end") is not None else start
        checked_from = start + graces.get(kind, 0.0)
        where = f"fault {fault['index']} ({kind} {fault['target']}, {end - start:.1f}s)"
        row: dict[str, Any] = {"index": fault["index"], "kind": kind, "target": fault["target"],
                               "seconds": round(end - start, 1),
                               "commits_during": len(_commits(incarnations, None, start, end)), "problems": []}
        if kind == "host_cut":
            g = str(fault["group"])
            cut = _commits(incarnations, g, checked_from, end)
            row.update(cut_commits=len(cut), rejoined=bool(_commits(incarnations, g, end, float("inf"))),
                       healed=_healed_after(incarnations, g, start))
            if cut:
                row["problems"].append(f"network: group {g} committed step(s) {format_steps(sorted(cut))} while its "
                                       f"host was cut off, {where}")
        elif kind == "partition":
            a, b = (str(x) for x in fault["pair"])
            steps = {g: _commits(incarnations, g, checked_from, end) for g in (a, b)}
            together = steps[a] & steps[b]
            fewer = sorted((a, b), key=lambda g: len(steps[g]))
            row.update(pair_commits=len(together), rejoined=all(_commits(incarnations, g, end, float("inf"))
                                                                for g in (a, b)),
                       excluded=fewer[0] if len(steps[fewer[0]]) < len(steps[fewer[1]]) else None)
            if together:
                row["problems"].append(f"network: groups {a} and {b} committed step(s) {format_steps(sorted(together))}"
                                       f" together while they could not reach each other, {where}")
        elif kind == "lighthouse_cut":
            during = _commits(incarnations, None, checked_from, end)
            row["commits_after_failover"] = len(during)
            if checked_from < end and not during:
                row["problems"].append(f"network: no step committed from {checked_from - start:.1f}s after the cut "
                                       f"until the link came back, {where}: the groups did not go on through the "
                                       f"other lighthouse")
        if kind in ("host_cut", "partition") and not row["rejoined"]:
            row["problems"].append(f"network: a group cut off by {where} never committed again afterwards")
        outcomes.append(row)
    return outcomes


def quorum_regressions(incarnations: list[Incarnation]) -> list[dict[str, Any]]:
    """Quorums issued at a max_step below a step already committed (by record time): the signature of a
    forked history (a quorum of groups that lack the latest state while a group holding it was alive
    but out of the quorum); each with its quorum id, time, max_step, the highest step committed before
    and the replica ids. A diagnosis for divergent commits, not a check of its own."""
    commits = sorted((float(r["time"]), int(r["step"])) for inc in incarnations for r in inc.steps)
    quorums: dict[int, tuple[float, int, list[str]]] = {}
    for inc in incarnations:
        for rec in inc.of_kind("event"):
            event = rec["event"]
            if event.get("type") == "quorum" and event.get("quorum_id") is not None \
                    and event.get("max_step") is not None:
                seen = (float(rec["time"]), int(event["max_step"]), list(event.get("replica_ids") or []))
                qid = int(event["quorum_id"])
                if qid not in quorums or seen[0] < quorums[qid][0]:
                    quorums[qid] = seen
    found, highest, i = [], 0, 0
    for qid, (t, max_step, ids) in sorted(quorums.items(), key=lambda item: item[1][0]):
        while i < len(commits) and commits[i][0] < t:
            highest = max(highest, commits[i][1])
            i += 1
        if max_step < highest:
            found.append({"quorum_id": qid, "time": t, "max_step": max_step, "highest_committed": highest,
                          "replica_ids": ids})
    return found
