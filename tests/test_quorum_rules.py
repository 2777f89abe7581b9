"""Table tests of the lighthouse quorum rules (DESIGN.md section 5) on the pure decision function."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from ft_core.control.quorum import (
    MAX_DATA_BYTES,
    Joined,
    LighthouseState,
    QuorumConfig,
    Reported,
    decide,
    largest_reachable_set,
    member_problem,
    next_quorum_id,
    prune_heartbeats,
    refused_incarnations,
    replica_group,
    replica_id_problem,
    reported_members,
)
from ft_core.control.types import Quorum, QuorumMember

NOW = 1000.0


def m(rid: str, **kw: object) -> QuorumMember:
    return QuorumMember(replica_id=rid, address=f"{rid}:1", store_address=f"{rid}:2", **kw)


def quorum(qid: int, *rids: str) -> Quorum:
    return Quorum(qid, tuple(m(r) for r in sorted(rids)))


@dataclass
class Case:
    name: str
    waiting: list[tuple[QuorumMember, float]]  # (member, seconds since it joined)
    alive: dict[str, float]  # replica_id -> seconds since its last heartbeat
    expect: list[str] | None  # issued participants, None = keep waiting
    reason: str  # substring of the reason
    prev: Quorum | None = None
    quorum_id: int = 0
    expect_id: int | None = None
    first_seen: dict[str, float] | None = None  # replica_id -> seconds since it came alive (rule 8)
    reported: dict[str, tuple[int, float]] | None = None  # replica_id -> (reported quorum id, seconds since learned)
    holders: dict[str, int] | None = None  # replica_id -> highest step it brought to an issued quorum (rule 9)
    gave_up: dict[str, int] | None = None  # replica_id -> the step attempt it will not redo (rule 11)
    serving: float | None = None  # seconds since the lighthouse started serving the job (rule 12; None: long ago)
    excluded: list[str] = field(default_factory=list)  # rule 2: shrink-only callers outside the last quorum, answered
    config: QuorumConfig = field(default_factory=lambda: QuorumConfig(min_replicas=1, join_timeout_ms=60_000,
                                                                      heartbeat_timeout_ms=5_000))


def joined(*rids: str, ago: float = 0.5, **kw: object) -> list[tuple[QuorumMember, float]]:
    return [(m(r, **kw), ago) for r in rids]


def alive(*rids: str, ago: float = 0.1) -> dict[str, float]:
    return {r: ago for r in rids}


CASES = [
    Case("nobody waiting", [], alive("a"), None, "No replica is waiting"),
    Case("waiting but not heartbeating", joined("a"), {"a": 6.0}, None, "No waiting replica is healthy"),
    # join timeout
    Case("join timeout: wait for a straggler", joined("a", "b", ago=1.0), alive("a", "b", "c"), None,
         "waiting for 1 healthy but not participating stragglers"),
    Case("join timeout: expired, issue without the straggler", joined("a", "b", ago=61.0), alive("a", "b", "c"),
         ["a", "b"], "Valid quorum found", expect_id=1),
    Case("join timeout 0 issues at once", joined("a", "b"), alive("a", "b", "c"), ["a", "b"], "Valid quorum found",
         config=QuorumConfig(1, 0, 5_000)),
    Case("join timeout counts from the earliest join", [(m("a"), 61.0), (m("b"), 0.1)], alive("a", "b", "c"),
         ["a", "b"], "Valid quorum found"),
    Case("all healthy joined: no join wait", joined("a", "b"), alive("a", "b"), ["a", "b"], "Valid quorum found"),
    # heartbeat expiry
    Case("expired heartbeat is not a candidate", joined("a", "b"), {"a": 0.1, "b": 6.0}, ["a"],
         "Valid quorum found"),
    Case("heartbeat exactly at the timeout is expired", joined("a", "b"), {"a": 0.1, "b": 5.0}, ["a"],
         "[1/2 participants healthy]"),
    Case("expired member of the previous quorum: no fast path, new id", joined("a"), {"a": 0.1, "b": 6.0}, ["a"],
         "Valid quorum found", prev=quorum(4, "a", "b"), quorum_id=4, expect_id=5),
    Case("dead member still heartbeating blocks via split-brain guard", joined("a"), alive("a", "b"), None,
         "split-brain", prev=quorum(4, "a", "b"), quorum_id=4),
    # fast quorum
    Case("fast quorum: all previous members back", joined("a", "b"), alive("a", "b"), ["a", "b"], "Fast quorum",
         prev=quorum(3, "a", "b"), quorum_id=3, expect_id=3),
    Case("fast quorum skips min_replicas and stragglers", joined("a", "b"), alive("a", "b", "c"), ["a", "b"],
         "Fast quorum", prev=quorum(3, "a", "b"), quorum_id=3, expect_id=3, config=QuorumConfig(3, 60_000, 5_000)),
    Case("fast quorum takes joiners in", joined("a", "b", "d"), alive("a", "b", "d"), ["a", "b", "d"],
         "Fast quorum", prev=quorum(3, "a", "b"), quorum_id=3, expect_id=4),
    Case("no fast quorum while a previous member has not rejoined", joined("a", "b"), alive("a", "b", "c"), None,
         "stragglers", prev=quorum(3, "a", "b", "c"), quorum_id=3),
    # split-brain guard
    Case("split-brain: 1 of 2 healthy", joined("a"), alive("a", "b"), None, "more than half of 2"),
    Case("split-brain: 2 of 4 healthy", joined("a", "b"), alive("a", "b", "c", "d"), None, "more than half of 4"),
    Case("split-brain: 3 of 4 is a majority", joined("a", "b", "c", ago=61.0), alive("a", "b", "c", "d"),
         ["a", "b", "c"], "Valid quorum found"),
    # min_replicas
    Case("min_replicas not met", joined("a", "b"), alive("a", "b"), None, "need min_replicas 3",
         config=QuorumConfig(3, 60_000, 5_000)),
    Case("min_replicas met", joined("a", "b", "c"), alive("a", "b", "c"), ["a", "b", "c"], "Valid quorum found",
         config=QuorumConfig(3, 60_000, 5_000)),
    Case("min_replicas counts only healthy joiners", joined("a", "b", "c"), {"a": 0.1, "b": 0.1, "c": 9.0}, None,
         "need min_replicas 3", config=QuorumConfig(3, 60_000, 5_000)),
    # shrink_only
    Case("shrink_only drops a joiner, keeps survivors", [(m("a", shrink_only=True), 0.5), (m("b"), 0.5),
                                                         (m("d"), 0.5)],
         alive("a", "b", "d"), ["a", "b"], "shrink_only=True", prev=quorum(2, "a", "b", "c"), quorum_id=2,
         expect_id=3),
    Case("shrink_only on the fast path keeps the joiner out", [(m("a", shrink_only=True), 0.5), (m("b"), 0.5),
                                                               (m("d"), 0.5)],
         alive("a", "b", "d"), ["a", "b"], "Fast quorum", prev=quorum(2, "a", "b"), quorum_id=2, expect_id=2),
    Case("shrink_only cannot go below min_replicas", [(m("a", shrink_only=True), 0.5), (m("b"), 0.5), (m("d"), 0.5)],
         alive("a", "b", "c", "d"), None, "held back by shrink_only", prev=quorum(2, "a", "b", "c"), quorum_id=2,
         config=QuorumConfig(3, 60_000, 5_000)),
    Case("a redo fewer live members than min_replicas can never form is answered, not held",
         [(m("a", shrink_only=True), 0.5), (m("b"), 0.5), (m("d"), 0.5)], alive("a", "b", "d"), None,
         "need min_replicas 3", prev=quorum(2, "a", "b", "c"), quorum_id=2, excluded=["a"],
         config=QuorumConfig(3, 60_000, 5_000)),
    Case("a survivor whose only peer died keeps no joiner out", [(m("a", shrink_only=True), 0.5), (m("b"), 0.5)],
         alive("a", "b"), None, "answered: a", prev=quorum(4, "a", "c"), quorum_id=4, excluded=["a"],
         config=QuorumConfig(2, 60_000, 5_000)),
    Case("a redo of a whole quorum below min_replicas takes the fast path", joined("a", shrink_only=True),
         alive("a"), ["a"], "Fast quorum", prev=quorum(4, "a"), quorum_id=4, expect_id=4,
         config=QuorumConfig(2, 60_000, 5_000)),
    Case("shrink_only without a previous quorum keeps everyone", [(m("a", shrink_only=True), 0.5), (m("b"), 0.5)],
         alive("a", "b"), ["a", "b"], "Valid quorum found"),
    Case("a shrink-only caller outside the last quorum is answered, not held", [(m("c", shrink_only=True), 0.5),
                                                                              (m("a"), 0.5), (m("b"), 0.5)],
         alive("a", "b", "c"), ["a", "b"], "Fast quorum", prev=quorum(4, "a", "b"), quorum_id=4, expect_id=4,
         excluded=["c"]),
    Case("its shrink_only keeps no joiner out of the others' round", [(m("c", shrink_only=True), 0.5), (m("a"), 0.5),
                                                                      (m("d"), 0.5)],
         alive("a", "c", "d"), ["a", "d"], "Fast quorum", prev=quorum(4, "a"), quorum_id=4, expect_id=5,
         excluded=["c"]),
    Case("a shrink-only caller outside the last quorum, alone, is answered", [(m("c", shrink_only=True), 0.5)],
         alive("a", "c"), None, "answered: c", prev=quorum(4, "a"), quorum_id=4, excluded=["c"]),
    Case("unhealthy, it is answered too", [(m("c", shrink_only=True), 0.5), (m("a"), 0.5)],
         {"a": 0.1, "c": 9.0}, ["a"], "Fast quorum", prev=quorum(4, "a"), quorum_id=4, excluded=["c"]),
    # quorum_id
    Case("first quorum gets id 1", joined("a"), alive("a"), ["a"], "Valid", expect_id=1),
    Case("commit_failures force a new id", [(m("a", commit_failures=1), 0.5), (m("b"), 0.5)], alive("a", "b"),
         ["a", "b"], "Fast quorum", prev=quorum(7, "a", "b"), quorum_id=7, expect_id=8),
    Case("a rebuild request forces a new id, also on the fast path", [(m("a", rebuild=True), 0.5), (m("b"), 0.5)],
         alive("a", "b"), ["a", "b"], "Fast quorum", prev=quorum(7, "a", "b"), quorum_id=7, expect_id=8),
    Case("step and address changes keep the id", [(m("a", step=9), 0.5), (replace(m("b"), address="b:99"), 0.5)],
         alive("a", "b"), ["a", "b"], "Fast quorum", prev=quorum(7, "a", "b"), quorum_id=7, expect_id=7),
    Case("restarted lighthouse continues above the ids members saw", [(m("a", last_quorum_id=41), 0.5),
                                                                      (m("b", last_quorum_id=40), 0.5)],
         alive("a", "b"), ["a", "b"], "Valid", expect_id=42),
    Case("a member that saw a higher id (other lighthouse) forces a bump", [(m("a", last_quorum_id=20), 0.5),
                                                                           (m("b", last_quorum_id=5), 0.5)],
         alive("a", "b"), ["a", "b"], "Fast quorum", prev=quorum(5, "a", "b"), quorum_id=5, expect_id=21),
    # rule 7: reachability (members report the peers of the previous quorum they could not reach)
    Case("asymmetric partition: the pair that cannot talk is split, lowest ids win",
         [(m("a", unreachable=("b",)), 0.5), (m("b", unreachable=("a",)), 0.5), (m("c"), 0.5)],
         alive("a", "b", "c"), ["a", "c"], "Valid quorum found", prev=quorum(4, "a", "b", "c"), quorum_id=4,
         expect_id=5),
    Case("a one-sided report cuts the pair too", [(m("a"), 0.5), (m("b", unreachable=("a",)), 0.5), (m("c"), 0.5)],
         alive("a", "b", "c"), ["a", "c"], "unreachable from the others: b", prev=quorum(4, "a", "b", "c"),
         quorum_id=4),
    Case("a member that reaches no one is left out, not the others",
         [(m("a"), 0.5), (m("b", unreachable=("a", "c")), 0.5), (m("c"), 0.5)], alive("a", "b", "c"), ["a", "c"],
         "Valid quorum found", prev=quorum(4, "a", "b", "c"), quorum_id=4),
    Case("two groups that cannot talk: the lowest id trains on", [(m("a", unreachable=("b",)), 0.5),
                                                                 (m("b", unreachable=("a",)), 0.5)],
         alive("a", "b"), ["a"], "unreachable from the others: b", prev=quorum(2, "a", "b"), quorum_id=2,
         expect_id=3),
    Case("the excluded member is no straggler: no join wait", [(m("a", unreachable=("b",)), 0.1),
                                                              (m("b", unreachable=("a",)), 0.1), (m("c"), 0.1)],
         alive("a", "b", "c"), ["a", "c"], "Valid quorum found", prev=quorum(4, "a", "b", "c"), quorum_id=4),
    Case("reports about non-candidates are ignored: fast quorum", [(m("a", unreachable=("x",)), 0.5), (m("b"), 0.5)],
         alive("a", "b"), ["a", "b"], "Fast quorum", prev=quorum(3, "a", "b"), quorum_id=3, expect_id=3),
    Case("a cut joiner keeps the fast path of the previous members",
         [(m("a"), 0.5), (m("c"), 0.5), (m("b", unreachable=("a",)), 0.5)], alive("a", "b", "c"), ["a", "c"],
         "Fast quorum", prev=quorum(3, "a", "c"), quorum_id=3, expect_id=3),
    Case("an excluded member's old join does not start the join timeout for a straggler it cannot reach",
         [(m("b", unreachable=("a",)), 30.0), (m("c"), 0.1)], alive("a", "b", "c"), None,
         "waiting for 1 healthy but not participating stragglers", prev=quorum(5, "a", "c"), quorum_id=5,
         config=QuorumConfig(1, 2_000, 5_000)),
    Case("the join timeout still runs from the others' joins", [(m("b", unreachable=("a",)), 30.0), (m("c"), 2.5)],
         alive("a", "b", "c"), ["b", "c"], "Valid quorum found", prev=quorum(5, "a", "c"), quorum_id=5,
         config=QuorumConfig(1, 2_000, 5_000)),
    Case("min_replicas counts the reachable set", [(m("a", unreachable=("b",)), 0.5), (m("b"), 0.5)],
         alive("a", "b"), None, "need min_replicas 2", prev=quorum(2, "a", "b"), quorum_id=2,
         config=QuorumConfig(2, 60_000, 5_000)),
    # rule 8: one live member per replica group (replica id = group:incarnation)
    Case("a second live incarnation of a group is refused", joined("g:old", "g:new", "h:1"),
         alive("g:old", "g:new", "h:1"), ["g:old", "h:1"], "refused: g:new (replica group already has live g:old)",
         first_seen={"g:old": 50.0, "g:new": 1.0, "h:1": 50.0}),
    Case("the refused incarnation neither counts nor blocks as a straggler", joined("g:old", "h:1"),
         alive("g:old", "g:new", "h:1"), ["g:old", "h:1"], "Fast quorum", prev=quorum(3, "g:old", "h:1"),
         quorum_id=3, expect_id=3, first_seen={"g:old": 50.0, "g:new": 1.0, "h:1": 50.0}),
    Case("the older incarnation still wins when it has not joined yet", joined("g:new"), alive("g:old", "g:new"),
         None, "refused: g:new", first_seen={"g:old": 50.0, "g:new": 1.0}),
    Case("the newer incarnation takes part once the older is gone", joined("g:new", "h:1"),
         {"g:old": 6.0, "g:new": 0.1, "h:1": 0.1}, ["g:new", "h:1"], "Valid quorum found",
         first_seen={"g:old": 50.0, "g:new": 1.0, "h:1": 50.0}),
    # rule 9: a quorum all behind a healthy member of the previous quorum waits for it past the join timeout
    # (found by ftl chaos, cells c5 and c7: two restarted groups re-trained steps 1, 2, ... while the group
    # holding step 251 was stuck in a configure, still heartbeating)
    Case("all joiners behind a healthy absent holder: wait past the join timeout",
         joined("b", "c", ago=61.0, step=0), alive("a", "b", "c"), None, "every participant is behind step 251 of a",
         prev=Quorum(6, (m("a", step=251), m("b", step=0), m("x", step=251))), quorum_id=6),
    Case("the holder stops heartbeating: the quorum goes on without it", joined("b", "c", ago=61.0, step=0),
         {"a": 6.0, "b": 0.1, "c": 0.1}, ["b", "c"], "Valid quorum found",
         prev=Quorum(6, (m("a", step=251), m("b", step=0))), quorum_id=6, expect_id=7),
    Case("a straggler at the joiners' step is left behind at the join timeout as before",
         joined("a", "b", ago=61.0, step=9), alive("a", "b", "c"), ["a", "b"], "Valid quorum found",
         prev=Quorum(3, (m("a", step=9), m("b", step=9), m("c", step=9))), quorum_id=3, expect_id=4),
    Case("a joiner at the holder's step: no wait for the holder", [(m("b", step=251), 61.0), (m("c", step=0), 61.0)],
         alive("a", "b", "c"), ["b", "c"], "Valid quorum found",
         prev=Quorum(6, (m("a", step=251), m("b", step=251))), quorum_id=6, expect_id=7),
    # found by ftl chaos (c2, seed 44): a held step 212 from quorum 74 but was stuck in its configure; quorum 75
    # went on with c, the other holder of 212, which was then killed; b (211) and c's new incarnation (0) must
    # not train step 212 again while a heartbeats, although a is not in the previous quorum
    Case("a healthy holder from an older quorum: wait past the join timeout",
         [(m("b", step=211), 61.0), (m("c:2", step=0), 61.0)], alive("a", "b", "c:2"), None,
         "every participant is behind step 212 of a", prev=Quorum(75, (m("b", step=211), m("c:1", step=212))),
         quorum_id=75, holders={"a": 212, "b": 211, "c:1": 212}),
    Case("the older quorum's holder stops heartbeating: the quorum goes on without it",
         [(m("b", step=211), 61.0), (m("c:2", step=0), 61.0)], {"a": 6.0, "b": 0.1, "c:2": 0.1}, ["b", "c:2"],
         "Valid quorum found", prev=Quorum(75, (m("b", step=211), m("c:1", step=212))), quorum_id=75,
         expect_id=76, holders={"a": 212, "b": 211, "c:1": 212}),
    Case("a holder from an older quorum at the joiners' step is left behind at the join timeout",
         joined("b", "c:2", ago=61.0, step=212), alive("a", "b", "c:2"), ["b", "c:2"], "Valid quorum found",
         prev=Quorum(75, (m("b", step=212), m("c:1", step=212))), quorum_id=75, expect_id=76,
         holders={"a": 212}),
    Case("different groups with suffixes are independent", joined("g:1", "h:1"), alive("g:1", "h:1"),
         ["g:1", "h:1"], "Valid quorum found", first_seen={"g:1": 5.0, "h:1": 1.0}),
    # rule 10: a lighthouse that never issued the members' last quorum (restarted, or a standby that took over)
    # waits for that quorum's members it has not heard from, for one heartbeat timeout (found by ftl chaos: a
    # restarted lighthouse issued at max_step 802 to the groups that asked first while the group alone holding
    # committed step 803 was still reconnecting)
    Case("restarted lighthouse: waits for an unheard member of the reported quorum",
         joined("b", "c", last_quorum_id=151), alive("b", "c"), None, "waiting for a (quorum 151, 4.5 s left)",
         reported={"a": (151, 0.5), "b": (151, 0.5), "c": (151, 0.5)}),
    Case("the reported member heartbeats but has not asked: still waited for (its step is unknown here)",
         joined("b", "c", last_quorum_id=151), alive("a", "b", "c"), None,
         "waiting for a (quorum 151, heartbeating, has not asked for a quorum yet)",
         reported={"a": (151, 0.5), "b": (151, 0.5), "c": (151, 0.5)}),
    # found by ftl chaos (c7, seed 7, --spares): a, alone holding committed step 158, reconnected its heartbeat
    # to the restarted lighthouse while still in its step; left behind at the join timeout as a straggler, the
    # others trained step 158 again on another history
    Case("past the join timeout and the heartbeat timeout since the report: a heartbeating member is still waited for",
         joined("b", "c", ago=61.0, last_quorum_id=151), alive("a", "b", "c"), None,
         "waiting for a (quorum 151, heartbeating, has not asked for a quorum yet)",
         reported={"a": (151, 60.0), "b": (151, 60.0), "c": (151, 60.0)}),
    Case("a reported member that stops heartbeating is dead: the quorum goes on without it",
         joined("b", "c", ago=61.0, last_quorum_id=151), alive("b", "c"), ["b", "c"], "Valid quorum found",
         expect_id=152, reported={"a": (151, 60.0), "b": (151, 60.0), "c": (151, 60.0)}),
    Case("the reported member joins: the quorum is issued with it", joined("a", "b", "c", last_quorum_id=151),
         alive("a", "b", "c"), ["a", "b", "c"], "Valid quorum found", expect_id=152,
         reported={"a": (151, 0.5), "b": (151, 0.5), "c": (151, 0.5)}),
    Case("a heartbeat timeout since it was reported: the unheard member is dead",
         joined("b", "c", last_quorum_id=151), alive("b", "c"), ["b", "c"], "Valid quorum found", expect_id=152,
         reported={"a": (151, 5.0), "b": (151, 5.0), "c": (151, 5.0)}),
    Case("the wait holds the fast path of an older own quorum too (a standby that took over)",
         joined("b", "c", last_quorum_id=151), alive("b", "c"), None, "waiting for a (quorum 151",
         prev=quorum(5, "b", "c"), quorum_id=5, reported={"a": (151, 0.5)}),
    Case("the lighthouse issued that quorum itself: the report is ignored", joined("b", "c", last_quorum_id=151),
         alive("b", "c"), ["b", "c"], "Valid quorum found", prev=quorum(151, "a", "b", "c"), quorum_id=151,
         expect_id=152, reported={"a": (151, 0.5)}),
    Case("a report older than the lighthouse's own quorum is ignored", joined("b", "c", last_quorum_id=151),
         alive("b", "c"), ["b", "c"], "Fast quorum", prev=quorum(160, "b", "c"), quorum_id=160, expect_id=160,
         reported={"a": (151, 0.5)}),
    # rule 11: a redo does not wait for a member that gave up the attempt it redoes (its commit failed)
    Case("a redo waits for a live member of the attempt that has not asked (the majority guard)",
         joined("b", shrink_only=True, redo_quorum_id=7), alive("a", "b"), None, "need more than half",
         prev=quorum(7, "a", "b"), quorum_id=7),
    Case("a redo goes on without a member that gave up the attempt it redoes",
         joined("b", shrink_only=True, redo_quorum_id=7), alive("a", "b"), ["b"], "not waited for by the redo, "
         "having given up the attempt it redoes: a", prev=quorum(7, "a", "b"), quorum_id=7, expect_id=8,
         gave_up={"a": 7}),
    Case("the member that gave up already asks its next quorum: the redo goes on without it, its request waits",
         joined("b", shrink_only=True, redo_quorum_id=7) + joined("a"), alive("a", "b"), ["b"],
         "not waited for by the redo", prev=quorum(7, "a", "b"), quorum_id=7, expect_id=8, gave_up={"a": 7}),
    Case("giving up another attempt does not count", joined("b", shrink_only=True, redo_quorum_id=7),
         alive("a", "b"), None, "need more than half", prev=quorum(7, "a", "b"), quorum_id=7, gave_up={"a": 6}),
    Case("nor for a quorum that is no redo", joined("b", "c"), alive("a", "b", "c"), None,
         "waiting for 1 healthy but not participating stragglers", prev=quorum(7, "a", "b", "c"), quorum_id=7,
         gave_up={"a": 7}),
    Case("without the member that gave up, too few for min_replicas: the redo is answered at once",
         joined("b", shrink_only=True, redo_quorum_id=7), alive("a", "b"), None, "shrink-only outside the last quorum",
         prev=quorum(7, "a", "b"), quorum_id=7, gave_up={"a": 7}, excluded=["b"],
         config=QuorumConfig(min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)),
    # rule 12: a lighthouse that has just started gives the job's live members time to reconnect before a restart
    Case("a restarted group alone at a lighthouse started 1 s ago waits out its heartbeat timeout",
         joined("r", restarted=True), alive("r"), None, "r restarted and no participant reports a last quorum",
         serving=1.0),
    Case("the wait says how long is left", joined("r", restarted=True), alive("r"), None, "Waiting 4.0 s more",
         serving=1.0),
    Case("past the lighthouse's first heartbeat timeout it is issued", joined("r", restarted=True), alive("r"),
         ["r"], "Valid quorum found", serving=5.0, expect_id=1),
    Case("a member that reconnected in that time counts (the majority guard), so the restart does not go alone",
         joined("r", restarted=True), alive("a", "r"), None, "need more than half", serving=5.0),
    Case("a fresh job's groups are no restarts: a new lighthouse issues their first quorum at once",
         joined("a", "b"), alive("a", "b"), ["a", "b"], "Valid quorum found", serving=0.5, expect_id=1),
    Case("a restart beside a fresh group waits too (scaled up while the lighthouse restarted)",
         joined("a") + joined("r", restarted=True), alive("a", "r"), None, "r restarted", serving=0.5),
    Case("a participant that reports a last quorum: rule 10 knows the job's members, no wait for the restart",
         joined("a", last_quorum_id=9) + joined("r", restarted=True), alive("a", "r"), ["a", "r"],
         "Valid quorum found", serving=0.5, expect_id=10),
    Case("a restarted group that has been in a quorum reports it: no wait",
         joined("r", restarted=True, last_quorum_id=9), alive("r"), ["r"], "Valid quorum found", serving=0.5,
         expect_id=10),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    state = LighthouseState(
        waiting={member.replica_id: Joined(member, NOW - ago) for member, ago in case.waiting},
        heartbeats={rid: NOW - ago for rid, ago in case.alive.items()},
        prev_quorum=case.prev, quorum_id=case.quorum_id,
        first_seen={rid: NOW - ago for rid, ago in (case.first_seen or {}).items()},
        reported={rid: Reported(qid, NOW - ago) for rid, (qid, ago) in (case.reported or {}).items()},
        holders=case.holders or {}, gave_up=case.gave_up or {},
        serving_since=float("-inf") if case.serving is None else NOW - case.serving)
    decision = decide(state, NOW, case.config)
    got = None if decision.participants is None else [p.replica_id for p in decision.participants]
    assert got == case.expect, decision.reason
    assert sorted(decision.excluded) == case.excluded, decision.excluded
    assert all(f"last quorum {case.prev.quorum_id} " in decision.excluded[rid] for rid in case.excluded)
    assert case.reason in decision.reason
    assert decision.reason.endswith("]"), "every reason carries the [healthy][heartbeating][shrink_only] tag"
    if case.expect is not None:
        assert got == sorted(got), "participants are sorted by replica_id"
        assert decision.fast == ("Fast quorum" in decision.reason)
    if case.expect_id is not None:
        assert decision.quorum_id == case.expect_id
    if case.expect is None:
        assert decision.quorum_id == case.quorum_id, "waiting never changes the id"


ID_CASES = [
    # (name, prev quorum, current id, participants, expected id)
    ("no previous quorum", None, 0, [m("a")], 1),
    ("same members", quorum(3, "a", "b"), 3, [m("a"), m("b")], 3),
    ("member left", quorum(3, "a", "b"), 3, [m("a")], 4),
    ("member joined", quorum(3, "a"), 3, [m("a"), m("b")], 4),
    ("member replaced (restarted group has a new id)", quorum(3, "a", "b"), 3, [m("a"), m("b2")], 4),
    ("order of arrival does not matter", quorum(3, "a", "b"), 3, [m("b"), m("a")], 3),
    ("commit failure", quorum(3, "a", "b"), 3, [m("a"), m("b", commit_failures=2)], 4),
    ("rebuild asked (a redo's process group is broken, no failure counted yet)", quorum(3, "a", "b"), 3,
     [m("a"), m("b", rebuild=True)], 4),
    ("rebuild with a member that saw a higher id", quorum(3, "a", "b"), 3, [m("a", rebuild=True, last_quorum_id=6),
                                                                           m("b")], 7),
    ("address and step only", quorum(3, "a"), 3, [replace(m("a"), address="x:1", step=50)], 3),
    ("restart: members saw 9", None, 0, [m("a", last_quorum_id=9)], 10),
    ("restart: own counter is higher", None, 12, [m("a", last_quorum_id=9)], 13),
    ("member saw exactly our id: no bump", quorum(9, "a"), 9, [m("a", last_quorum_id=9)], 9),
]


@pytest.mark.parametrize("name,prev,qid,members,expected", ID_CASES, ids=[c[0] for c in ID_CASES])
def test_next_quorum_id(name: str, prev: Quorum | None, qid: int, members: list[QuorumMember],
                        expected: int) -> None:
    assert next_quorum_id(prev, qid, members) == expected


def test_restart_never_reissues_a_seen_id() -> None:
    """A fresh lighthouse (id 0, no previous quorum) issues above every id the members report."""
    for seen in range(0, 50, 7):
        state = LighthouseState({"a": Joined(m("a", last_quorum_id=seen), NOW)}, {"a": NOW})
        assert decide(state, NOW, QuorumConfig()).quorum_id > seen


REPORTS = [
    # (name, already reported, the member's report, lighthouse's own quorum id, expected new entries)
    ("a quorum above its own is news", {}, m("b", last_quorum_id=9, last_quorum_replica_ids=("a", "b")), 0,
     {"a": Reported(9, NOW), "b": Reported(9, NOW)}),
    ("its own quorum id: nothing new", {}, m("b", last_quorum_id=9, last_quorum_replica_ids=("a", "b")), 9, {}),
    ("an older quorum: nothing new", {}, m("b", last_quorum_id=8, last_quorum_replica_ids=("a", "b")), 9, {}),
    ("no list (a member of no quorum yet)", {}, m("b", last_quorum_id=9), 0, {}),
    ("a member already learned of keeps its first time", {"a": Reported(9, NOW - 2)},
     m("b", last_quorum_id=9, last_quorum_replica_ids=("a", "b")), 0, {"b": Reported(9, NOW)}),
    ("a later quorum naming it starts its time again", {"a": Reported(9, NOW - 2)},
     m("b", last_quorum_id=10, last_quorum_replica_ids=("a",)), 0, {"a": Reported(10, NOW)}),
    ("an older report does not replace a newer one", {"a": Reported(10, NOW - 2)},
     m("b", last_quorum_id=9, last_quorum_replica_ids=("a",)), 0, {}),
]


@pytest.mark.parametrize("name,known,member,qid,expected", REPORTS, ids=[r[0] for r in REPORTS])
def test_reported_members(name: str, known: dict[str, Reported], member: QuorumMember, qid: int,
                          expected: dict[str, Reported]) -> None:
    assert reported_members(known, member, qid, NOW) == expected


def test_shrink_joiner_gets_in_on_the_next_round() -> None:
    """A joiner held back by shrink_only keeps waiting, then enters through the next fast quorum."""
    cfg = QuorumConfig(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    beats = {r: NOW for r in ("a", "b", "d")}
    waiting = {"a": Joined(m("a", shrink_only=True), NOW), "b": Joined(m("b"), NOW), "d": Joined(m("d"), NOW)}
    first = decide(LighthouseState(waiting, beats, quorum(2, "a", "b", "c"), 2), NOW, cfg)
    assert [p.replica_id for p in first.participants] == ["a", "b"] and first.quorum_id == 3
    issued = Quorum(first.quorum_id, first.participants)
    still_waiting = {"d": waiting["d"]}
    alone = decide(LighthouseState(still_waiting, beats, issued, 3), NOW + 0.01, cfg)
    assert alone.participants is None and "split-brain" in alone.reason, "the joiner alone is a minority"
    still_waiting.update({"a": Joined(m("a"), NOW + 0.02), "b": Joined(m("b"), NOW + 0.02)})
    second = decide(LighthouseState(still_waiting, beats, issued, 3), NOW + 0.02, cfg)
    assert [p.replica_id for p in second.participants] == ["a", "b", "d"]
    assert second.fast and second.quorum_id == 4


PROBLEMS = [
    ("fine", m("a"), None),
    ("missing", None, "missing requester"),
    ("empty replica_id", QuorumMember(replica_id=""), "empty replica_id"),
    ("world_size 0", m("a", world_size=0), "world_size must be >= 1"),
    ("negative world_size", m("a", world_size=-2), "world_size must be >= 1"),
    ("negative step", m("a", step=-1), "step must be >= 0"),
    ("negative commit_failures", m("a", commit_failures=-1), "commit_failures"),
    ("negative last_quorum_id", m("a", last_quorum_id=-1), "last_quorum_id"),
    ("data at the limit", m("a", data="x" * MAX_DATA_BYTES), None),
    ("oversized data", m("a", data="x" * (MAX_DATA_BYTES + 1)), "over the 65536-byte limit"),
    ("huge replica_id", QuorumMember(replica_id="r" * 2000), "replica_id is longer"),
    ("too many unreachable", m("a", unreachable=tuple(f"r{i}" for i in range(5000))), "unreachable lists 5000"),
    ("huge unreachable id", m("a", unreachable=("r" * 2000,)), "unreachable replica id is longer"),
    ("too many last quorum members", m("a", last_quorum_replica_ids=tuple(f"r{i}" for i in range(5000))),
     "last_quorum_replica_ids lists 5000"),
    ("huge last quorum member id", m("a", last_quorum_replica_ids=("r" * 2000,)), "last_quorum_replica_ids replica"),
]


@pytest.mark.parametrize("name,member,problem", PROBLEMS, ids=[p[0] for p in PROBLEMS])
def test_member_problem(name: str, member: QuorumMember | None, problem: str | None) -> None:
    got = member_problem(member)
    assert (got is None) if problem is None else (got is not None and problem in got)


def test_replica_id_problem_and_prune() -> None:
    assert replica_id_problem("a") is None
    assert "empty" in replica_id_problem("")
    beats = {"fresh": NOW - 1, "expired": NOW - 6, "long_gone": NOW - 51}
    assert prune_heartbeats(beats, NOW, keep_s=50) == ["long_gone"]


REACHABLE = [
    # (name, candidates, unreachable reports, expected set)
    ("no reports", ["a", "b", "c"], {}, ["a", "b", "c"]),
    ("symmetric cut of one pair", ["a", "b", "c"], {"a": ["b"], "b": ["a"]}, ["a", "c"]),
    ("one-sided report", ["a", "b", "c"], {"c": ["a"]}, ["a", "b"]),
    ("tie between equal halves: lowest ids", ["a", "b", "c", "d"],
     {"a": ["c", "d"], "b": ["c", "d"], "c": ["a", "b"], "d": ["a", "b"]}, ["a", "b"]),
    ("the larger side wins over lower ids", ["a", "b", "c", "d"], {"a": ["b", "c", "d"]}, ["b", "c", "d"]),
    ("untouched members are always in", ["a", "b", "x", "y"], {"a": ["b"]}, ["a", "x", "y"]),
    ("independent cuts", ["a", "b", "c", "d", "e"], {"a": ["b"], "d": ["e"]}, ["a", "c", "d"]),
    ("a ring of cuts", ["a", "b", "c", "d"], {"a": ["b"], "b": ["c"], "c": ["d"], "d": ["a"]}, ["a", "c"]),
    ("self and strangers ignored", ["a", "b"], {"a": ["a", "zz"]}, ["a", "b"]),
    ("everyone cut from everyone: the lowest alone", ["c", "b", "a"],
     {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}, ["a"]),
]


@pytest.mark.parametrize("name,candidates,reports,expected", REACHABLE, ids=[r[0] for r in REACHABLE])
def test_largest_reachable_set(name: str, candidates: list[str], reports: dict[str, list[str]],
                               expected: list[str]) -> None:
    assert largest_reachable_set(candidates, reports) == expected


def test_largest_reachable_set_is_bounded_on_a_large_partition() -> None:
    """Two halves of 64 groups that cannot reach each other: a bounded search, still a valid answer."""
    left, right = [f"l{i:03d}" for i in range(64)], [f"r{i:03d}" for i in range(64)]
    reports = {rid: right for rid in left}
    got = largest_reachable_set(left + right, reports, budget=5_000)
    assert got == left, "the first side found (lowest ids) is kept when the search budget ends"
    assert all(not (set(reports.get(a, ())) & set(got)) for a in got)


def test_an_asymmetric_partition_does_not_livelock() -> None:
    """Rounds of decide() + a simulated step in which a and b cannot reach each other: after the one failed
    step that reveals the cut, every later step commits on the same mutually reachable set."""
    cfg = QuorumConfig(min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=5_000)
    blocked = {("a", "b"), ("b", "a")}
    beats = {r: NOW for r in ("a", "b", "c")}
    prev, qid, failures = None, 0, {"a": 0, "b": 0, "c": 0}
    reports: dict[str, tuple[str, ...]] = {r: () for r in beats}
    outcomes = []
    for round_no in range(8):
        waiting = {r: Joined(m(r, commit_failures=failures[r], unreachable=reports[r]), NOW) for r in beats}
        decision = decide(LighthouseState(waiting, beats, prev, qid), NOW, cfg)
        assert decision.participants is not None, decision.reason
        members = [p.replica_id for p in decision.participants]
        prev, qid = Quorum(decision.quorum_id, decision.participants), decision.quorum_id
        ok = not any((x, y) in blocked for x in members for y in members)
        outcomes.append(ok)
        for r in members:
            failures[r] = 0 if ok else failures[r] + 1
            # The manager server probes the last quorum's peers after a failed step, and again while its
            # last report was not empty.
            probe = failures[r] > 0 or reports[r]
            reports[r] = tuple(p for p in members if (r, p) in blocked) if probe else ()
        if ok:  # the excluded group's pending request keeps its last report
            assert "b" not in members
    assert outcomes[0] is False and all(outcomes[1:]), outcomes


def test_replica_group_and_refused_incarnations() -> None:
    assert replica_group("replica_0:3f2a") == "replica_0"
    assert replica_group("a:b:c") == "a:b"
    assert replica_group("plain") == "plain"
    assert replica_group(":x") == ":x"
    assert refused_incarnations({"g:1": 5.0, "g:2": 9.0, "g:3": 7.0, "h:1": 1.0}) == {"g:2": "g:1", "g:3": "g:1"}
    assert refused_incarnations({"g:b": 5.0, "g:a": 5.0}) == {"g:b": "g:a"}, "same age: the lowest id stays"
    assert refused_incarnations({"g:1": 1.0, "h:1": 1.0}) == {}
