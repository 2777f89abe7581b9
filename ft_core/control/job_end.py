"""The end of a job: which replica groups finished training, and the group that comes back too late.

A group that ends its training normally (`Manager.finish()`) tells the lighthouse its final step.
From then on a group that joins a quorum behind that step, with no live group at it to heal from,
would retrain the finished job alone: the lighthouse refuses it with `late_group_problem`'s message
(gRPC OUT_OF_RANGE), which the clients raise as `JobFinishedError`. Pure functions; the lighthouse
(ft_core.control.lighthouse_state) keeps the record, in memory only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ft_core.control.quorum import replica_group
from ft_core.control.types import QuorumMember
from ft_core.errors import JobFinishedError

FINISHED_CODE = "OUT_OF_RANGE"  # the gRPC status a refused late group gets (nothing else uses it)
_MESSAGE = re.compile(r"the job finished at step (?P<final>\d+) \(groups? (?P<groups>[^)]*)\) while this group "
                      r"was at step (?P<step>\d+)")


@dataclass(frozen=True)
class FinishedGroup:
    """A replica group that ended its training normally: its final step and the last quorum it was in."""

    replica_id: str
    step: int
    quorum_id: int
    at_unix_ms: int


def late_group_problem(member: QuorumMember, finished: Mapping[str, FinishedGroup],
                       live_steps: Mapping[str, int]) -> str | None:
    """Why `member` must not take part (the job finished ahead of it), or None when it may.

    Refused when the job finished at step N, the member is behind N, it is not one step late in the
    finished groups' last quorum (a restarted or long-gone group, whose last quorum is older than theirs;
    or a healer of that quorum whose heal failed: that quorum's participants were at N - 1, it is further
    behind), and no other live group (`live_steps`: replica id -> step, finished ones excluded) is at N to
    heal from. A group at N (resumed from the final checkpoint) or a participant of the last quorum whose
    attempt failed (at N - 1) goes on.
    """
    if not finished:
        return None
    final = max(f.step for f in finished.values())
    if member.step >= final:
        return None
    last = [f for f in finished.values() if f.step == final]
    if member.last_quorum_id >= min(f.quorum_id for f in last) > 0 and member.step >= final - 1:
        return None  # a participant of the finished groups' last quorum whose attempt failed: one step late
    mine = replica_group(member.replica_id)
    if any(step >= final for rid, step in live_steps.items() if replica_group(rid) != mine):
        return None  # a live source at the end: the member heals from it
    return finished_message(member.replica_id, final, sorted(replica_group(f.replica_id) for f in last), member.step)


def finished_message(replica_id: str, final_step: int, groups: list[str], step: int) -> str:
    """The refusal a late group gets (parsed back by `job_finished_error`)."""
    noun = "group" if len(groups) == 1 else "groups"
    return (f"replica group {replica_group(replica_id)}: the job finished at step {final_step} ({noun} "
            f"{', '.join(groups)}) while this group was at step {step}; it is not retrained alone. Resume from the "
            f"job's last durable checkpoint (load it so the Manager is at step {final_step}, e.g. the checkpoint "
            f"the finished groups saved at their end) or start a new job (a new FT job id / lighthouse)")


def job_finished_error(message: str, *, peer: str = "", call: str = "") -> JobFinishedError:
    """The typed error for a refusal received from the lighthouse (or relayed by a manager server)."""
    match = _MESSAGE.search(message)
    if match is None:
        return JobFinishedError(message, peer=peer, call=call)
    groups = tuple(g.strip() for g in match.group("groups").split(",") if g.strip())
    return JobFinishedError(message, peer=peer, call=call, finished_step=int(match.group("final")),
                            step=int(match.group("step")), finished_groups=groups)
