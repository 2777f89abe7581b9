"""Redoing a step that lost a peer, instead of throwing it away (issue 15; docs/guarantees.md).

When a replica group dies during a step (SIGKILL, a host lost), every survivor's collectives of
that step fail or are skipped (the lighthouse pushes the loss, ft_core.manager breaks the process
group). Without redo, the step does not commit anywhere. With redo the survivors form the quorum
again for the same step (shrink only: survivors of the old quorum), rebuild the process group and,
if every member is a survivor redoing the same step (`step_rules.redo_role`), re-issue this step's
cross-group reductions in their original order from the inputs they still hold. One redo per step.

Where (`resolve`):
- at the wait (groups of one rank; the default): `issue` hands the loop (and DDP) a future that
  completes only once the value is final. A reduction that fails, or is skipped, because a peer was
  lost starts the redo on the Manager's quorum thread (`_redo_at_wait`); every reduction waiting on it
  is delivered after the replay, with the redone value, so what the loop reads before the vote is
  the survivors' value. should_commit() waits for it (`settle`) and votes as usual.
- at the vote (groups of several ranks, only with FT_REDO_STEP=1): each rank tells the group's commit
  barrier whether it can redo (`step_rules.can_redo`); when every rank can, the group redoes inside
  should_commit() (`redo_step`), after the loop read the failed values (docs/guarantees.md).

A peer lost after every collective the step sent had completed fails nothing: the values hold its
contribution, as its own commit did, and stand (`on_peer_lost`); only a collective issued after the loss
fails the step (`skipped`). The redo then re-issues every reduction when it can, else only those from the
first that did not complete, while the ones before stand (`_replay_start`: DDP's delivered gradients, with
the BatchNorm buffers' sync or a loss averaged after them, or with the later chunks of a peer killed
mid-reduction); the survivors agree on where their replays start before either issues one (`_agree`).

What can be redone (the copy policy):
- default (`FT_REDO_COPY=0`), at no cost on the healthy path but copies of small inputs: a reduction
  that was never handed to a collective (the group was already broken when it was issued) still holds
  its input; one that was sent and failed is rebuilt when its integration can (`restore`: ft_core.ddp
  refills a chunk not yet delivered from the parameters' .grad, which DDP overwrites only once that
  bucket's future is done; for a group of one rank and DDP's default gradient_as_bucket_view=False): a
  peer killed during the forward pass or mid-reduction. A chunk DDP already delivered stands with the dead
  peer's share while the chunks after it are redone, when every survivor completed the same ones (else the
  step fails).
  An input of at most 1 KiB that nothing rebuilds (a loss or metric the loop averages) is copied
  (`KEEP_SMALL_BYTES`). Not redone in this mode: a larger failed reduction that nothing can rebuild (a
  user `manager.allreduce` without keep_input), a timeout.
- `Manager.allreduce(..., keep_input=True)`: that reduction's input is copied before it is sent, for a
  caller that cannot rebuild it (ft_core.diloco's pseudo-gradients, ft_core.local_sgd's parameters, a
  value Lightning logs with sync_dist): one copy of that tensor, in a buffer reused every step.
- `issue(..., refill=)`: an input that depends on the quorum is made again for the new one before a replay
  sends it (the buffers' broadcast before the vote: the first participant sends its buffers, the others
  zeros; ft_core.buffers), with no copy.
- `FT_REDO_COPY=1`: every reduction's input is copied before it is sent, so those are redoable too.
  Memory bound: one extra copy of everything reduced across groups in one step (the gradients: the
  model's trainable parameter bytes, per rank), in buffers reused every step; cost: one memcpy of the
  gradients per healthy step.
"""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed import ReduceOp

from ft_core import futures as ft_futures
from ft_core import step_rules as rules
from ft_core.errors import FTError
from ft_core.redo_log import Reduction, ReductionLog, RedoConfig, WaitState, resolve

if TYPE_CHECKING:
    from ft_core.manager import Manager

__all__ = ["Reduction", "ReductionLog", "RedoConfig", "WaitState", "abandoned", "began", "issue", "on_peer_lost",
           "pg_error", "redo_step", "resolve", "restore_input", "sending", "settle", "skipped"]

logger = logging.getLogger(__name__)


# ---- redo at the wait (groups of one rank) -----------------------------------------------------------

def issue(m: "Manager", tensor: torch.Tensor, op: ReduceOp, divided_by: int | None = None, keep: bool = False,
          refill: Callable[[], None] | None = None) -> torch.futures.Future:
    """Issue one of this step's cross-group reductions (`keep`: copy its input, as copy mode does for all;
    `refill()`: makes the input again, for the quorum then current, before a redo re-sends it: an input that
    depends on the quorum, as the buffers' broadcast's). At the wait, the future returned completes once the
    value is final: if the step lost a peer, after the redo reduced it again without the peer."""
    log = m._redo
    if not log.config.at_wait:
        rec = log.record(tensor, op, m._pg_broken, divided_by, keep, refill)
        return m._reduce(tensor, op, rec, divided_by=divided_by)
    try:
        m.wait_quorum()
        ready = True
    except Exception:  # _reduce below records it; a failed quorum is no lost peer: nothing to redo
        ready = False
        log.other_errors = True
    with log.lock:
        rec = log.record(tensor, op, m._pg_broken, divided_by, keep, refill)
        assert rec is not None
        rec.out = ft_futures.device_future(ft_futures.devices_of(tensor))
        if log.state is WaitState.PENDING:  # the redo issues it after the ones before it
            return rec.out
        # The first attempt, known to the log before the lock is released: a redo that starts meanwhile
        # waits for it to settle before it replays this reduction.
        rec.first = first = ft_futures.device_future(ft_futures.devices_of(tensor))
    # Issued without the lock: the backend's completion thread takes it (_first_done of an earlier reduction),
    # and issuing can wait for that thread (Gloo does), so issuing under the lock could deadlock the step.
    # never fails, never blocks; completes `first`
    m._reduce(tensor, op, rec, wait=not ready, out=first, divided_by=divided_by)
    first.add_done_callback(lambda _f, rec=rec: _first_done(m, rec))
    return rec.out


def _eligible(m: "Manager") -> bool:
    """The step lost a peer (only that), this rank took part with its own inputs, and no redo ran yet."""
    log = m._redo
    return log.state is WaitState.IDLE and not log.redone and m._errored is not None and not log.other_errors \
        and m.is_participating()


def _first_done(m: "Manager", rec: Reduction) -> None:
    """A first attempt settled: deliver it, or start the redo and leave the delivery to it."""
    log = m._redo
    with log.lock:
        if rec.delivered or rec.replayed or log.state is WaitState.PENDING:
            return
        if _eligible(m):
            _start(m)
            return
        rec.delivered = True
    _deliver(rec)


def _deliver(rec: Reduction) -> None:
    """Complete what the loop waits on; CUDA: ordered after the collective and its division (a replay's
    were waited on by the thread that delivers)."""
    assert rec.out is not None
    if rec.first is not None and not rec.replayed:
        rec.first.wait()  # done: orders the current stream after it
    ft_futures._finish(rec.out, rec.tensor)


def _start(m: "Manager") -> None:
    """Start the redo on the quorum thread (lock held); wait_quorum() and should_commit() wait for it."""
    log = m._redo
    log.state, log.redone = WaitState.PENDING, True
    try:
        job = m._executor.submit(_redo_at_wait, m)
    except RuntimeError:  # shut down: the step fails
        _fail(m, "the manager is shutting down")
        return
    m._quorum_future = job
    job.add_done_callback(lambda _j: _fail(m, "the redo did not run") if log.state is WaitState.PENDING else None)


def _fail(m: "Manager", why: str) -> None:
    """The redo cannot run or failed: every reduction still waiting gets its tensor as it is; the step
    fails as without redo."""
    log = m._redo
    with log.lock:
        if log.state is not WaitState.IDLE:
            log.state = WaitState.FAILED
        # a first attempt still in flight is delivered by its own callback (the state is no longer IDLE)
        waiting = [r for r in log.records if not r.delivered and (r.replayed or r.first is None or r.first.done())]
        for r in waiting:
            r.delivered = True
    if m._errored is None:
        m.report_error(FTError(f"{m._prefix()} redo of the step failed ({why}); the step fails"))
    with m._error_lock:  # abort also a group the redo rebuilt: its peers may wait on collectives we skip
        m._pg_broken = False
    m._break_pg()  # and skip the step's remaining collectives
    for r in waiting:
        _deliver(r)
    logger.info("%s redo at the wait failed: %s", m._prefix(), why)


def _redo_at_wait(m: "Manager") -> None:
    """On the quorum thread: the redo; whatever happens, every reduction is delivered and nothing raises
    into wait_quorum()."""
    try:
        _replay_at_wait(m)
    except Exception as exc:  # a writer, a restore, a bug: the step fails, the loop goes on
        m.report_error(exc)
        _fail(m, f"{type(exc).__name__}: {exc}")


SLOW_WAIT_S = 2.0  # a redo's wait on a collective longer than this is logged: an abort should end it at once


def _wait_noting(m: "Manager", fut: torch.futures.Future, what: str) -> None:
    """fut.wait(), with a warning naming `what` when it has not settled after SLOW_WAIT_S: the wait then lasts
    up to the collective timeout, and the log says where a stalled redo was."""
    if not fut.done():
        settled = threading.Event()
        fut.add_done_callback(lambda _: settled.set())
        if not settled.wait(SLOW_WAIT_S):
            logger.warning("%s redo at the wait: %s has not settled after %.0f s; waiting for it up to the "
                           "collective timeout", m._prefix(), what, SLOW_WAIT_S)
    fut.wait()


def _replay_at_wait(m: "Manager") -> None:
    """Wait for the step's first attempts to settle, form the quorum again for the same step, rebuild
    the process group, agree with the other survivors where the replay starts (`_replay_start`), re-issue
    the reductions from there in their original order, then deliver them."""
    log = m._redo
    started = time.perf_counter()
    with log.lock:
        firsts = [(i, r.first) for i, r in enumerate(log.records) if r.first is not None]
    for i, first in firsts:  # settled futures never fail; the group was aborted, which fails them at once
        _wait_noting(m, first, f"the first attempt of reduction {i}")
    with log.lock:
        start = _replay_start(log)
    enough = rules.survivors_can_commit(log.quorum_ids, log.lost, m.config.min_replica_size)
    if log.other_errors or start is None or not enough:
        why = "another error than the lost peer" if log.other_errors else "too few survivors to commit it" \
            if not enough else _gone(log.records)
        _emit(m, False, "not redoable", started)
        _fail(m, why)
        return
    logger.info("%s a reduction lost a peer (%s); forming the quorum again to redo the step's %d reduction(s)",
                m._prefix(), m._errored, len(log.records))
    try:
        role, n = _redo_quorum(m, log.quorum_ids)
    except Exception as exc:
        m.report_error(exc)
        _emit(m, False, "quorum failed", started)
        _fail(m, f"quorum: {exc}")
        return
    if role is rules.RedoRole.ABANDON:
        m.report_error(FTError(f"{m._prefix()} redo abandoned: the new quorum holds a group that is not redoing "
                               f"this step (it committed it, heals, joined or gave up on it); the step fails and "
                               f"the next quorum heals as usual"))
        _emit(m, False, "abandoned", started)
        _fail(m, "abandoned")
        return
    m._clear_errors()
    if not _agree(m, start, log.records[0].tensor.device):
        _emit(m, False, "survivors disagree", started)
        _fail(m, f"the survivors cannot replay the same reductions (this one from its reduction {start})")
        return
    pending, done = [], start
    while True:  # in the original order; reductions issued meanwhile join the end
        with log.lock:
            if done == len(log.records):
                log.state = WaitState.REPLAYED
                replayed = log.records[start:]
                break
            rec = log.records[done]
            rec.replayed = True
        done += 1
        _input_again(rec)
        pending.append(m._reduce(rec.tensor, rec.op, wait=False, divided_by=rec.divided_by))
    for i, fut in enumerate(pending):  # never fails; bounded by the collective timeout
        _wait_noting(m, fut, f"replayed reduction {start + i}")
    if m._errored is not None:
        _emit(m, False, "replay failed", started)
        _fail(m, f"replay: {m._errored}")
        return
    for rec in replayed:
        for write in rec.writers:
            write()
    logger.info("%s redid the step at the wait with %d participant(s) in %.3fs (%d reduction(s) kept with the "
                "lost group)", m._prefix(), n, time.perf_counter() - started, start)
    _emit(m, True, "replayed", started, kept=start)
    with log.lock:
        waiting = [r for r in log.records if not r.delivered]  # a kept one too, if it completed meanwhile
        for r in waiting:
            r.delivered = True
    for r in waiting:
        _deliver(r)


def _replay_start(log: ReductionLog) -> int | None:
    """The first reduction this survivor's replay re-issues (first attempts settled; lock held), None if it
    cannot redo the step. 0, every reduction (inputs rebuilt where their integration can, a completed one
    too: the sampler's votes, a DDP chunk not yet delivered), as long as it can. Otherwise the first one that
    did not complete: those before hold the lost group's contribution and stand. If the loss reached this
    survivor after every reduction it had sent completed (`log.kept`), that is the first one issued after the
    loss, and they stand as they would with nothing issued after it (`on_peer_lost`); DDP's delivered
    gradients are such. If the loss came mid-reduction, the first one that failed, and nothing before it
    may be one its integration rebuilds (the sampler's votes: they would count the dead group's batch as
    trained while its gradients stood in part). A completed input is rebuilt last first, so the first that
    cannot be leaves the ones before it as they completed."""
    records = log.records
    done = [r.completed for r in records]
    split = done.index(False) if False in done else 0
    if any(done[split:]):  # a completed one after a failed one: the values do not split there
        split = 0
    if not all(_rebuild(records[split:])):  # replayed in any case
        return None
    rebuilt = False
    for i in reversed(range(split)):
        rec = records[i]
        if rec.recoverable:
            continue
        if rec.restore is not None:
            _restore(rec)
        if rec.recoverable:
            rebuilt = True
        elif rebuilt or (not log.kept and any(_rebuild([r for r in records[:i] if r.restore is not None]))):
            return None  # a rebuilt input cannot stand; mid-reduction, neither can one its integration rebuilds
        else:
            return split
    return 0


def _gone(records: list[Reduction]) -> str:
    """Why a replay cannot run: the first reduction whose input is gone, and the fix."""
    i, rec = next(((i, r) for i, r in enumerate(records) if not r.recoverable), (None, None))
    what = "a reduction's input" if rec is None else \
        f"the input of reduction {i} of this step ({rec.tensor.numel()} {rec.tensor.dtype}, {rec.op})"
    return f"{what} is gone (sent, and nothing kept or rebuilt it; pass keep_input=True to that Manager.allreduce, " \
           f"or FT_REDO_COPY=1 keeps a copy of every one)"


def _rebuild(records: list[Reduction]) -> list[bool]:
    """Each of `records` made redoable where its integration can (`restore`); whether each is now."""
    for rec in records:
        if not rec.recoverable and rec.restore is not None:
            _restore(rec)
    return [rec.recoverable for rec in records]


def _agree(m: "Manager", start: int, device: torch.device) -> bool:
    """Every survivor replays from the same reduction (one small reduction on the rebuilt group, before the
    replay): else their collectives would pair different tensors."""
    ends = torch.tensor([start, -start], dtype=torch.int64, device=device)
    m._reduce(ends, ReduceOp.MIN, wait=False).wait()  # never fails; bounded by the collective timeout
    return m._errored is None and int(ends[0]) == -int(ends[1])


def _input_again(rec: Reduction) -> None:
    """Before a replay re-sends `rec`: its input made again for the new quorum, or put back from its copy (an
    intact or restored input is there already)."""
    if rec.refill is not None:
        rec.refill()
    elif rec.saved is not None:
        rec.tensor.copy_(rec.saved)


def _restore(rec: Reduction) -> None:
    try:
        rec.intact = bool(rec.restore())  # type: ignore[misc]
    except Exception as exc:  # then it cannot be redone; the step fails as without redo
        logger.warning("rebuilding a reduction's input failed, so this step cannot be redone: %s", exc)


def settle(m: "Manager", timeout_s: float) -> None:
    """Before the vote: every reduction of this step delivered (a redo at the wait done), bounded; the
    vote then sees the redo's outcome. Raises what wait_quorum() raises."""
    m.wait_quorum()
    log = m._redo
    if not log.config.at_wait:
        return
    try:
        for rec in list(log.records):
            if rec.out is not None and not rec.out.done():
                ft_futures.future_wait(rec.out, timeout_s, what=f"{m._prefix()} reduction (and its redo)")
    except FTError as exc:
        m.report_error(exc)
    m.wait_quorum()


def on_peer_lost(m: "Manager", quorum_id: int, replica_id: str) -> None:
    """The lighthouse dropped `replica_id` from quorum `quorum_id` (dead, hung or cut off): if this step
    runs in that quorum, fail it and abort its collectives now instead of at their timeout (the vote may
    then redo it). A quorum still forming is checked when it ends (the lighthouse may have issued it
    just before the loss); a heal or a process group configure in that quorum, which the quorum thread may
    be waiting on, ends now."""
    fut = m._quorum_future
    if fut is None or m._closed:
        return
    configuring = not fut.done()
    # the quorum still running, else a heal fetched beside the step (Manager._send_or_fetch) the vote waits for
    pending = fut if configuring else (m._beside if m._healing else None)
    if pending is not None and not pending.done():
        m._heal_sources.lost(quorum_id, replica_id)  # ft_core.healing: else it waits for the heal timeout
        reason = None
        if configuring:
            # A process group configure for that quorum waits for the lost member at its rendezvous: end it now
            # (else the quorum thread, and the next quorum, wait for the collective timeout).
            reason = (f"replica group {replica_id} of quorum {quorum_id} was lost while configuring (the lighthouse "
                      "dropped it): this step's process group is abandoned, and rebuilt at the next quorum")
            m._pg.cancel_configure(quorum_id, reason)

        def settled(_f: Any) -> None:
            m._heal_sources.forget(quorum_id, replica_id)
            if reason is not None:
                m._pg.forget_cancel(quorum_id, reason)
            on_peer_lost(m, quorum_id, replica_id)

        pending.add_done_callback(settled)
        return
    if m._state.quorum_id != quorum_id or m._voted:  # voted: nothing of this step is left in flight
        return
    log = m._redo
    log.lost.add(replica_id)
    if _complete_without(m):
        # Every value the step reduced holds the lost group's contribution, as in its own commit: they stand,
        # and the step commits unless a collective still to come fails (the group is broken now, so one
        # issued later fails at once, and one sent meanwhile is aborted; ft_core.redo may then redo it).
        log.kept = True
        logger.info("%s replica group %s of quorum %d was lost after this step's %d collective(s) completed: "
                    "their values hold its contribution, so the step can still commit", m._prefix(), replica_id,
                    quorum_id, len(log.sent))
    else:
        m.report_error(FTError(f"{m._prefix()} replica group {replica_id} of quorum {quorum_id} was lost "
                               f"(the lighthouse dropped it); this step's collectives are aborted"), peer_lost=True)
    _watch_abort(m, [f for f in log.sent if not f.done()])
    m._break_pg()


def began(m: "Manager") -> None:
    """A training forward of a model with the comm hook ran (ft_core.ddp): this step began, so one that then ends
    with neither a reduction nor a vote (a skipped backward, e.g. a NaN loss) is abandoned at the next start_quorum,
    and its peers, which sent their gradients, go on without this group at once instead of at their timeout."""
    m._redo.forwarded = True


def abandoned(m: "Manager") -> None:
    """The last step reduced, or ran a training forward of a model with the comm hook, then ended without a vote
    (the loop skipped should_commit(): a skipped optimizer step, or a skipped backward too). Its peers may be
    waiting on a collective it will never issue (its gradients, the buffers' sync before the vote), or would pair
    one with its next step's. Tell the lighthouse first, so their redo goes on without this group (quorum
    rule 11), then break the group, so their collectives fail now instead of at their timeout: they redo the step
    without it, and it heals from them."""
    if m._server is not None:  # group rank 0; every rank breaks its own group
        m._server.gave_up()
    m._break_pg()


def _watch_abort(m: "Manager", pending: list[torch.futures.Future]) -> None:
    """Diagnostics, armed before the abort: it ends the step's collectives at once; one still pending SLOW_WAIT_S
    later waits for its timeout (and a Gloo abort that found nothing to shut down blocks until then). Say so,
    with what the abort did and every thread's stack, so such a stall says where it is."""
    if not pending:
        return

    def check() -> None:
        still = sum(not f.done() for f in pending)
        if not still:
            return
        inner = m._pg
        while not hasattr(inner, "last_abort") and hasattr(inner, "inner"):
            inner = inner.inner
        logger.warning("%s %d collective(s) of this step still pending %.0f s after the abort (it %s); they end at "
                       "the collective timeout. Every thread's stack follows.", m._prefix(), still, SLOW_WAIT_S,
                       getattr(inner, "last_abort", "aborted a group that is not Gloo"))
        try:
            faulthandler.dump_traceback(all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr without a file descriptor (captured)
            pass

    timer = threading.Timer(SLOW_WAIT_S, check)
    timer.daemon = True
    timer.start()


def _complete_without(m: "Manager") -> bool:
    """The step has no error, no redo under way, sent collectives (none sent yet: nothing holds the lost
    group's contribution) all done and none failed, and its quorum's survivors can commit it without the
    groups lost."""
    log = m._redo
    return m._errored is None and log.state in (WaitState.IDLE, WaitState.REPLAYED) and (log.kept or (
        _recorded(m._pg) is None and bool(log.sent) and all(f.done() for f in log.sent))) and \
        rules.survivors_can_commit(log.quorum_ids, log.lost, m.config.min_replica_size)


def sending(m: "Manager", fut: torch.futures.Future) -> torch.futures.Future:
    """Track a collective handed to the process group (Manager._reduce), for `on_peer_lost`."""
    m._redo.sent.append(fut)
    return fut


def skipped(m: "Manager", out: torch.futures.Future | None, tensor: torch.Tensor) -> torch.futures.Future:
    """A collective not sent because the group is broken: it fails the step (the break had already
    recorded why, unless a peer was lost after the step's earlier collectives: `on_peer_lost`)."""
    if m._errored is None:
        lost = sorted(m._redo.lost)
        why = f"replica group(s) {lost} were lost" if lost else "the cross-group process group was broken"
        m.report_error(FTError(f"{m._prefix()} a collective was issued after {why}; this step fails unless it is "
                               f"redone"), peer_lost=bool(lost))
    return ft_futures.complete(out, tensor)


def restore_input(rec: Reduction, error: BaseException) -> None:
    """A sent reduction failed: put its input back if the integration can (not after a timeout, when the
    collective may still be writing into the tensor), so the step stays redoable without a copy."""
    rec.failed = True
    restore = rec.restore
    if restore is not None and not isinstance(error, TimeoutError) and not rec.intact:
        try:
            rec.intact = bool(restore())
        except Exception as exc:  # then it cannot be redone; the step fails as without redo
            logger.warning("restoring a failed reduction's input failed, so this step cannot be redone: %s", exc)


def pg_error(m: "Manager") -> Exception | None:
    """The error the process group recorded on its own (a failed collective nobody waited on), if any;
    not its abort after a peer lost once the step's collectives completed (`on_peer_lost`)."""
    return None if m._redo.kept else _recorded(m._pg)


def _recorded(pg: Any) -> Exception | None:
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
        _input_again(rec)
        pending.append(m._reduce(rec.tensor, rec.op, divided_by=rec.divided_by))
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
    (also when abandoning, so the peers' rebuild does not wait for us to its timeout), and stage our state
    for the groups it says heal from us (then we abandon: else they wait for it to their heal timeout, and
    our next quorum waits for them)."""
    result = m._quorum_call(True, m._quorum_timeout_s, redo_quorum_id=m._redo.quorum_id)
    plan = m._plan(result, m._redo.allow_heal)
    role = rules.redo_role(m._state, result, old_ids, m._redo.quorum_id)
    logger.info("%s redo quorum %d: %s, participants %d of %s", m._prefix(), result.quorum_id, role.value,
                plan.num_participants, list(result.replica_ids))
    m._round = plan if role is rules.RedoRole.REPLAY else m._round
    m._redo.quorum_ids = tuple(result.replica_ids)
    if plan.reconfigure:
        m._configure_pg(result)  # a failure propagates to wait_quorum
    if plan.send_to:
        try:
            m._transport.send_checkpoint(list(plan.send_to), result.max_step, m.healing_state(), m.config.timeout)
        except Exception as exc:
            m.report_error(exc)
    return role, plan.num_participants


def _emit(m: "Manager", replayed: bool, outcome: str, started: float, kept: int = 0) -> None:
    """The redo event; `kept`: how many of the step's first reductions stood, holding the lost group's share."""
    m._emit("redo", replayed=replayed, outcome=outcome, reductions=len(m._redo.records),
            seconds=time.perf_counter() - started, kept=kept)
