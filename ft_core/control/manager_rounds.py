"""The manager server's rounds: the Quorum calls of a group's ranks gathered for one lighthouse call, and the
ShouldCommit votes of one step (the group's commit barrier). Plain records; ft_core.control.manager_server
holds the locks and the logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from ft_core.control.types import Quorum
from ft_core.errors import FTError

__all__ = ["CommitRound", "QuorumRound", "RankRequest"]


@dataclass
class RankRequest:
    """One group rank's Quorum call, waiting in a round."""

    group_rank: int
    step: int
    shrink_only: bool
    commit_failures: int
    deadline: float
    commit_quorum_id: int = 0
    rebuild: bool = False  # its process group is broken and no failure is counted yet (QuorumMember.rebuild)


@dataclass
class QuorumRound:
    """Quorum calls of one group collected until every rank has arrived; then one lighthouse call."""

    requests: dict[int, RankRequest] = field(default_factory=dict)
    quorum: Quorum | None = None
    error: FTError | None = None

    @property
    def finished(self) -> bool:
        return self.quorum is not None or self.error is not None


@dataclass
class CommitRound:
    """Votes of the group's ranks for one step."""

    step: int
    votes: dict[int, tuple[bool, object]] = field(default_factory=dict)
    healed: dict[int, bool] = field(default_factory=dict)
    decision: bool | None = None
    all_healed: bool = False
    redoable: dict[int, bool] = field(default_factory=dict)  # ranks that can redo the step (ft_core.redo)
    all_redoable: bool = False
    error: FTError | None = None
