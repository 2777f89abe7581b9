"""The lighthouse's quorum decision (DESIGN.md section 5) as pure functions of (state, now).

The gRPC/HTTP shell in `ft_core.control.lighthouse` keeps the state and calls `decide()` on every
Quorum call, every heartbeat change and every tick; nothing here touches threads, clocks or
the network, so every rule is covered by table tests (tests/test_quorum_rules.py).

Times are float seconds on one monotonic clock chosen by the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ft_core.control.types import Quorum, QuorumMember

MAX_DATA_BYTES = 64 * 1024  # user JSON carried in QuorumMember.data
MAX_FIELD_CHARS = 1024  # replica_id, address, store_address
MAX_QUORUM_ID = 2**62  # far above any real job; keeps max(reported) + 1 inside int64
MAX_UNREACHABLE = 4096  # replica ids one member may report unreachable
MAX_LAST_QUORUM_REPLICAS = 4096  # replica ids one member may report as its last quorum's members (rule 10)
CLIQUE_SEARCH_BUDGET = 20_000  # branch steps of the exact largest-reachable-set search per component


@dataclass(frozen=True)
class QuorumConfig:
    """The knobs of the quorum rules."""

    min_replicas: int = 1
    join_timeout_ms: int = 60_000
    heartbeat_timeout_ms: int = 5_000

    @property
    def join_timeout_s(self) -> float:
        return self.join_timeout_ms / 1000.0

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_timeout_ms / 1000.0


@dataclass(frozen=True)
class Joined:
    """A replica group waiting in a Quorum call, and when it joined."""

    member: QuorumMember
    joined_at: float


@dataclass(frozen=True)
class Reported:
    """Rule 10: a member of a quorum this lighthouse never issued, as a member's report of that quorum named it."""

    quorum_id: int  # the reported quorum
    learned_at: float  # when this lighthouse first heard of it as a member of that quorum


@dataclass(frozen=True)
class LighthouseState:
    """What the decision needs: who waits, who heartbeats, and the previous quorum."""

    waiting: Mapping[str, Joined]
    heartbeats: Mapping[str, float]  # replica_id -> time of last heartbeat
    prev_quorum: Quorum | None = None
    quorum_id: int = 0
    first_seen: Mapping[str, float] = field(default_factory=dict)  # replica_id -> when first heard (rule 8)
    reported: Mapping[str, Reported] = field(default_factory=dict)  # replica_id -> its report (rule 10)
    holders: Mapping[str, int] = field(default_factory=dict)  # replica_id -> top step it brought to a quorum (rule 9)
    gave_up: Mapping[str, int] = field(default_factory=dict)  # replica_id -> attempt it will not redo (rule 11)
    serving_since: float = float("-inf")  # when this lighthouse began to serve the job: started or took over (rule 12)


@dataclass(frozen=True)
class Decision:
    """The outcome of one decision: participants to issue now (None: keep waiting) and why."""

    participants: tuple[QuorumMember, ...] | None
    reason: str
    quorum_id: int  # the id the quorum gets if issued; the current id otherwise
    fast: bool = False
    refused: Mapping[str, str] = field(default_factory=dict)  # rule 8: refused replica id -> the live one it yields to
    excluded: Mapping[str, str] = field(default_factory=dict)  # rule 2: shrink-only caller outside it -> the answer


def healthy_replicas(heartbeats: Mapping[str, float], now: float, config: QuorumConfig) -> set[str]:
    """Rule 1: replicas whose last heartbeat is younger than heartbeat_timeout."""
    limit = config.heartbeat_timeout_s
    return {rid for rid, seen in heartbeats.items() if now - seen < limit}


def replica_group(replica_id: str) -> str:
    """The replica group a replica id names: the part before its incarnation suffix (`group:suffix`)."""
    group, sep, _ = replica_id.rpartition(":")
    return group if sep and group else replica_id


def refused_incarnations(live: Mapping[str, float]) -> dict[str, str]:
    """Rule 8: one live member per replica group. `live` maps live replica ids to when each was first
    seen; every live incarnation of a group but the oldest (ties: lowest id) is refused until the older
    one is gone. Returns refused replica id -> the live replica id it yields to."""
    by_group: dict[str, list[str]] = {}
    for rid in live:
        by_group.setdefault(replica_group(rid), []).append(rid)
    refused: dict[str, str] = {}
    for rids in by_group.values():
        if len(rids) > 1:
            first, *newer = sorted(rids, key=lambda r: (live[r], r))
            refused.update((rid, first) for rid in newer)
    return refused


def largest_reachable_set(candidates: Sequence[str], unreachable: Mapping[str, Collection[str]],
                          budget: int = CLIQUE_SEARCH_BUDGET) -> list[str]:
    """Rule 7: the largest subset of `candidates` whose members can all reach each other (ties: the
    lowest replica ids, compared as sorted lists), given each member's report of peers it could not
    reach. A pair is cut when either side reports the other, so an asymmetric partition never lets
    both in. Returned sorted.

    Members that no one reports and that report no one are in every answer; the others form a small
    conflict graph whose connected components are solved independently by an exact search (the
    largest independent set, found in lexicographic order) of at most `budget` steps each, past
    which the best set found so far is kept (still deterministic).
    """
    ids = sorted(set(candidates))
    present = set(ids)
    conflicts: dict[str, set[str]] = {}
    for rid in ids:
        for other in unreachable.get(rid, ()):
            if other != rid and other in present:
                conflicts.setdefault(rid, set()).add(other)
                conflicts.setdefault(other, set()).add(rid)
    if not conflicts:
        return ids
    keep = [rid for rid in ids if rid not in conflicts]
    seen: set[str] = set()
    for start in sorted(conflicts):
        if start in seen:
            continue
        component, stack = [], [start]
        seen.add(start)
        while stack:
            node = stack.pop()
            component.append(node)
            for peer in conflicts[node]:
                if peer not in seen:
                    seen.add(peer)
                    stack.append(peer)
        keep.extend(_largest_independent_set(sorted(component), conflicts, budget))
    return sorted(keep)


def _largest_independent_set(nodes: list[str], conflicts: Mapping[str, set[str]], budget: int) -> list[str]:
    """Largest set of `nodes` with no conflict among them; the lexicographically smallest of that size.

    Depth-first over sorted nodes, taking a node before leaving it out: the first set found of each
    size is the lexicographically smallest, so only a strictly larger one replaces it."""
    best: list[str] = []
    steps = 0

    def search(i: int, chosen: list[str], banned: frozenset[str]) -> None:
        nonlocal best, steps
        steps += 1
        if steps > budget:
            return
        free = sum(1 for n in nodes[i:] if n not in banned)
        if len(chosen) + free <= len(best):
            return  # cannot beat the best (equal size would be lexicographically larger)
        if i == len(nodes):
            best = list(chosen)
            return
        node = nodes[i]
        if node not in banned:
            chosen.append(node)
            search(i + 1, chosen, banned | conflicts[node])
            chosen.pop()
        search(i + 1, chosen, banned)

    search(0, [], frozenset())
    return best


def next_quorum_id(prev_quorum: Quorum | None, quorum_id: int, participants: Iterable[QuorumMember]) -> int:
    """Rule 5 plus restart safety: the id the quorum of `participants` gets.

    It bumps when there is no previous quorum, when the sorted replica ids differ from the
    previous quorum's, when any participant reports commit_failures > 0 or asks to `rebuild`
    (forces every group to rebuild its process group: a redo rebuilds a broken one before any
    failure is counted, and under the previous id it would meet that quorum's rendezvous keys,
    still in the store, while a member that joined as usual would not rebuild at all), or when
    a participant has seen a higher id than ours (a restarted or other lighthouse issued it).
    A bump gives max(ours, highest reported) + 1, so a restarted lighthouse never issues an id
    a manager has already seen. Changes of address or step alone keep the id.
    """
    members = list(participants)
    highest_seen = max((m.last_quorum_id for m in members), default=0)
    ids = sorted(m.replica_id for m in members)
    bump = (prev_quorum is None
            or ids != sorted(prev_quorum.replica_ids)
            or any(m.commit_failures > 0 or m.rebuild for m in members)
            or highest_seen > quorum_id)
    return max(quorum_id, highest_seen) + 1 if bump else quorum_id


EXCLUDED_CODE = "FAILED_PRECONDITION"  # the status a shrink-only caller outside the last quorum is answered with


def outside_last_quorum(waiting: Mapping[str, Joined], prev: Quorum | None, healthy: set[str] | None = None,
                        min_replicas: int = 1) -> dict[str, str]:
    """Rule 2's dead ends: the waiting replicas that ask for a shrink-only quorum (a redo of their step) that no
    quorum can ever answer, each with the answer it gets at once. Shrink-only keeps to the previous members, so
    no quorum can include a caller that is not one of them, nor any caller when fewer of them than
    min_replicas are still heartbeating (`healthy`; a lost member stays lost for that quorum). Left waiting, such
    a caller would wait out its whole deadline, and its shrink_only would keep every joiner out of the others'
    rounds meanwhile (a survivor whose only peer died kept a healthy third group out for its quorum timeout)."""
    asking = [rid for rid, j in waiting.items() if j.member.shrink_only] if prev is not None else []
    if not asking:  # the steady state: nothing more to do per decision
        return {}
    members = set(prev.replica_ids)
    answers = {rid: (f"{rid} asked for a shrink-only quorum (a redo of its step), but it is not a member of the last "
                     f"quorum {prev.quorum_id} ({', '.join(sorted(members))}), which the others have trained on "
                     f"without it; its step fails now and it rejoins with its next quorum")
               for rid in asking if rid not in members}
    left = sorted(members & healthy) if healthy is not None else sorted(members)
    if len(left) < min(min_replicas, len(members)):  # all of them still there: the fast path can reissue it
        answers.update({rid: (f"{rid} asked for a shrink-only quorum (a redo of its step), but only {len(left)} "
                              f"member(s) of the last quorum {prev.quorum_id} are still heartbeating "
                              f"({', '.join(left) or 'none'}), fewer than min_replicas {min_replicas}: no redo can "
                              f"form; its step fails now and it rejoins with its next quorum")
                        for rid in asking if rid not in answers})
    return answers


def gave_up_the_redo(waiting: Mapping[str, Joined], gave_up: Mapping[str, int]) -> set[str]:
    """Rule 11: the members that failed to commit the step attempt every waiting shrink-only caller redoes (their
    common redo_quorum_id; ft_core.redo) and will not redo it (their commit barrier decided so). Such a member is
    alive but takes no part in that redo, so the redo goes on without it: it counts as gone for that decision
    (neither a candidate nor a straggler; the majority guard and min_replicas count without it). If it already asks
    its next quorum, that request waits for the next decision, and it heals there from the redone step. Until
    2026-12-07 the redo waited for it: until it asked its next quorum, which then abandoned the redo (the peers lost
    the step), or, if it asked none, to the redo's quorum timeout."""
    attempts = {j.member.redo_quorum_id for j in waiting.values() if j.member.shrink_only}
    if len(attempts) != 1:
        return set()
    (attempt,) = attempts
    return {rid for rid, qid in gave_up.items() if attempt and qid == attempt}


def decide(state: LighthouseState, now: float, config: QuorumConfig) -> Decision:
    """Rules 1-12: whether a quorum can be issued now, with whom, and the reason either way."""
    healthy = healthy_replicas(state.heartbeats, now, config)
    refused = refused_incarnations({rid: state.first_seen.get(rid, 0.0) for rid in healthy}) \
        if state.first_seen else {}
    if refused:  # rule 8: a second live incarnation of a group neither counts nor takes part
        healthy -= refused.keys()
    gave_up = gave_up_the_redo(state.waiting, state.gave_up) if state.gave_up else set()  # rule 11
    healthy -= gave_up
    excluded = outside_last_quorum(state.waiting, state.prev_quorum, healthy, config.min_replicas)  # rule 2
    joined = {rid: j for rid, j in state.waiting.items() if rid in healthy and rid not in excluded}
    candidates = [joined[rid].member for rid in sorted(joined)]
    shrink_only = any(m.shrink_only for m in candidates)
    tag = (f"[{len(joined)}/{len(state.waiting)} participants healthy][{len(healthy)} heartbeating]"
           f"[shrink_only={shrink_only}]")
    refused_waiting = sorted(rid for rid in state.waiting if rid in refused)
    if refused_waiting:
        tag += "[refused: " + ", ".join(f"{rid} (replica group already has live {refused[rid]})"
                                        for rid in refused_waiting) + "]"

    if gave_up:
        tag += "[not waited for by the redo, having given up the attempt it redoes: " + ", ".join(sorted(gave_up)) + "]"
    if excluded:
        tag += "[shrink-only outside the last quorum, answered: " + ", ".join(sorted(excluded)) + "]"

    def wait(why: str) -> Decision:
        return Decision(None, f"{why} {tag}", state.quorum_id, refused=refused, excluded=excluded)

    def issue(members: list[QuorumMember], why: str, fast: bool = False) -> Decision:
        qid = next_quorum_id(state.prev_quorum, state.quorum_id, members)
        return Decision(tuple(members), f"{why} {tag}", qid, fast, refused=refused, excluded=excluded)

    if not state.waiting:
        return wait("No replica is waiting for a quorum.")
    if not joined:
        return wait(f"No waiting replica is healthy (no heartbeat within {config.heartbeat_timeout_ms} ms).")

    if state.reported:  # rule 10: a quorum this lighthouse never issued waits for its members to ask
        unheard = unheard_reported_members(state, now, config)
        if unheard:
            return wait(unheard_reason(unheard, now, config))

    young = config.heartbeat_timeout_s - (now - state.serving_since)
    restarted = restarted_without_history(candidates) if young > 0 else []
    if restarted:  # rule 12: a lighthouse that has just started waits for the members it has not heard yet
        return wait(f"New quorum not ready: {', '.join(restarted)} restarted and no participant reports a last "
                    f"quorum, while this lighthouse began to serve the job {now - state.serving_since:.1f} s ago "
                    f"(it restarted or took over): live members that hold the job's steps may not have reconnected "
                    f"yet, and a quorum without them would train those steps again. Waiting {young:.1f} s more "
                    f"(heartbeat_timeout, {config.heartbeat_timeout_ms} ms, after it began).")

    prev = state.prev_quorum
    prev_ids = set(prev.replica_ids) if prev is not None else set()
    if prev is not None and shrink_only:  # rule 2: only members of the previous quorum may take part
        candidates = [m for m in candidates if m.replica_id in prev_ids]
    if any(m.unreachable for m in candidates):  # rule 7: only a set that can all reach each other
        reachable = set(largest_reachable_set([m.replica_id for m in candidates],
                                              {m.replica_id: m.unreachable for m in candidates}))
        cut = [m.replica_id for m in candidates if m.replica_id not in reachable]
        if cut:
            candidates = [m for m in candidates if m.replica_id in reachable]
            tag += f"[unreachable from the others: {', '.join(cut)}]"
            if prev_ids & set(cut):
                prev_ids = set()  # no fast path: the previous membership cannot be reissued as it was
    if prev_ids and prev_ids <= joined.keys():  # rule 3: fast quorum
        return issue(candidates, "Fast quorum found!", fast=True)

    # Rule 4. min_replicas counts the participants actually issued (after shrink_only), so a
    # quorum never has fewer than min_replicas outside the fast path. The majority counts every
    # healthy waiting replica: a joiner held back by shrink_only has joined, it is no straggler.
    if len(candidates) < config.min_replicas:
        held = f" ({len(joined) - len(candidates)} held back by shrink_only)" if len(candidates) < len(joined) else ""
        return wait(f"New quorum not ready, only have {len(candidates)} participants{held}, "
                    f"need min_replicas {config.min_replicas}.")
    if 2 * len(joined) <= len(healthy):
        return wait(f"New quorum not ready, only have {len(joined)} participants, "
                    f"need more than half of {len(healthy)} healthy replicas (split-brain guard).")
    stragglers = len(healthy) - len(joined)
    if stragglers > 0:
        # The join timeout runs from the first join of a member that could train with the stragglers: one that
        # reported a straggler unreachable would be cut the moment it arrives (rule 7), so its join (often long
        # ago: it waits while excluded) must not let a quorum form without the straggler at once.
        straggling = healthy - joined.keys()
        clocks = [j.joined_at for j in joined.values() if not straggling.intersection(j.member.unreachable)]
        first_join = min(clocks) if clocks else now
        left = config.join_timeout_s - (now - first_join)
        if left > 0:
            return wait(f"Valid quorum with {len(candidates)} participants, waiting for {stragglers} healthy but "
                        f"not participating stragglers due to join timeout ({left:.1f} s left).")
        ahead = healthy_holders_ahead(prev, state.holders, healthy, joined.keys(), max(m.step for m in candidates))
        if ahead:  # rule 9: never issue a quorum that would train committed steps again while their holder lives
            return wait(f"New quorum not ready: every participant is behind step {ahead[0][1]} of "
                        f"{', '.join(rid for rid, _ in ahead)} (healthy, not participating); waiting for it to "
                        f"rejoin or stop heartbeating, since a quorum without it would train committed steps again.")
    return issue(candidates, "Valid quorum found.")


def restarted_without_history(candidates: Sequence[QuorumMember]) -> list[str]:
    """Rule 12: the restarted candidates (a group's later incarnation: it joins a job that ran before), when no
    candidate reports a last quorum; else none. A lighthouse knows a job's live members only from their heartbeats,
    and one that has just started (restarted, or a standby that took over) may not have heard them yet: a member
    reconnects within about a second (its stream's backoff). Rule 10 covers the members a report names; with no
    report, a restarted group alone (and min_replicas 1 allows that) would train the job's steps again from its
    start or its checkpoint, and commit them beside the members that hold them. Found by ftl chaos (c1, seed
    36301, min_replicas 1): a group restarted with the lighthouse asked first and committed steps 1-3 again.
    A fresh job's groups are no restarts, so a new job's first quorum is not delayed."""
    if any(m.last_quorum_id for m in candidates):
        return []
    return [m.replica_id for m in candidates if m.restarted]


def healthy_holders_ahead(prev: Quorum | None, holders: Mapping[str, int], healthy: Collection[str],
                          joined: Collection[str], max_step: int) -> list[tuple[str, int]]:
    """Rule 9: members of any quorum this lighthouse issued (`holders`: the highest step each brought to one;
    the previous quorum's participants too), still heartbeating but not joined, whose step is above every
    candidate's: (replica id, step), highest step first. A quorum without them would commit steps
    'max_step + 1 ...' a second time, on another history; the join timeout does not apply to them (their
    heartbeat timeout does). Not only the previous quorum's: found by ftl chaos (c2, seed 44), a holder of
    step 212 stuck in its configure for quorum 74 was absent from quorum 75, whose own holder of 212 was
    then killed, and quorum 76 trained step 212 again at max_step 211 beside it."""
    known = itertools.chain(holders.items(), ((m.replica_id, m.step) for m in (prev.participants if prev else ())))
    ahead: dict[str, int] = {}
    for rid, step in known:
        if step > max_step and rid in healthy and rid not in joined:
            ahead[rid] = max(step, ahead.get(rid, step))
    return sorted(ahead.items(), key=lambda item: (-item[1], item[0]))


def reported_members(reported: Mapping[str, Reported], member: QuorumMember, quorum_id: int,
                     now: float) -> dict[str, Reported]:
    """Rule 10's input: what `member`'s report of its last quorum teaches a lighthouse whose own latest quorum id
    is `quorum_id` (entries to add to `reported`). Only a quorum above that id is news: the lighthouse never issued
    it (it restarted, or it is a standby that took over). A member already learned of keeps its first time, unless
    a later quorum names it."""
    qid = member.last_quorum_id
    if qid <= quorum_id or not member.last_quorum_replica_ids:
        return {}
    new = {}
    for rid in member.last_quorum_replica_ids:
        known = reported.get(rid)
        if known is None or known.quorum_id < qid:
            new[rid] = Reported(qid, now)
    return new


def unheard_reported_members(state: LighthouseState, now: float, config: QuorumConfig
                             ) -> list[tuple[str, Reported, bool]]:
    """Rule 10: members of a quorum this lighthouse never issued (reported by the members, above its own latest
    id) that have not asked it for a quorum yet, with whether they heartbeat; sorted by replica id. Such a member
    may hold committed steps no one else holds, and until it asks (a request carries its step) this lighthouse
    cannot tell: rule 9 knows steps only from its own quorums. A quorum without it could train those steps again
    on another history, so it is waited for while it heartbeats (found by ftl chaos: a member reconnected its
    heartbeat to a restarted lighthouse while still in its step, was left behind as a straggler at the join
    timeout, and the others trained the step it alone had committed again); one never heard from is waited for
    one heartbeat timeout after it was reported, and past that it is dead."""
    limit = config.heartbeat_timeout_s
    unheard = []
    for rid, known in state.reported.items():
        if known.quorum_id <= state.quorum_id or rid in state.waiting:
            continue
        seen = state.heartbeats.get(rid)
        if reported_alive(known, seen, now, limit):
            unheard.append((rid, known, seen is not None and now - seen < limit))
    return sorted(unheard, key=lambda item: item[0])


def reported_alive(known: Reported, last_heartbeat: float | None, now: float, limit: float) -> bool:
    """Rule 10 still counts a reported member: while it heartbeats, or, never heard from, for one heartbeat
    timeout (`limit`) after it was reported. The lighthouse keeps a report exactly as long as this holds."""
    return (last_heartbeat is not None and now - last_heartbeat < limit) or now - known.learned_at < limit


def unheard_reason(unheard: Sequence[tuple[str, Reported, bool]], now: float, config: QuorumConfig) -> str:
    """Rule 10's wait, naming the members it waits for and why."""
    def left(known: Reported, heartbeating: bool) -> str:
        if heartbeating:
            return "heartbeating, has not asked for a quorum yet"
        return f"{config.heartbeat_timeout_s - (now - known.learned_at):.1f} s left"

    shown = ", ".join(f"{rid} (quorum {known.quorum_id}, {left(known, hb)})" for rid, known, hb in unheard[:8])
    more = f" and {len(unheard) - 8} more" if len(unheard) > 8 else ""
    return (f"New quorum not ready: waiting for {shown}{more}: member(s) of a quorum this lighthouse never issued "
            f"(it restarted or took over), reported by the members, that have not asked for a quorum yet; their "
            f"steps are unknown here, and a quorum without them could train steps they committed again. Waiting "
            f"until they ask, or stop heartbeating (one never heard from: heartbeat_timeout "
            f"({config.heartbeat_timeout_ms} ms) after it was reported).")


def member_problem(member: QuorumMember | None) -> str | None:
    """Why a requester is malformed (answered with INVALID_ARGUMENT), or None when it is fine."""
    if member is None:
        return "missing requester: send a QuorumMember"
    if not member.replica_id:
        return "empty replica_id: every replica group needs a unique, non-empty replica_id"
    for name in ("replica_id", "address", "store_address"):
        if len(getattr(member, name)) > MAX_FIELD_CHARS:
            return f"{name} is longer than {MAX_FIELD_CHARS} characters"
    if member.world_size < 1:
        return f"world_size must be >= 1 (ranks in the replica group), got {member.world_size}"
    if member.step < 0:
        return f"step must be >= 0, got {member.step}"
    if member.commit_failures < 0:
        return f"commit_failures must be >= 0, got {member.commit_failures}"
    if member.last_quorum_id < 0:
        return f"last_quorum_id must be >= 0, got {member.last_quorum_id}"
    if member.last_quorum_id >= MAX_QUORUM_ID:  # the next id must still fit the wire's int64
        return f"last_quorum_id must be < {MAX_QUORUM_ID}, got {member.last_quorum_id}"
    if len(member.unreachable) > MAX_UNREACHABLE:
        return f"unreachable lists {len(member.unreachable)} replicas, over the limit of {MAX_UNREACHABLE}"
    if any(len(rid) > MAX_FIELD_CHARS for rid in member.unreachable):
        return f"an unreachable replica id is longer than {MAX_FIELD_CHARS} characters"
    if len(member.last_quorum_replica_ids) > MAX_LAST_QUORUM_REPLICAS:
        return (f"last_quorum_replica_ids lists {len(member.last_quorum_replica_ids)} replicas, over the limit of "
                f"{MAX_LAST_QUORUM_REPLICAS}")
    if any(len(rid) > MAX_FIELD_CHARS for rid in member.last_quorum_replica_ids):
        return f"a last_quorum_replica_ids replica id is longer than {MAX_FIELD_CHARS} characters"
    size = len(member.data.encode())
    if size > MAX_DATA_BYTES:
        return f"data field is {size} bytes, over the {MAX_DATA_BYTES}-byte limit: send less user data"
    return None


def replica_id_problem(replica_id: str) -> str | None:
    """Why a heartbeat's replica_id is malformed, or None."""
    if not replica_id:
        return "empty replica_id: every replica group needs a unique, non-empty replica_id"
    if len(replica_id) > MAX_FIELD_CHARS:
        return f"replica_id is longer than {MAX_FIELD_CHARS} characters"
    return None


def prune_heartbeats(heartbeats: Mapping[str, float], now: float, keep_s: float) -> list[str]:
    """Replica ids whose heartbeat is older than keep_s: long expired, to be forgotten."""
    return [rid for rid, seen in heartbeats.items() if now - seen > keep_s]
