"""This step's record of its cross-group reductions, as ft_core.redo needs it to redo the step without a
lost peer: where the redo runs (`RedoConfig`, `resolve`), each reduction with what it takes to issue it
again (`Reduction`), and the step's log of them (`ReductionLog`), copies of inputs included."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed import ReduceOp

from ft_core import settings
from ft_core import step_rules as rules

__all__ = ["KEEP_SMALL_BYTES", "Reduction", "ReductionLog", "RedoConfig", "WaitState", "resolve"]

# An input this small that nothing rebuilds (a loss or metric the loop averages across groups) is copied before
# it is sent in every mode, so a peer lost while it is in flight costs no step: the copy costs less than the
# future around it. DDP's chunks (rebuilt from .grad, or far larger), the sampler's votes (rebuilt) and the
# buffers' sync (made again) are not copied by this.
KEEP_SMALL_BYTES = 1024

@dataclass(frozen=True)
class RedoConfig:
    """Where a step that lost a peer is redone, and whether inputs are copied to make it always possible.
    at_wait: a group of one rank redoes at the wait of the failed reduction (the default); at_vote: a
    group of several ranks redoes at the vote (only with FT_REDO_STEP=1 set explicitly)."""

    at_wait: bool = True
    at_vote: bool = False
    copy: bool = False

    @property
    def enabled(self) -> bool:
        return self.at_wait or self.at_vote


def resolve(redo_step: bool | None, redo_copy: bool | None, group_world_size: int = 1) -> RedoConfig:
    """Arguments, then FT_REDO_STEP / FT_REDO_COPY (ft_core.settings). Unset: on for a group of one rank
    (at the wait), off for a group of several (its ranks would have to agree at the wait); 1: on for
    both (several ranks: at the vote); 0: off."""
    chosen = settings.value("FT_REDO_STEP", redo_step)
    return RedoConfig(at_wait=chosen is not False and group_world_size == 1,
                      at_vote=chosen is True and group_world_size > 1,
                      copy=bool(settings.value("FT_REDO_COPY", redo_copy)))


class WaitState(enum.Enum):
    """Where this step's redo at the wait stands (groups of one rank)."""

    IDLE = "idle"  # nothing failed yet: reductions are issued and delivered as they complete
    PENDING = "pending"  # a redo runs on the quorum thread: new reductions wait for it to issue them in order
    REPLAYED = "replayed"  # the redo issued every reduction so far; later ones are issued directly
    FAILED = "failed"  # the redo could not run or failed: the step fails as without redo


@dataclass
class Reduction:
    """One cross-group reduction of this step: enough to issue it again."""

    tensor: torch.Tensor
    op: ReduceOp
    divided_by: int | None = None  # AVG of an input already divided by this many groups (Manager.allreduce)
    saved: torch.Tensor | None = None  # a copy of the input (copy mode), restored before a redo
    intact: bool = True  # never handed to a collective or filled: `tensor` still holds the input
    writers: list[Callable[[], None]] = field(default_factory=list)  # run after a redo reduced it again
    restore: Callable[[], bool] | None = None  # puts the input back into `tensor` after a failed send
    refill: Callable[[], None] | None = None  # makes the input again for the quorum then current (issue's refill)
    out: torch.futures.Future | None = None  # at the wait: what the loop waits on, done after any redo
    first: torch.futures.Future | None = None  # at the wait: the first attempt (None: the redo issued it)
    replayed: bool = False  # at the wait: the redo issues it, and delivers `out`
    delivered: bool = False
    failed: bool = False  # its first attempt was sent and failed (restore_input)

    @property
    def completed(self) -> bool:
        """Its first attempt was sent and completed: the value holds every peer's contribution."""
        return self.first is not None and not self.intact and not self.failed

    @property
    def recoverable(self) -> bool:
        return self.intact or self.saved is not None or self.refill is not None


class ReductionLog:
    """This step's reductions and errors, as far as redo needs them; reset at every start_quorum."""

    def __init__(self, config: RedoConfig) -> None:
        self.config = config
        self.records: list[Reduction] = []
        self.redone = False
        self.other_errors = False  # an error that is not a lost peer or failed collective was recorded
        self.allow_heal = True
        self.quorum_ids: tuple[str, ...] = ()  # the replica ids of this step's quorum
        self.quorum_id = 0  # the id of this step's quorum: the attempt a redo names (QuorumMember.redo_quorum_id)
        self.lost: set[str] = set()  # replica ids the lighthouse said were lost during this step
        self.sent: list[torch.futures.Future] = []  # this step's collectives handed to the process group
        self.kept = False  # a peer was lost after every collective of the step completed: the values stand
        self.forwarded = False  # a training forward of a model with the comm hook ran (ft_core.ddp): a step began
        self.state = WaitState.IDLE
        self.lock = threading.RLock()  # at the wait: records, state and deliveries
        self._pool: list[torch.Tensor] = []  # copy mode: the step's input copies, reused every step
        self._ahead: list[tuple[torch.Tensor, Callable[[], None], Callable[[], bool] | None]] = []  # on_redo's next

    def reset(self, allow_heal: bool) -> None:
        self.records = []
        self._ahead = []
        self.redone = False
        self.other_errors = False
        self.allow_heal = allow_heal
        self.state = WaitState.IDLE
        self.lost = set()
        self.sent = []
        self.kept = self.forwarded = False
        self.quorum_ids, self.quorum_id = (), 0  # until this step's quorum: no redo names an earlier attempt

    def record(self, tensor: torch.Tensor, op: ReduceOp, broken: bool, divided_by: int | None = None,
               keep: bool = False, refill: Callable[[], None] | None = None) -> Reduction | None:
        """A reduction being issued (None when redo is off). A copy is kept (copy mode; `keep`: its caller can
        rebuild the input from nothing else; or an input of at most KEEP_SMALL_BYTES that nothing rebuilds)
        only when it will be sent and cannot be made again (`refill`)."""
        if not self.config.enabled:
            return None
        ahead = [a for a in self._ahead if a[0] is tensor]  # said before it was issued (on_redo)
        restore = next((a[2] for a in ahead if a[2] is not None), None)
        small = restore is None and tensor.numel() * tensor.element_size() <= KEEP_SMALL_BYTES
        copy = (self.config.copy or keep or small) and not broken and refill is None
        rec = Reduction(tensor, op, divided_by, self._copy(len(self.records), tensor) if copy else None,
                        restore=restore, refill=refill)
        for a in ahead:
            self._ahead.remove(a)
            rec.writers.append(a[1])
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
                restore: Callable[[], bool] | None = None, next_reduction: bool = False) -> None:
        """Run `write()` after a redo reduced `tensor` again (its latest reduction this step, or with
        `next_reduction` the one `record` sees next); `restore()` rebuilds its input if the reduction fails
        (ft_core.ddp: from gradients DDP has not overwritten yet). Said before the reduction is issued, it is
        known when a failure right after issuing starts the redo; said after, the redo may have looked."""
        if next_reduction:
            if self.config.enabled:
                with self.lock:
                    self._ahead.append((tensor, write, restore))
            return
        for rec in reversed(self.records):
            if rec.tensor is tensor:
                rec.writers.append(write)
                rec.restore = restore if rec.restore is None else rec.restore
                return

    def redoable(self, errored: bool, participating: bool) -> bool:
        """This rank's `redoable` bit for the commit barrier (step_rules.can_redo): only for a group that
        redoes at the vote (several ranks, FT_REDO_STEP=1); a group of one rank redoes at the wait."""
        return rules.can_redo(enabled=self.config.at_vote, redone=self.redone, errored=errored,
                              peer_errors_only=not self.other_errors,
                              recoverable=errored and all(r.recoverable for r in self.records),
                              participating=participating)
