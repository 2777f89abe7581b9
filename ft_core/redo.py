"""Redoing a step that lost a peer, instead of throwing it away (issue 15; docs/guarantees.md).

When a replica group dies during a step (SIGKILL, a host lost), every survivor's collectives of
that step fail or are skipped (the lighthouse pushes the loss, ft_core.manager breaks the process
group). Without redo, the step does not commit anywhere. With redo, at `should_commit` each rank
tells the group's commit barrier whether it can redo (`step_rules.can_redo`); when every rank can,
the group forms the quorum again for the same step (shrink only: survivors of the old quorum),
rebuilds its process group, and, if every member is a survivor redoing the same step
(`step_rules.redo_role`), re-issues this step's recorded cross-group reductions in their original
order from the inputs it still holds; then it syncs buffers and votes as usual. One redo per step.

What can be redone (the copy policy):
- default (`FT_REDO_STEP=1`, `FT_REDO_COPY=0`), at no cost on the healthy path: a reduction that was
  never handed to a collective (the group was already broken when it was issued) still holds its
  input; one that was sent and failed is rebuilt when its integration can (`restore`: ft_core.ddp
  refills a failed chunk from the parameters' .grad, which DDP overwrites only at the end of the
  backward pass; for a group of one rank and DDP's default gradient_as_bucket_view=False). A step is
  redoable when all its reductions are of these kinds: a peer killed during the forward pass or
  mid-reduction. Not redone in this mode: a reduction that completed with the dead peer before the
  loss arrived (the loss came after the last one but before the vote), a failed one that nothing can
  rebuild (a user `manager.allreduce`, a multi-rank group's intra-group averaged bucket), a timeout.
- `FT_REDO_COPY=1`: every reduction's input is copied before it is sent, so a step that lost a peer
  mid-reduction is redoable too. Memory bound: one extra copy of everything reduced across groups
  in one step (the gradients: the model's trainable parameter bytes, per rank), in buffers reused
  every step; cost: one memcpy of the gradients per healthy step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed import ReduceOp

from ft_core import settings
from ft_core import step_rules as rules
from ft_core.errors import FTError

if TYPE_CHECKING:
    from ft_core.manager import Manager

__all__ = ["Reduction", "ReductionLog", "RedoConfig", "on_peer_lost", "pg_error", "redo_step", "resolve",
           "restore_input"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RedoConfig:
    """Whether a step that lost a peer is redone, and whether inputs are copied to make it always possible."""

    enabled: bool = True
    copy: bool = False


def resolve(redo_step: bool | None, redo_copy: bool | None) -> RedoConfig:
    """Arguments, then FT_REDO_STEP / FT_REDO_COPY (ft_core.settings)."""
    return RedoConfig(enabled=bool(settings.value("FT_REDO_STEP", redo_step)),
                      copy=bool(settings.value("FT_REDO_COPY", redo_copy)))


@dataclass
class Reduction:
    """One cross-group reduction of this step: enough to issue it again."""

    tensor: torch.Tensor
    op: ReduceOp
    saved: torch.Tensor | None = None  # a copy of the input (copy mode), restored before a redo
    intact: bool = True  # never handed to a collective or filled: `tensor` still holds the input
    writers: list[Callable[[], None]] = field(default_factory=list)  # run after a redo reduced it again
    restore: Callable[[], bool] | None = None  # puts the input back into `tensor` after a failed send

    @property
    def recoverable(self) -> bool:
        return self.intact or self.saved is not None


class ReductionLog:
    """This step's reductions and errors, as far as redo needs them; reset at every start_quorum."""

    def __init__(self, config: RedoConfig) -> None:
        self.config = config
        self.records: list[Reduction] = []
        self.redone = False
        self.other_errors = False  # an error that is not a lost peer or failed collective was recorded
        self.allow_heal = True
        self.quorum_ids: tuple[str, ...] = ()  # the replica ids of this step's quorum
        self._pool: list[torch.Tensor] = []  # copy mode: the step's input copies, reused every step

    def reset(self, allow_heal: bool) -> None:
        self.records = []
        self.redone = False
        self.other_errors = False
        self.allow_heal = allow_heal

    def record(self, tensor: torch.Tensor, op: ReduceOp, broken: bool) -> Reduction | None:
        """A reduction being issued (None when redo is off). A copy is kept only when it will be sent."""
        if not self.config.enabled:
            return None
        saved = self._copy(len(self.records), tensor) if self.config.copy and not broken else None
        rec = Reduction(tensor, op, saved)
        self.records.append(rec)
        return rec

    def _copy(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the step's index-th reduction input, in a buffer kept from step to step (a fresh
        allocation each step costs 3x the copy: page faults)."""
        pool = self._pool
        buf = pool[index] if index < len(pool) else None
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype or buf.device != tensor.device:
            buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            if index < len(pool):
                pool[index] = buf
            else:
                pool.append(buf)
        return buf.copy_(tensor.detach())

    def on_redo(self, tensor: torch.Tensor, write: Callable[[], None],
                restore: Callable[[], bool] | None = None) -> None:
        """Run `write()` after a redo reduced `tensor` again (its latest reduction this step); `restore()`
        rebuilds its input if the reduction fails (ft_core.ddp: from gradients DDP has not overwritten yet)."""
        for rec in reversed(self.records):
            if rec.tensor is tensor:
                rec.writers.append(write)
                rec.restore = restore if rec.restore is None else rec.restore
                return

    def redoable(self, errored: bool, participating: bool) -> bool:
        """This rank's `redoable` bit for the commit barrier (step_rules.can_redo)."""
        return rules.can_redo(enabled=self.config.enabled, redone=self.redone, errored=errored,
                              peer_errors_only=not self.other_errors,
                              recoverable=errored and all(r.recoverable for r in self.records),
                              participating=participating)


def on_peer_lost(m: "Manager", quorum_id: int, replica_id: str) -> None:
    """The lighthouse dropped `replica_id` from quorum `quorum_id` (dead, hung or cut off): if this step
    runs in that quorum, fail it and abort its collectives now instead of at their timeout (the vote may
    then redo it). A quorum still forming is checked when it ends (the lighthouse may have issued it
    just before the loss)."""
    fut = m._quorum_future
    if fut is None or m._closed:
        return
    if not fut.done():
        fut.add_done_callback(lambda _f: on_peer_lost(m, quorum_id, replica_id))
        return
    if m._state.quorum_id != quorum_id or m._voted:  # voted: nothing of this step is left in flight
        return
    m.report_error(FTError(f"{m._prefix()} replica group {replica_id} of quorum {quorum_id} was lost "
                           f"(the lighthouse dropped it); this step's collectives are aborted"), peer_lost=True)
    m._break_pg()


def restore_input(rec: Reduction, error: BaseException) -> None:
    """A sent reduction failed: put its input back if the integration can (not after a timeout, when the
    collective may still be writing into the tensor), so the step stays redoable without a copy."""
    restore = rec.restore
    if restore is not None and not isinstance(error, TimeoutError) and not rec.intact:
        try:
            rec.intact = bool(restore())
        except Exception as exc:  # then it cannot be redone; the step fails as without redo
            logger.warning("restoring a failed reduction's input failed, so this step cannot be redone: %s", exc)


def pg_error(pg: Any) -> Exception | None:
    """The error a process group recorded on its own (a failed collective nobody waited on), if any."""
    errored = getattr(pg, "errored", None)
    if errored is None:
        return None
    try:
        return errored()
    except Exception as exc:
        return exc


def redo_step(m: "Manager") -> bool:
    """Form the quorum again for this step and replay its reductions; True when the replay ran without
    error (the caller then votes again), False when the step fails as it would have without redo.
    Every wait is bounded: the quorum by the quorum timeout, each reduction by the collective timeout."""
    log = m._redo
    log.redone = True
    lost = m._errored
    started = time.perf_counter()
    m._clear_errors()
    logger.info("%s step lost a peer (%s); forming the quorum again to redo its %d reduction(s)", m._prefix(),
                lost, len(log.records))
    m._quorum_future = fut = m._executor.submit(_redo_quorum, m, log.quorum_ids)
    try:
        m.wait_quorum()
    except Exception as exc:
        m.report_error(exc if isinstance(exc, Exception) else FTError(str(exc)))
        _emit(m, False, "quorum failed", started)
        return False
    role, n = fut.result()
    if role is rules.RedoRole.ABANDON:
        m.report_error(FTError(f"{m._prefix()} redo abandoned: the new quorum holds a group that is not redoing "
                               f"this step (it committed it, heals, joined or gave up on it); the step fails and "
                               f"the next quorum heals as usual"))
        m._break_pg()  # its peers may be waiting on collectives we will not issue
        _emit(m, False, "abandoned", started)
        return False
    pending = []
    for rec in log.records:  # the original order: every redoing group issues the same sequence
        if rec.saved is not None:
            rec.tensor.copy_(rec.saved)
        pending.append(m._reduce(rec.tensor, rec.op))
    for fut_r in pending:
        fut_r.wait()  # never fails; bounded by the collective timeout
    if m._errored is not None:
        _emit(m, False, "replay failed", started)
        return False
    for rec in log.records:
        for write in rec.writers:
            write()
    logger.info("%s redid the step with %d participant(s) in %.3fs", m._prefix(), n, time.perf_counter() - started)
    _emit(m, True, "replayed", started)
    return True


def _redo_quorum(m: "Manager", old_ids: tuple[str, ...]) -> tuple[rules.RedoRole, int]:
    """On the quorum thread: the quorum for the same step, shrink only; rebuild the process group for it
    (also when abandoning, so the peers' rebuild does not wait for us to its timeout)."""
    result = m._quorum_call(True, m._quorum_timeout_s)
    plan = m._plan(result, m._redo.allow_heal)
    role = rules.redo_role(m._state, result, old_ids)
    logger.info("%s redo quorum %d: %s, participants %d of %s", m._prefix(), result.quorum_id, role.value,
                plan.num_participants, list(result.replica_ids))
    m._round = plan if role is rules.RedoRole.REPLAY else m._round
    m._redo.quorum_ids = tuple(result.replica_ids)
    if plan.reconfigure:
        m._configure_pg(result)  # a failure propagates to wait_quorum
    return role, plan.num_participants


def _emit(m: "Manager", replayed: bool, outcome: str, started: float, **fields: Any) -> None:
    m._emit("redo", replayed=replayed, outcome=outcome, reductions=len(m._redo.records),
            seconds=time.perf_counter() - started, **fields)
