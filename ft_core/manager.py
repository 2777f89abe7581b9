"""The Manager: the per-step protocol every integration uses (DESIGN.md section 7).

    manager.start_quorum()      # async: the quorum overlaps the forward pass
    loss.backward()             # gradients go through manager.allreduce (ft_core.ddp does it)
    if manager.should_commit(): # group-wide vote; a pending healed state is loaded first
        optimizer.step()

Errors inside a step are recorded (`report_error`), never raised into the loop; that step then
does not commit. A group behind the quorum's max_step heals from a live peer: in async mode it
fetches during the step, contributes zeros and loads the state in should_commit, so it applies
the same averaged gradient and ends the step bit-identical to the others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft_core import ddp, freeze_startup_objects, metrics, net, redo
from ft_core import futures as ft_futures
from ft_core import step_rules as rules
from ft_core.checkpointing import HTTPTransport
from ft_core.buffers import broadcast_by_sum
from ft_core.healing import FetchedHeal, HealSources, apply_heal, await_beside, beside_the_step
from ft_core.errors import CommitError, ConfigError, FTError, FTTimeoutError
from ft_core.managed_work import ManagedWork
from ft_core.manager_wiring import wire_group
from ft_core.manager_config import ManagerConfig, WorldSizeMode, resolve_config
from ft_core.control.recovery import QuorumResult
from ft_core.step_rules import participation

freeze_startup_objects()  # torch and the rest of ft_core are imported now (ft_core/__init__.py)

__all__ = ["Manager", "ManagerConfig", "WorldSizeMode", "participation", "resolve_config"]

logger = logging.getLogger(__name__)
events = logging.getLogger("ft_core.events")

_MARGIN_S = 5.0  # on top of a server-side deadline, for the hop back
_SHUTDOWN_JOIN_S = 5.0  # longest shutdown() waits for one thread it started


class Manager:
    """Per-step fault tolerance for one rank of one replica group; see the module docstring."""

    def __init__(self, pg: Any, load_state_dict: Callable[[Any], None] | None = None,
                 state_dict: Callable[[], Any] | None = None, min_replica_size: int | None = None,
                 use_async_quorum: bool | None = None, timeout: timedelta | float | None = None,
                 quorum_timeout: timedelta | float | None = None, connect_timeout: timedelta | float | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 world_size_mode: WorldSizeMode | str | None = None, store_addr: str | None = None,
                 store_port: int | None = None, lighthouse_addr: str | list[str] | None = None,
                 replica_id: str | None = None, port: int | None = None, hostname: str | None = None,
                 heartbeat_interval: timedelta = timedelta(milliseconds=100), checkpoint_transport: Any = None,
                 init_sync: bool = True, max_retries: int | None = None, quorum_retries: int | None = None,
                 token: str | None = None, redo_step: bool | None = None, redo_copy: bool | None = None) -> None:
        cfg = resolve_config(replica_id=replica_id, rank=rank, world_size=world_size,
                             min_replica_size=min_replica_size, use_async_quorum=use_async_quorum, timeout=timeout,
                             quorum_timeout=quorum_timeout, connect_timeout=connect_timeout,
                             world_size_mode=world_size_mode, lighthouse_addr=lighthouse_addr, port=port,
                             hostname=hostname, heartbeat_interval=heartbeat_interval, init_sync=init_sync,
                             max_retries=max_retries, quorum_retries=quorum_retries, token=token)
        self._pg = pg
        self._state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self._state_lock = threading.Lock()
        if (load_state_dict is None) != (state_dict is None):
            raise ConfigError("pass both load_state_dict and state_dict, or neither (then use register_state_dict_fn)")
        if load_state_dict is not None and state_dict is not None:
            self._state_fns["default"] = (load_state_dict, state_dict)

        self._state = rules.StepState()
        self._errored: Exception | None = None
        self._error_lock = threading.Lock()
        self._pg_broken = self._healing = self._closed = False
        self._heal: FetchedHeal | None = None  # this step's fetched state: loaded at commit, adopted if committed
        self._beside: concurrent.futures.Future | None = None  # this step's staging or heal, run beside it
        self._beside_token = object()
        self._voted = False  # this step's should_commit() has run: no reduction may follow
        self._group_healed = False  # every rank of the group loaded this step's heal (from the vote)
        self._reductions = 0  # cross-group reductions issued this step (fail-closed check)
        self._redo = redo.ReductionLog(redo.resolve(redo_step, redo_copy, cfg.group_world_size))  # ft_core.redo
        self._group_redoable = False  # every rank of the group can redo this step (from the vote)
        self._buffer_sources: dict[int, Callable[[], list[torch.Tensor]]] = {}
        self._round: rules.QuorumActions | None = None  # this step's role, from the quorum
        self._quorum_future: concurrent.futures.Future | None = None
        self._quorum_timeout_s = cfg.quorum_timeout.total_seconds()
        self._server: Any = None
        self._client: Any = None
        self._store: Any = None
        self._heal_sources = HealSources(cfg.connect_timeout, cfg.token)

        self._setup_store_and_server(cfg, store_addr, store_port)
        self.config = cfg = dataclasses.replace(cfg, replica_id=self._replica_id)
        self._executor = concurrent.futures.ThreadPoolExecutor(  # on this thread's CUDA device (NCCL binds it)
            max_workers=1, thread_name_prefix=f"ft-quorum[{cfg.replica_id}/{cfg.group_rank}]",
            initializer=ft_futures.current_device_initializer())
        if checkpoint_transport is None:
            checkpoint_transport = HTTPTransport(timeout=cfg.timeout, num_chunks=0, token=cfg.token,
                                                 hostname=cfg.hostname, bind=net.format_host_port(cfg.bind_host, 0))
        self._transport = checkpoint_transport
        if cfg.group_rank == 0:  # per-group Prometheus metrics when FT_METRICS_PORT is set (one server a process)
            metrics.start_from_settings(cfg.bind_host)
        logger.info("%s manager started: %s", self._prefix(), cfg)

    # ----------------------------------------------------------------- setup

    def _setup_store_and_server(self, cfg: ManagerConfig, store_addr: str | None, store_port: int | None) -> None:
        """The group's stores and this rank's manager server (rank 0) or client (ft_core.manager_wiring)."""
        wired = wire_group(cfg, store_addr, store_port)
        self._store, self._rendezvous_store, self._store_address = wired.store, wired.rendezvous_store, wired.store_address
        self._replica_id, self._server, self._client = wired.replica_id, wired.server, wired.client
        # the lighthouse's PeerLost notices fail this quorum's step at once; rank 0's server forwards them to the others
        (self._server or self._client).add_failure_listener(functools.partial(redo.on_peer_lost, self))  # ft_core.redo

    # ----------------------------------------------------------------- state registry

    def register_state_dict_fn(self, key: str, load_fn: Callable[[Any], None], save_fn: Callable[[], Any]) -> None:
        """Register state sent to a healing peer: save_fn() -> nested tensors/numbers/str; load_fn(that)."""
        if key in self._state_fns:
            raise ConfigError(f"state dict key {key!r} is already registered; keys must be unique")
        self._state_fns[key] = (load_fn, save_fn)

    def disallow_state_dict_read(self) -> None:
        """Block sending state to healers (e.g. while parameters are being updated in place)."""
        self._state_lock.acquire()

    def allow_state_dict_read(self) -> None:
        self._state_lock.release()

    def healing_state(self) -> dict[str, Any]:
        """Everything a healing group receives: {"user": registered state dicts, "ft": progress}."""
        with self._state_lock:
            user = {key: save() for key, (_, save) in self._state_fns.items()}
            return {"user": user, "ft": {**self.state_dict(), "commit_quorum_id": self._state.commit_quorum_id}}

    def state_dict(self) -> dict[str, int]:
        """The Manager's own progress; checkpoint it with the model."""
        return {"step": self._state.step, "batches_committed": self._state.batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._state = rules.restore(self._state, state_dict)

    # ----------------------------------------------------------------- errors

    def report_error(self, e: Exception, peer_lost: bool = False) -> None:
        """Record an error for this step: the step will not commit (unless `peer_lost` and the step is
        redone without the peer, ft_core.redo). Never raises."""
        self._redo.other_errors |= not peer_lost
        with self._error_lock:
            first = self._errored is None
            if first:
                self._errored = e
        if first:
            logger.info("%s error recorded, this step will not commit: %s", self._prefix(), e)
            self._emit("error", message=f"{type(e).__name__}: {e}")

    def errored(self) -> Exception | None:
        return self._errored

    def wrap_future(self, fut: Any, default: Any, timeout: timedelta | float | None = None) -> torch.futures.Future:
        """A future that never fails: fut's value, or `default` after recording the error or timeout."""
        return ft_futures.settled(fut, default, self.report_error,
                                  timeout if timeout is not None else self.config.timeout,
                                  what=f"{self._prefix()} wrapped future")

    def _on_collective_error(self, e: BaseException) -> None:
        self.report_error(e if isinstance(e, Exception) else FTError(str(e)), peer_lost=not isinstance(e, TimeoutError))
        self._break_pg()

    def _break_pg(self) -> None:
        """Skip this step's remaining collectives, rebuild the group at the next quorum, and abort it
        now: peers blocked on a collective with us fail at once instead of at their timeout."""
        with self._error_lock:
            if self._pg_broken:
                return
            self._pg_broken = True
            self._state = rules.on_pg_broken(self._state)
        if not self._closed:
            try:
                self._executor.submit(self._abort_pg)
            except RuntimeError:  # executor already shut down
                pass

    def _clear_errors(self) -> None:  # a new step, or a redo of this one
        with self._error_lock:
            self._errored, self._pg_broken = None, False

    def _abort_pg(self) -> None:
        try:
            self._pg.abort()
        except Exception as exc:  # best effort: the next configure rebuilds it anyway
            logger.info("%s process group abort failed: %s", self._prefix(), exc)

    # ----------------------------------------------------------------- quorum

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: timedelta | float | None = None) -> None:
        """Start this step's quorum (returns at once in async mode; sync mode also heals now)."""
        if self._quorum_future is not None:
            previous = self._finished_quorum(self._quorum_future)
            if previous is not None:  # normally already raised by should_commit(); a new step starts clean
                logger.info("%s previous quorum had failed: %s", self._prefix(), previous)
            if not self._voted and (self._reductions or self._redo.forwarded):  # that step ended unvoted
                redo.abandoned(self)
        self._clear_errors()
        self._healing = False
        self._heal = None  # a heal not applied by the last step is fetched again
        self._beside, self._beside_token = None, object()  # a step without a vote: its job's outcome is not ours
        self._voted = False
        self._reductions = 0
        self._redo.reset(allow_heal)
        self._quorum_timeout_s = quorum_timeout = ft_futures._seconds(timeout) if timeout is not None else \
            self.config.quorum_timeout.total_seconds()
        self._quorum_future = self._executor.submit(self._async_quorum, allow_heal, shrink_only, quorum_timeout)
        if not self.config.use_async_quorum:
            self.wait_quorum()
            self._apply_pending_state_dict()

    def wait_quorum(self) -> None:
        """Block until this step's quorum is done; raises if the quorum failed. A healing transfer and the
        staging of a checkpoint for healers are in it too, unless they run beside the step (_beside)."""
        fut = self._quorum_future
        if fut is None:
            raise FTError(f"{self._prefix()} wait_quorum before start_quorum: call start_quorum() first "
                          f"(OptimizerWrapper.zero_grad does)")
        error = self._finished_quorum(fut)
        if error is not None:
            raise error  # the quorum's own error (e.g. the lighthouse's FTTimeoutError), unchanged

    def _finished_quorum(self, fut: concurrent.futures.Future) -> BaseException | None:
        """Wait (bounded) for a quorum thread's run to end; its error, or None."""
        if not fut.done():  # the usual case is done: every reduction of the step asks, long after the quorum
            bound = self._quorum_timeout_s + 3 * self.config.timeout.total_seconds() + _MARGIN_S
            if not concurrent.futures.wait([fut], timeout=bound)[0]:
                raise FTTimeoutError(f"{self._prefix()} quorum (and healing) did not finish within {bound:.3g}s")
        return fut.exception()

    def _quorum_call(self, shrink_only: bool, timeout_s: float, redo_quorum_id: int = 0) -> QuorumResult:
        """This rank's quorum request; a redo names the attempt it redoes (QuorumMember.redo_quorum_id)."""
        cfg = self.config  # rebuild: a broken process group gets a fresh quorum id (QuorumMember.rebuild)
        args = dict(group_rank=cfg.group_rank, step=self._state.step, checkpoint_metadata=self._transport.metadata(),
                    shrink_only=shrink_only, timeout=timedelta(seconds=timeout_s), init_sync=cfg.init_sync,
                    commit_failures=self._state.commit_failures, commit_quorum_id=self._state.commit_quorum_id,
                    rebuild=self._state.quorum_id < 0, redo_quorum_id=redo_quorum_id)
        if self._server is not None:
            return self._server.quorum_local(**args, reductions=ddp.reductions_digest(self))
        return self._client.quorum(**args)

    def _async_quorum(self, allow_heal: bool, shrink_only: bool, timeout_s: float) -> None:
        cfg = self.config
        started = time.perf_counter()
        result = self._quorum_call(shrink_only, timeout_s)  # errors propagate to wait_quorum
        quorum_s = time.perf_counter() - started
        plan = self._round = self._plan(result, allow_heal)
        world = plan.num_participants
        self._redo.quorum_ids, self._redo.quorum_id = tuple(result.replica_ids), result.quorum_id  # the attempt
        notable = bool(plan.reconfigure or plan.heal or plan.send_to)  # else routine: logged at DEBUG only
        if notable:
            logger.info("%s quorum %d: replica rank %d/%d, participants %d, max_step %d, heal=%s, sends to %s",
                        self._prefix(), result.quorum_id, result.replica_rank, result.replica_world_size, world,
                        result.max_step, plan.heal, list(plan.send_to))
        self._emit("quorum", routine=not notable, quorum_id=result.quorum_id, replica_rank=result.replica_rank,
                   replica_world_size=result.replica_world_size, num_participants=world, max_step=result.max_step,
                   heal=plan.heal, seconds=quorum_s, changed=plan.reconfigure, replica_ids=list(result.replica_ids))
        if plan.reconfigure:
            try:
                self._configure_pg(result)
            except Exception as exc:
                self.report_error(exc)
                return
        self._healing = plan.heal
        if (plan.send_to or plan.heal) and cfg.use_async_quorum and beside_the_step(self._transport):
            try:  # next on this thread; the step's collectives do not wait for it, its vote does (_await_beside)
                self._beside = self._executor.submit(self._beside_job, plan, result, self._beside_token)
            except RuntimeError as exc:  # shut down
                self.report_error(FTError(f"{self._prefix()} checkpoint transfer not started: {exc}"))
            return
        try:
            self._heal = self._send_or_fetch(plan, result)
        except Exception as exc:
            self.report_error(exc)

    def _send_or_fetch(self, plan: rules.QuorumActions, result: QuorumResult) -> FetchedHeal | None:
        """Stage this step's state for the groups that heal from this one, or fetch the state to heal from."""
        cfg = self.config
        if plan.send_to:
            self._transport.send_checkpoint(list(plan.send_to), result.max_step, self.healing_state(), cfg.timeout)
        return self._heal_sources.fetch(result, cfg.group_rank, self._transport, cfg.timeout) if plan.heal else None

    def _beside_job(self, plan: rules.QuorumActions, result: QuorumResult, token: object) -> FetchedHeal | None:
        try:
            return self._send_or_fetch(plan, result)
        except Exception as exc:
            if token is self._beside_token:  # still this step's (the next step's start_quorum renews the token)
                self.report_error(exc)  # now, as when it ran in the quorum: a source's failure fails every group's step
            raise

    def _await_beside(self) -> None:
        """Before the vote: the staging or heal that ran beside the step; its failure fails the step."""
        fut = self._beside  # kept until the next step: a PeerLost notice releases a heal the vote waits for
        if fut is not None:
            try:
                self._heal = await_beside(fut, 3 * self.config.timeout.total_seconds() + _MARGIN_S, self._prefix())
            except Exception as exc:
                self.report_error(exc)

    def _plan(self, result: QuorumResult, allow_heal: bool) -> rules.QuorumActions:
        cfg = self.config
        return rules.on_quorum(self._state, result, allow_heal=allow_heal, use_async_quorum=cfg.use_async_quorum,
                               init_sync=cfg.init_sync, mode=cfg.world_size_mode, min_replica_size=cfg.min_replica_size)

    def _configure_pg(self, result: QuorumResult) -> None:
        """Rebuild the cross-group process group for `result`'s quorum; a failure breaks it and propagates."""
        cfg = self.config
        store = f"{result.store_address}/ft/{result.quorum_id}/{cfg.group_rank}"
        try:
            self._pg.configure(store, cfg.replica_id, result.replica_rank, result.replica_world_size,
                               quorum_id=result.quorum_id, group_rank=cfg.group_rank,
                               group_world_size=cfg.group_world_size)
        except Exception:
            self._pg_broken = True
            self._state = rules.on_configure_failed(self._state)
            raise
        self._state = rules.on_configured(self._state, result.quorum_id)

    def _apply_pending_state_dict(self) -> None:
        if self._heal is not None and not self._heal.loaded:
            apply_heal(self._heal, self._state_fns, self.report_error, self._emit, self._prefix())

    # ----------------------------------------------------------------- collectives

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG, should_quantize: bool = False, *,
                  divided_by: int | None = None, keep_input: bool = False) -> ManagedWork:
        """In-place allreduce across replica groups; AVG divides by num_participants. Never raises for
        communication errors (they are recorded and the step will not commit); raises ConfigError for
        an op without an identity and for an allreduce after this step's should_commit().
        `divided_by` (AVG only): `tensor` already holds this group's contribution divided by that many
        groups (ft_core.ddp.backward_scale), so the average only sums, rescaling if a redo changed the count.
        `keep_input`: copy the input first, so a peer lost mid-reduction cannot cost the step (ft_core.redo).
        `should_quantize` (torchft's) is accepted and ignored with a warning: there is no quantized path."""
        if should_quantize:
            logger.warning("should_quantize=True is ignored: the allreduce is sent in full precision")
        rules.check_reduce_op(reduce_op, tensor.dtype, divided_by)
        fut = self._allreduce_future(tensor, reduce_op, divided_by=divided_by, keep_input=keep_input)
        return ManagedWork(self, fut, tensor)

    def _allreduce_future(self, tensor: torch.Tensor, reduce_op: ReduceOp = ReduceOp.AVG, *,
                          divided_by: int | None = None, keep_input: bool = False) -> torch.futures.Future:
        """One of this step's cross-group reductions (what allreduce and the DDP comm hook issue)."""
        if self._voted:
            raise ConfigError(f"{self._prefix()} allreduce after should_commit() in the same step: no vote would "
                              f"see it fail, so groups could apply different updates. Start the next step first "
                              f"(manager.start_quorum() or OptimizerWrapper.zero_grad()), one vote per optimizer step")
        self._reductions += 1
        return redo.issue(self, tensor, reduce_op, divided_by, keep_input)  # at the wait: done after any redo

    def on_redo(self, tensor: torch.Tensor, write: Callable[[], None], restore: Callable[[], bool] | None = None,
                *, next_reduction: bool = False) -> None:
        """Run `write()` after a redo reduced `tensor` again (ft_core.redo; ft_core.ddp copies chunks into the
        gradients so), and `restore()` to put its input back if the reduction fails (True when it could), so it
        can be redone. For its latest reduction this step, or with `next_reduction` the one issued next: say it
        before issuing, so a failure right after issuing finds it."""
        self._redo.on_redo(tensor, write, restore, next_reduction)

    def _reduce(self, tensor: torch.Tensor, reduce_op: ReduceOp, rec: redo.Reduction | None = None, wait: bool = True,
                out: torch.futures.Future | None = None, divided_by: int | None = None) -> torch.futures.Future:
        """The collective as an eager torch Future that never fails (value: `tensor`); `rec` learns whether the
        input was sent, which decides whether it can be redone. wait=False: the quorum is done (ft_core.redo).
        `out`: the future to complete (made beforehand, as ft_core.redo's first attempt), else a new one."""
        try:
            if wait:
                self.wait_quorum()
            if self._pg_broken:
                return redo.skipped(self, out, tensor)
            n = self._round.num_participants if self._round is not None else 0
            role = rules.contribution(self.is_participating(), self._errored is not None)
            if role is rules.Contribution.BREAK:
                self._break_pg()  # the divisor counts this group: its peers must fail this step too
                return ft_futures.complete(out, tensor)
            if rec is not None:
                rec.intact = False
            if role is rules.Contribution.IDENTITY:
                tensor.fill_(rules.fill_value(reduce_op, tensor.dtype))
            opts = dist.AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op
            work = self._pg.allreduce([tensor], opts)
            scale = (divided_by or 1) / max(n, 1) if reduce_op == ReduceOp.AVG else 1.0
            done = (lambda _v: tensor.mul_(scale)) if scale != 1.0 else (lambda _v: tensor)
            failed = self._on_collective_error if rec is None or role is not rules.Contribution.OWN else \
                (lambda e, rec=rec: (redo.restore_input(rec, e), self._on_collective_error(e)))
            return redo.sending(self, ft_futures.settled(work.get_future(), tensor, failed, self.config.timeout, done,
                                                         what=f"{self._prefix()} allreduce", out=out))
        except Exception as exc:
            self._on_collective_error(exc)
            return ft_futures.complete(out, tensor)

    def register_buffers(self, key: object, buffers: Callable[[], list[torch.Tensor]]) -> None:
        """Keep `buffers()` (e.g. BatchNorm running stats) identical on every group after each committed
        step, as DDP's broadcast_buffers does inside a group: before the vote, every group takes the
        buffers of the first participant. ft_core.ddp registers a wrapped module's buffers."""
        self._buffer_sources[id(key)] = buffers

    def _sync_buffers(self) -> None:
        tensors = [b for source in self._buffer_sources.values() for b in source()]
        if not tensors or self._round is None or self._round.num_participants == 0:
            return
        root = lambda: self.is_participating() and self._round.participating_rank == 0  # noqa: E731 (its quorum's)
        broadcast_by_sum(tensors, root, functools.partial(redo.issue, self), lambda: self._errored is None)

    # ----------------------------------------------------------------- commit

    def should_commit(self, timeout: timedelta | float | None = None) -> bool:
        """Load a pending healed state, then vote group-wide; True => run the optimizer step. A step that
        lost a peer is redone without it first when every rank of the group can (ft_core.redo)."""
        redo.settle(self, self._quorum_timeout_s + 3 * self.config.timeout.total_seconds() + _MARGIN_S)
        wait = timeout if timeout is not None else self.config.timeout
        local, unreduced, heal_loaded = self._prepare_vote()
        decision = self._vote(local, wait)
        if not decision and self._group_redoable and redo.redo_step(self):
            local, unreduced, heal_loaded = self._prepare_vote()
            decision = self._vote(local, wait)
        self._voted = True
        self._transport.disallow_checkpoint()
        n = self._round.num_participants if self._round is not None else 0
        errored = self._errored is not None  # the vote itself may have failed
        self._state, actions = rules.on_vote(self._state, decision, local=local, errored=errored, num_participants=n,
                                             max_retries=self.config.max_retries,
                                             healed=self._heal.target if self._heal is not None and heal_loaded
                                             else None, group_healed=self._group_healed)
        if not actions.committed:
            if actions.break_pg:
                self._break_pg()
            logger.warning("%s step not committed (participants %d, min %d, error %s); consecutive failures %d",
                           self._prefix(), n, self.config.min_replica_size, self._errored, self._state.commit_failures)
        self._emit("commit", routine=decision, committed=decision, num_participants=n)
        if unreduced is not None:
            raise unreduced
        if actions.give_up:
            raise CommitError(f"{self._prefix()} {self._state.commit_failures} consecutive steps failed to commit "
                              f"(max_retries={self.config.max_retries}); last error: {self._errored}")
        return decision

    def _prepare_vote(self) -> tuple[bool, ConfigError | None, bool]:
        """(this rank's vote, the fail-closed error if any, heal loaded) after loading a pending heal and
        making the buffers identical."""
        pg_error = redo.pg_error(self)
        if pg_error is not None:
            self._on_collective_error(pg_error)
        self._await_beside()
        self._apply_pending_state_dict()
        plan = self._round
        if self._buffer_sources:  # a broken group skips it (the step fails: ft_core.redo.skipped)
            self._sync_buffers()
        heal_loaded = not (plan is not None and plan.heal) or (self._heal is not None and self._heal.loaded)
        local = rules.local_vote(plan.vote_world_size if plan is not None else 0, self.config.min_replica_size,
                                 self._errored is not None, heal_loaded)
        unreduced = rules.unreduced_step(plan.vote_world_size if plan else 0, self._reductions) if local else None
        if unreduced is not None:
            self.report_error(unreduced)
        return local and unreduced is None, unreduced, heal_loaded

    def _vote(self, local: bool, timeout: timedelta | float) -> bool:
        """The group's commit barrier; also learns whether every rank loaded this step's heal and
        whether every rank can redo this step."""
        cfg, healed = self.config, self._heal is not None and self._heal.loaded
        redoable = self._redo.redoable(self._errored is not None, self.is_participating())
        self._group_healed = self._group_redoable = False
        try:
            rnd = self._server.vote_round_local if self._server is not None else self._client.vote_round
            decision, self._group_healed, self._group_redoable = rnd(cfg.group_rank, self._state.step, local,
                                                                     healed, timeout, redoable)
            return decision
        except FTError as exc:
            self.report_error(exc)
            return False

    # ----------------------------------------------------------------- accessors

    def current_step(self) -> int:
        return self._state.step

    def batches_committed(self) -> int:
        return self._state.batches_committed

    def participating_rank(self) -> int | None:
        """This group's rank among the contributing groups (None when healing or a spare)."""
        self.wait_quorum()
        return self._round.participating_rank if self.is_participating() and self._round is not None else None

    def num_participants(self) -> int:
        """Number of contributing groups this step (0 before the first quorum)."""
        if self._quorum_future is None:
            return 0
        self.wait_quorum()
        return self._round.num_participants if self._round is not None else 0

    def is_participating(self) -> bool:
        rank = self._round.participating_rank if self._round is not None else None
        return rules.is_participating(rank, self._healing, self.config.use_async_quorum)

    @property
    def replica_id(self) -> str:
        return self.config.replica_id

    @property
    def group_rank(self) -> int:
        return self.config.group_rank

    @property
    def group_world_size(self) -> int:
        return self.config.group_world_size

    @property
    def store_address(self) -> str:
        return self._store_address

    @property
    def checkpoint_transport(self) -> Any:
        return self._transport

    # ----------------------------------------------------------------- events and lifecycle

    def _prefix(self) -> str:
        cfg = getattr(self, "config", None)  # None while __init__ is still connecting
        name, rank = (cfg.replica_id, cfg.group_rank) if cfg is not None else ("?", 0)
        return f"[{name}/{rank} - step {self._state.step}]"

    def _emit(self, kind: str, routine: bool = False, **fields: Any) -> None:
        """One structured event on "ft_core.events" at INFO; a `routine` one (a quorum that changed nothing,
        a committed step) at DEBUG, so it costs nothing unless someone listens at DEBUG or counts it
        (ft_core.metrics.EventMetrics, handed it directly)."""
        counters = metrics.counting_handlers(events) if routine else ()
        level = logging.DEBUG if routine else logging.INFO
        logged = events.isEnabledFor(level)
        if not logged and not counters:
            return
        event = {"type": kind, "replica_id": self.config.replica_id, "group_rank": self.config.group_rank,
                 "step": self._state.step, "time": time.time(), **fields}
        for counter in counters:  # at INFO they never see this DEBUG record
            counter.count(event)
        if logged:
            events.log(level, "%s %s %s", self._prefix(), kind, fields, extra={"ft_event": event})

    def finish(self) -> None:
        """Training ended normally (call before shutdown): the lighthouse records this group's final step and
        refuses a group that joins later behind it with JobFinishedError (docs/guarantees.md)."""
        if self._server is not None and not self._closed:
            self._server.notify_finished(self._state.step)

    def shutdown(self, wait: bool = True) -> None:
        """Stop what this Manager started (the process group is the caller's): server or client, heal-source clients,
        checkpoint transport, quorum thread, futures timer when idle. Idempotent; wait=True joins each in a bound."""
        if self._closed:
            return
        self._closed = True
        started = time.perf_counter()
        if wait and hasattr(self._transport, "drain"):  # healers fetching beside their step from us (the last one)
            try:
                self._transport.drain()
            except Exception as exc:  # never keeps the servers up
                logger.warning("%s checkpoint transport drain failed: %s", self._prefix(), exc)
        # Servers and clients first: a quorum call in flight then fails at once instead of at its deadline.
        try:
            if self._server is not None:
                self._server.shutdown()
            if self._client is not None:
                self._client.close()
            self._transport.shutdown(wait=wait)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            running = [f for f in (self._quorum_future, self._beside) if f is not None]
            if wait and running:
                _, pending = concurrent.futures.wait(running, timeout=_SHUTDOWN_JOIN_S)
                if not pending:
                    self._executor.shutdown(wait=True)
                else:
                    logger.warning("%s quorum thread still busy after %.1fs at shutdown; not waiting longer",
                                   self._prefix(), _SHUTDOWN_JOIN_S)
            elif wait:
                self._executor.shutdown(wait=True)
            self._heal_sources.close()
            if wait:
                ft_futures.stop_timer_if_idle(_SHUTDOWN_JOIN_S)
        logger.info("%s manager shut down in %.3fs", self._prefix(), time.perf_counter() - started)

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
