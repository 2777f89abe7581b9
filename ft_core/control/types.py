"""Plain values exchanged by the control plane, and their protobuf conversions.

The pure decision functions (quorum choice, recovery plan) work on these dataclasses;
only the servers and clients touch protobuf messages.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from ft_core.control.proto import ft_pb2


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as the lighthouse sees it."""

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 1
    shrink_only: bool = False
    data: str = ""
    commit_failures: int = 0
    last_quorum_id: int = 0
    unreachable: tuple[str, ...] = ()  # peers of the previous quorum this member could not reach
    commit_quorum_id: int = 0  # quorum in which it committed its latest step (0: none): its fork
    last_quorum_replica_ids: tuple[str, ...] = ()  # members of quorum last_quorum_id (rule 10); not echoed back
    rebuild: bool = False  # its process group is broken with no failure counted yet (a redo): fresh quorum_id
    redo_quorum_id: int = 0  # the quorum id of the step attempt it redoes (ft_core.redo; 0: not a redo)
    reductions: str = ""  # digest of the gradient chunks it reduces across groups (ft_core.ddp; "": unknown)
    restarted: bool = False  # a restarted incarnation of its group: it joins a job that ran before (rule 12)

    # Spelled out field by field: these run for every member of every quorum on both sides of the
    # wire, and reflection (dataclasses.fields) made them the control plane's hottest Python code.
    def to_pb(self) -> ft_pb2.QuorumMember:
        return ft_pb2.QuorumMember(replica_id=self.replica_id, address=self.address,
                                   store_address=self.store_address, step=self.step, world_size=self.world_size,
                                   shrink_only=self.shrink_only, data=self.data,
                                   commit_failures=self.commit_failures, last_quorum_id=self.last_quorum_id,
                                   unreachable=self.unreachable, commit_quorum_id=self.commit_quorum_id,
                                   last_quorum_replica_ids=self.last_quorum_replica_ids, rebuild=self.rebuild,
                                   redo_quorum_id=self.redo_quorum_id, reductions=self.reductions,
                                   restarted=self.restarted)

    @classmethod
    def from_pb(cls, msg: ft_pb2.QuorumMember) -> "QuorumMember":
        # Fills the instance dict in one call: a frozen dataclass's __init__ sets each field through
        # object.__setattr__, which costs 2-3x more (a manager decodes every member of every quorum).
        # tuple() of a upb repeated field walks it item by item (~0.8 us even when empty, as these two
        # nearly always are); a slice copies it in one call.
        member = object.__new__(cls)
        unreachable, reported = msg.unreachable, msg.last_quorum_replica_ids
        member.__dict__.update(replica_id=msg.replica_id, address=msg.address, store_address=msg.store_address,
                               step=msg.step, world_size=msg.world_size, shrink_only=msg.shrink_only, data=msg.data,
                               commit_failures=msg.commit_failures, last_quorum_id=msg.last_quorum_id,
                               unreachable=tuple(unreachable[:]) if unreachable else (),
                               commit_quorum_id=msg.commit_quorum_id,
                               last_quorum_replica_ids=tuple(reported[:]) if reported else (), rebuild=msg.rebuild,
                               redo_quorum_id=msg.redo_quorum_id, reductions=msg.reductions, restarted=msg.restarted)
        return member

    def without_last_quorum(self) -> "QuorumMember":
        """This member without its report of its last quorum's members: what a lighthouse keeps and issues once it
        has read the report (a quorum that echoed every member's list back would grow with the square of its size)."""
        if not self.last_quorum_replica_ids:
            return self
        member = object.__new__(type(self))
        member.__dict__.update(self.__dict__, last_quorum_replica_ids=())
        return member


def common_redo_quorum_id(ids: Any) -> int:
    """The step attempt every one of `ids` redoes, else 0: members (or a group's ranks) that do not all redo the
    same one would issue other collectives than a replay's (ft_core.redo, step_rules.redo_role)."""
    distinct = set(ids)
    return distinct.pop() if len(distinct) == 1 else 0


@dataclass(frozen=True)
class Roster:
    """A quorum's participants as columns, in participant order: what recovery plans and quorum rounds read
    each step. Tuples of strings and ints are dropped by the cycle collector from its watch at its next pass,
    so a quorum a member keeps for a round adds nothing for full collections to carry (one object per
    participant did: at a few hundred groups, a full collection every few seconds in every process that
    hosts groups)."""

    replica_ids: tuple[str, ...]
    addresses: tuple[str, ...]
    store_addresses: tuple[str, ...]
    steps: tuple[int, ...]
    world_sizes: tuple[int, ...]
    commit_quorum_ids: tuple[int, ...]
    commit_failures: tuple[int, ...]
    redo_quorum_ids: tuple[int, ...]
    reductions: tuple[str, ...]

    @classmethod
    def of(cls, members: Any) -> "Roster":
        """From QuorumMembers or protobuf QuorumMember messages (the same field names)."""
        members = list(members)
        return cls(replica_ids=tuple([m.replica_id for m in members]), addresses=tuple([m.address for m in members]),
                   store_addresses=tuple([m.store_address for m in members]), steps=tuple([m.step for m in members]),
                   world_sizes=tuple([m.world_size for m in members]),
                   commit_quorum_ids=tuple([m.commit_quorum_id for m in members]),
                   commit_failures=tuple([m.commit_failures for m in members]),
                   redo_quorum_ids=tuple([m.redo_quorum_id for m in members]),
                   reductions=tuple([m.reductions for m in members]))


@dataclass(frozen=True)
class Quorum:
    """An issued quorum: its id and participants sorted by replica_id.

    A quorum decoded from the lighthouse's answer (from_response_bytes) has its roster only; its
    `participants` are decoded from the kept bytes the first time something reads them."""

    quorum_id: int
    participants: tuple[QuorumMember, ...] = field(default_factory=tuple)
    created_unix_ms: int = 0

    def __getattr__(self, name: str) -> Any:  # only for attributes not yet in the instance: the lazy participants
        raw = self.__dict__.get("_raw")
        if name != "participants" or raw is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        participants = tuple(QuorumMember.from_pb(m)
                             for m in ft_pb2.LighthouseQuorumResponse.FromString(raw).quorum.participants)
        self.__dict__["participants"] = participants
        return participants

    @functools.cached_property
    def roster(self) -> Roster:
        return Roster.of(self.participants)

    @functools.cached_property
    def replica_ids(self) -> list[str]:
        """The participants' replica ids, in order; computed once per quorum (every group a process hosts, and
        every rank of a group, reads it each round), so the list is shared: read it, never change it."""
        return list(self.roster.replica_ids)

    def to_pb(self) -> ft_pb2.Quorum:
        return ft_pb2.Quorum(quorum_id=self.quorum_id, participants=[m.to_pb() for m in self.participants],
                             created_unix_ms=self.created_unix_ms)

    @classmethod
    def from_pb(cls, msg: ft_pb2.Quorum) -> "Quorum":
        return cls(quorum_id=msg.quorum_id, participants=tuple(QuorumMember.from_pb(m) for m in msg.participants),
                   created_unix_ms=msg.created_unix_ms)

    @classmethod
    def from_response_bytes(cls, raw: bytes) -> "Quorum":
        """The quorum of a serialized LighthouseQuorumResponse, with its roster and without participant objects
        (see Roster). The lighthouse sends every member the same bytes, so the members of one process (a
        launcher's, a benchmark's) decode each quorum once."""
        with _decoded_lock:
            quorum = _DECODED.get(raw)
        if quorum is None:
            msg = ft_pb2.LighthouseQuorumResponse.FromString(raw).quorum
            quorum = object.__new__(cls)
            quorum.__dict__.update(quorum_id=msg.quorum_id, created_unix_ms=msg.created_unix_ms,
                                   roster=Roster.of(msg.participants), _raw=raw)
            with _decoded_lock:
                while len(_DECODED) >= _DECODED_KEPT:
                    del _DECODED[next(iter(_DECODED))]
                _DECODED[raw] = quorum
        return quorum


_DECODED: dict[bytes, Quorum] = {}  # the last quorums this process decoded, by their bytes (oldest first)
_DECODED_KEPT = 4
_decoded_lock = threading.Lock()
