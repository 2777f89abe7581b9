"""Plain values exchanged by the control plane, and their protobuf conversions.

The pure decision functions (quorum choice, recovery plan) work on these dataclasses;
only the servers and clients touch protobuf messages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ft_core.proto import ft_pb2


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

    def to_pb(self) -> ft_pb2.QuorumMember:
        return ft_pb2.QuorumMember(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_pb(cls, msg: ft_pb2.QuorumMember) -> "QuorumMember":
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Quorum:
    """An issued quorum: its id and participants sorted by replica_id."""

    quorum_id: int
    participants: tuple[QuorumMember, ...] = field(default_factory=tuple)
    created_unix_ms: int = 0

    @property
    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.participants]

    def to_pb(self) -> ft_pb2.Quorum:
        return ft_pb2.Quorum(quorum_id=self.quorum_id, participants=[m.to_pb() for m in self.participants],
                             created_unix_ms=self.created_unix_ms)

    @classmethod
    def from_pb(cls, msg: ft_pb2.Quorum) -> "Quorum":
        return cls(quorum_id=msg.quorum_id, participants=tuple(QuorumMember.from_pb(m) for m in msg.participants),
                   created_unix_ms=msg.created_unix_ms)
