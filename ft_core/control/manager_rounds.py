"""The manager server's rounds: the Quorum calls of a group's ranks gathered for one lighthouse call, and the
ShouldCommit votes of one step (the group's commit barrier). Plain records, and how a round merges its ranks'
redo; ft_core.control.manager_server holds the locks and the logic."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ft_core.control.types import Quorum, common_redo_quorum_id
from ft_core.errors import FTError

__all__ = ["CommitRound", "QuorumRound", "RankRequest", "answer_by", "redo_quorum_id"]


def answer_by(timeout_s: float) -> float:
    """When to give up on a caller with `timeout_s` left: a quarter of it (at most 0.5 s) before its deadline, so
    it gets our explanation, not a bare DEADLINE_EXCEEDED, on a loaded machine too (0.1 s of 1 s was too little)."""
    return time.monotonic() + timeout_s - min(0.5, 0.25 * timeout_s)


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
    redo_quorum_id: int = 0  # the step attempt it redoes (QuorumMember.redo_quorum_id)
    reductions: str = ""  # digest of what its rank reduces across groups (QuorumMember.reductions; "": unknown)


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


def redo_quorum_id(requests: list[RankRequest]) -> int:
    """The group's redo_quorum_id: the attempt its ranks redo when they all redo the same one, else 0."""
    return common_redo_quorum_id(r.redo_quorum_id for r in requests)
