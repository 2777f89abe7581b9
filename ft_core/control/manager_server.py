"""Per-group manager server (runs on group rank 0) and its client.

The server gathers one Quorum call from every rank of its replica group, sends ONE lighthouse
quorum for the group (over its heartbeat stream when open, else a unary call), and answers each rank
with its own recovery plan (ft_core.control.recovery). It also runs the group's commit barrier (keyed
by step) and keeps a heartbeat stream to the lighthouse, whose PeerLost notices reach the listeners of
`add_failure_listener`. After a failed step it probes the last quorum's peers and reports the ones it
cannot reach, so the lighthouse can pick a set of groups that all reach each other. A Manager in the
same process uses `quorum_local` / `should_commit_local` and skips the gRPC hop; the other ranks use
`ManagerClient`.

Kill policy: Kill exits the hosting process, so it must be authenticated. With a token set, the
server's token check (rpc.TokenCheckingHandler) authenticates it and Kill is allowed. Without a token
Kill is refused unless the server was built with `allow_kill=True` (or FT_ALLOW_KILL=1), which a local
demo can set; `allow_kill=False` refuses it even with a token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ft_core import net, settings
from ft_core.control import manager_service, rpc
from ft_core.control.heartbeat_stream import release_stream_loop, stream_loop
from ft_core.control.lighthouse_client import LighthouseClient, StreamUnavailable
from ft_core.control.manager_rounds import CommitRound, QuorumRound, RankRequest, answer_by, redo_quorum_id
from ft_core.control.manager_client import ManagerClient
from ft_core.control.manager_server_config import ManagerServerConfig, resolve_config
from ft_core.control.notices import NoticeHub
from ft_core.control.quorum import EXCLUDED_CODE
from ft_core.control.quorum_wait import QuorumWaitNotes
from ft_core.errors import ConfigError, FTError, FTTimeoutError, JobFinishedError, QuorumError, RPCError
from ft_core.control.recovery import QuorumResult, compute_recovery_plan
from ft_core.control.types import Quorum, QuorumMember

__all__ = ["ManagerServer", "ManagerClient", "ManagerServerConfig", "QuorumResult"]

logger = logging.getLogger(__name__)

MAX_CHECKPOINT_METADATA_BYTES = 64 * 1024
KILL_EXIT_DELAY_S = 0.1  # lets the Kill response reach the caller before the process exits
STREAM_WAIT_S = 1.0  # longest a quorum round waits for a connecting heartbeat stream
REPROBE_S = 2.0  # while this group reports unreachable peers, probe again this often during its long poll
PROBE_S = 0.5  # longest the reachability probe of the previous quorum's peers takes after a failed step


def _poll_s(member: QuorumMember, remaining_s: float) -> float:
    """How long one lighthouse long poll may wait. While `member` reports unreachable peers the poll is
    cut in REPROBE_S slices, each followed by a fresh probe: once the partition heals it joins with a
    clean report instead of staying excluded."""
    return REPROBE_S if member.unreachable and remaining_s > REPROBE_S else remaining_s


class ManagerServer:
    """The manager server of one replica group; see the module docstring."""

    def __init__(self, replica_id: str, lighthouse_addr: str | list[str] | None, hostname: str = "127.0.0.1",
                 bind: str = "127.0.0.1:0", store_addr: str = "", world_size: int = 1,
                 heartbeat_interval: timedelta = timedelta(milliseconds=100),
                 connect_timeout: timedelta | float | None = None, quorum_retries: int | None = None,
                 token: str | None = None, allow_kill: bool | None = None) -> None:
        self.config = resolve_config(replica_id, lighthouse_addr, hostname, bind, store_addr, world_size,
                                     heartbeat_interval, connect_timeout, quorum_retries, token, allow_kill)
        try:  # one dial at start: a typo or a lighthouse that is not up is reported in seconds, not at a deadline
            net.check_reachable(self.config.lighthouse_addrs)
        except RPCError as exc:
            logger.warning("replica group %s: %s; retrying until the quorum deadline", replica_id, exc)
        self._client_cls = LighthouseClient
        self._use_stream = settings.value("FT_STREAM_QUORUM", None)  # quorum over the heartbeat stream
        self._cond = threading.Condition()
        self._quorum_round = QuorumRound()
        self._commit_round: CommitRound | None = None
        self._checkpoint_metadata: dict[int, str] = {}
        self._last_quorum_id = 0
        self._last_quorum_replica_ids: tuple[str, ...] = ()  # members of quorum _last_quorum_id (lighthouse rule 10)
        self._last_quorum: Quorum | None = None  # the last quorum the lighthouse gave this group
        self._unreachable: tuple[str, ...] = ()  # peers of that quorum the last probe could not reach
        self._lost: set[tuple[int, str]] = set()  # (quorum_id, replica_id) the lighthouse said were lost
        self._closed = False
        self._lighthouse_lock = threading.Lock()  # guards _lighthouse
        self._lighthouse: Any = None
        self._heartbeat_client: Any = None
        self._heartbeat: Any = None
        self._wait_notes = QuorumWaitNotes(replica_id, self._quorum_status)  # why a long wait for a quorum

        cfg = self.config
        # Every rank may wait in Quorum and ShouldCommit at once, plus peers asking CheckpointMetadata.
        workers = 2 * cfg.world_size + 8
        self._handlers = futures.ThreadPoolExecutor(max_workers=workers,
                                                    thread_name_prefix=f"ft-manager[{cfg.replica_id}]")
        # grpc.aio on the loop of the group's heartbeat stream: a round completed by a remote call needs no
        # thread hop (ft_core.control.manager_service)
        self._loop = stream_loop()  # held until shutdown
        self._notices = NoticeHub(self._loop)  # PeerLost notices forwarded to the other ranks (ft_core.control.notices)
        try:
            try:
                self._server, port = asyncio.run_coroutine_threadsafe(
                    manager_service.start_server(self, cfg.bind, cfg.token), self._loop).result(30)
            except RuntimeError:  # grpc says only that its bind failed: bind_problem finds why
                port = 0
            if not port:
                raise ConfigError(f"manager server could not bind {cfg.bind!r}: "
                                  f"{net.bind_problem(cfg.bind, fallback='pick a free port or port 0')}")
            self._address = net.format_host_port(cfg.hostname, port)
            self._frames, self._frames_address = manager_service.open_frames(self, self._loop)
            try:
                self._start_heartbeats()
            except BaseException:
                self._stop_server(None)
                raise
        except BaseException:
            self._handlers.shutdown(wait=False, cancel_futures=True)
            release_stream_loop(self._loop)
            raise
        logger.info("manager server for replica group %s listening on %s (world_size=%d, lighthouse=%s, "
                    "token=%s, kill=%s)", cfg.replica_id, self._address, cfg.world_size,
                    ",".join(cfg.lighthouse_addrs), "set" if cfg.token else "none",
                    "allowed" if cfg.kill_allowed else "refused",
                    extra={"ft_event": {"type": "manager_server_start", "replica_id": cfg.replica_id,
                                        "address": self._address}})

    # ----------------------------------------------------------------- lifecycle

    def address(self) -> str:
        """`host:port` of this server, with the configured hostname."""
        return self._address

    def frames_address(self) -> str:
        """`host:port` of the same calls on the frames wire ("" when not served: FT_FRAMES=0)."""
        return self._frames_address

    @property
    def replica_id(self) -> str:
        return self.config.replica_id

    def wait_heartbeat_connected(self, timeout: timedelta | float) -> bool:
        """True once the lighthouse answers our heartbeat stream (from then on our death is seen at once)."""
        return bool(self._heartbeat.wait_connected(timeout))

    def last_quorum_id(self) -> int:
        """Highest quorum_id this server has received from the lighthouse."""
        return self._last_quorum_id

    def add_failure_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call `listener(quorum_id, lost_replica_id)` when the lighthouse says a member of quorum `quorum_id`
        was lost (its stream broke or its heartbeat expired): that quorum's collectives cannot finish.

        Called on the heartbeat stream's thread as the notice arrives: keep it short and non-blocking
        (the Manager records the error and aborts its process group from it)."""
        self._heartbeat.add_peer_lost_listener(listener)

    def shutdown(self) -> None:
        """Stop heartbeats (the lighthouse drops us), fail waiting calls, stop serving. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            closing = FTError(f"manager server of replica group {self.replica_id} is shutting down")
            if not self._quorum_round.finished and self._quorum_round.requests:
                self._quorum_round.error = closing
            if self._commit_round is not None:
                self._commit_round.error = closing
            self._cond.notify_all()
        # A lighthouse long poll in flight holds a handler thread for up to its whole timeout: closing the
        # client's channel cancels it now, so the handlers below end at once.
        with self._lighthouse_lock:
            lighthouse, self._lighthouse = self._lighthouse, None
        if lighthouse is not None:
            lighthouse.close()
        self._wait_notes.close()
        self._notices.close()  # the other ranks' subscriptions end now, not at the server's grace
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._heartbeat_client is not None:
            self._heartbeat_client.close()
        self._stop_server(0.2)
        self._handlers.shutdown(wait=True, cancel_futures=True)
        release_stream_loop(self._loop)

    def _stop_server(self, grace: float | None) -> None:
        try:
            asyncio.run_coroutine_threadsafe(manager_service.stop_server(self._server, grace, self._frames),
                                             self._loop).result(5)
        except Exception:  # keep shutting down the rest; record why this part failed
            logger.exception("manager server of replica group %s did not stop cleanly", self.replica_id)

    def __enter__(self) -> "ManagerServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _start_heartbeats(self) -> None:
        cfg = self.config
        self._heartbeat_client = self._client_cls(list(cfg.lighthouse_addrs), connect_timeout=cfg.connect_timeout,
                                                  token=cfg.token)
        self._heartbeat = self._heartbeat_client.start_heartbeat_stream(cfg.replica_id, cfg.heartbeat_interval)
        self._heartbeat.add_peer_lost_listener(self._note_lost)
        self._heartbeat.add_peer_lost_listener(self._notices.publish)

    def notify_finished(self, step: int) -> None:
        """This group ended its training at `step`: tell every lighthouse address, so a late group is refused."""
        if self._heartbeat_client is not None and not self._closed:
            self._heartbeat_client.finished(self.replica_id, step, self._last_quorum_id)

    def gave_up(self) -> None:
        """This group neither commits nor redoes the step it attempted in its last quorum (quorum rule 11)."""
        if self._heartbeat is not None and not self._closed:
            self._heartbeat.gave_up(self._last_quorum_id)

    def _quorum_status(self) -> str:
        return self._heartbeat_client.quorum_status(self.replica_id, timeout=2.0)

    def _note_lost(self, quorum_id: int, replica_id: str) -> None:
        """A lost peer is not probed: the lighthouse already dropped it (probing a cut host costs PROBE_S)."""
        with self._cond:
            if len(self._lost) > 1024:
                self._lost.clear()
            self._lost.add((quorum_id, replica_id))

    # ----------------------------------------------------------------- validation

    def _invalid(self, call: str, message: str) -> RPCError:
        return RPCError(f"{call} on manager server {self._address} (replica group {self.replica_id}): {message}",
                        peer=self._address, call=call, code="INVALID_ARGUMENT")

    def _check_rank(self, call: str, group_rank: int) -> None:
        if not 0 <= group_rank < self.config.world_size:
            raise self._invalid(call, f"unknown group rank {group_rank}; this replica group has world_size "
                                      f"{self.config.world_size} (valid ranks 0..{self.config.world_size - 1})")

    def _check_step(self, call: str, step: int) -> None:
        if step < 0:
            raise self._invalid(call, f"step must be >= 0, got {step}")

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RPCError(f"{call}: manager server of replica group {self.replica_id} is shut down",
                           peer=self._address, call=call, code="UNAVAILABLE")

    # ----------------------------------------------------------------- quorum

    def quorum_local(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                     timeout: timedelta | float, init_sync: bool = True, commit_failures: int = 0,
                     commit_quorum_id: int = 0, rebuild: bool = False, redo_quorum_id: int = 0,
                     reductions: str = "") -> QuorumResult:
        """Join this group's quorum round as `group_rank` and return that rank's plan (no gRPC hop)."""
        rnd, entry, timeout_s, lead = self._join_round(group_rank, step, checkpoint_metadata, shrink_only, timeout,
                                                       commit_failures, commit_quorum_id, rebuild, redo_quorum_id,
                                                       reductions)
        if lead:
            self._run_round(rnd)
        else:
            self._wait_round(rnd, entry, timeout_s)
        return self._round_plan(rnd, group_rank, init_sync)

    def _join_round(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
                    timeout: timedelta | float, commit_failures: int,
                    commit_quorum_id: int, rebuild: bool = False, redo_quorum_id: int = 0,
                    reductions: str = "") -> tuple[QuorumRound, RankRequest, float, bool]:
        """Validate a rank's Quorum call and add it to the round: (round, entry, timeout_s, lead?)."""
        self._check_rank("Quorum", group_rank)
        self._check_step("Quorum", step)
        if commit_failures < 0:
            raise self._invalid("Quorum", f"commit_failures must be >= 0, got {commit_failures}")
        size = len(checkpoint_metadata.encode())
        if size > MAX_CHECKPOINT_METADATA_BYTES:
            raise self._invalid("Quorum", f"checkpoint_metadata is {size} bytes; the limit is "
                                          f"{MAX_CHECKPOINT_METADATA_BYTES} (it should be a transport address)")
        timeout_s = rpc.seconds(timeout)
        deadline = answer_by(timeout_s)
        entry = RankRequest(group_rank, step, shrink_only, commit_failures, deadline, commit_quorum_id, rebuild,
                            redo_quorum_id, reductions)
        with self._cond:
            self._check_open("Quorum")
            self._checkpoint_metadata[group_rank] = checkpoint_metadata
            rnd = self._quorum_round
            rnd.requests[group_rank] = entry  # a retry from the same rank replaces its stale call
            self._cond.notify_all()
            lead = len(rnd.requests) == self.config.world_size
            if lead:
                self._quorum_round = QuorumRound()  # later calls belong to the next round
        return rnd, entry, timeout_s, lead

    def _round_plan(self, rnd: QuorumRound, group_rank: int, init_sync: bool) -> QuorumResult:
        """The finished round's outcome for `group_rank`: its recovery plan, or the round's error."""
        if rnd.error is not None:
            raise rnd.error
        assert rnd.quorum is not None
        try:
            return compute_recovery_plan(self.replica_id, group_rank, rnd.quorum, init_sync)
        except QuorumError as exc:
            raise RPCError(str(exc), peer=self._address, call="Quorum", code="FAILED_PRECONDITION") from None

    def _wait_round(self, rnd: QuorumRound, entry: RankRequest, timeout_s: float) -> None:
        with self._cond:
            while not rnd.finished:
                if rnd.requests.get(entry.group_rank) is not entry:
                    raise RPCError(f"Quorum call of group rank {entry.group_rank} (replica group {self.replica_id}) "
                                   f"was superseded by a newer call from the same rank", peer=self._address,
                                   call="Quorum", code="ABORTED")
                remaining = entry.deadline - time.monotonic()
                if remaining <= 0:
                    arrived = sorted(rnd.requests)
                    if self._quorum_round is rnd:  # still collecting: withdraw so a stale call never completes it
                        del rnd.requests[entry.group_rank]
                        missing = [r for r in range(self.config.world_size) if r not in arrived]
                        raise FTTimeoutError(
                            f"Quorum on manager server {self._address} (replica group {self.replica_id}) timed out "
                            f"after {timeout_s:.3g}s: group rank(s) {missing} of world_size {self.config.world_size} "
                            f"never called Quorum; they may be dead, hung or slow (or raise the quorum timeout)")
                    raise FTTimeoutError(
                        f"Quorum on manager server {self._address} (replica group {self.replica_id}) timed out "
                        f"after {timeout_s:.3g}s waiting for the lighthouse ({','.join(self.config.lighthouse_addrs)})"
                        f" to issue a quorum; check the lighthouse status page, min_replicas and join_timeout")
                self._cond.wait(remaining)

    def _run_round(self, rnd: QuorumRound) -> None:
        """Called by the last rank to arrive: cross-check steps, one lighthouse call, wake every rank."""
        member, error, deadline = self._round_member(rnd, probe=True)
        quorum: Quorum | None = None
        if member is not None:
            self._await_heartbeat_stream(deadline)
            self._wait_notes.begin()
            try:
                quorum = self._lighthouse_quorum(member, deadline)
            except FTError as exc:
                error = exc
            finally:
                self._wait_notes.end()
        self._finish_round(rnd, quorum, error)

    def _round_member(self, rnd: QuorumRound, probe: bool) -> tuple[QuorumMember | None, FTError | None, float]:
        """The group's lighthouse request for a full round (or the error that ends it) and its deadline.
        Without `probe`, peers are not probed (the caller checked that nothing needs probing)."""
        requests = sorted(rnd.requests.values(), key=lambda r: r.group_rank)
        steps = {r.step for r in requests}
        deadline = min(r.deadline for r in requests)  # every rank hears the outcome before its deadline
        if len(steps) > 1:
            by_step = ", ".join(f"group rank {r.group_rank} at step {r.step}" for r in requests)
            error = RPCError(f"Quorum: the ranks of replica group {self.replica_id} report different steps "
                             f"({by_step}); every rank of a group must commit the same steps (check for a rank "
                             f"that skipped should_commit or loaded another checkpoint)", peer=self._address,
                             call="Quorum", code="FAILED_PRECONDITION")
            return None, error, deadline
        commit_failures = max(r.commit_failures for r in requests)
        return QuorumMember(
            replica_id=self.replica_id, address=self._address, store_address=self.config.store_addr,
            step=requests[0].step, world_size=self.config.world_size, restarted=self.config.restarted,
            shrink_only=any(r.shrink_only for r in requests), commit_failures=commit_failures,
            last_quorum_id=self._last_quorum_id, last_quorum_replica_ids=self._last_quorum_replica_ids,
            unreachable=self._probe_peers(commit_failures, deadline) if probe else (),
            commit_quorum_id=min(r.commit_quorum_id for r in requests),  # the oldest fork of any rank
            rebuild=any(r.rebuild for r in requests), redo_quorum_id=redo_quorum_id(requests),
            reductions=next((r.reductions for r in requests if r.reductions), "")), None, deadline

    def _needs_probe(self, rnd: QuorumRound) -> bool:
        """Whether this round's lighthouse request first probes peers (after a failed step): a blocking part."""
        return self._last_quorum is not None and (bool(self._unreachable) or
                                                  any(r.commit_failures for r in rnd.requests.values()))

    def _finish_round(self, rnd: QuorumRound, quorum: Quorum | None, error: FTError | None) -> None:
        """Record the round's outcome and wake its ranks."""
        with self._cond:
            if quorum is not None:
                if quorum.quorum_id >= self._last_quorum_id:
                    self._last_quorum_replica_ids = quorum.roster.replica_ids
                self._last_quorum_id = max(self._last_quorum_id, quorum.quorum_id)
                self._last_quorum = quorum
            rnd.quorum, rnd.error = quorum, error
            if rnd.error is None and rnd.quorum is None:
                rnd.error = FTError("quorum round ended without a result")
            self._cond.notify_all()
        if quorum is not None:
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("replica group %s got quorum %d (%d participants)", self.replica_id, quorum.quorum_id,
                             len(quorum.roster.replica_ids))
        else:
            logger.warning("quorum round of replica group %s failed: %s", self.replica_id, error,
                           extra={"ft_event": {"type": "error", "replica_id": self.replica_id,
                                               "message": str(error)}})

    def _probe_peers(self, commit_failures: int, deadline: float) -> tuple[str, ...]:
        """After a failed step, the peers of the last quorum whose manager servers this host cannot reach.

        Reported in the quorum request so the lighthouse issues a set of groups that can all reach each
        other (an asymmetric partition must not fail step after step on the same membership). Probed
        again at every round while the last report was not empty; nothing is probed after a good step.
        """
        last = self._last_quorum
        if last is None or (commit_failures == 0 and not self._unreachable):
            self._unreachable = ()
            return ()
        with self._cond:
            lost = {rid for qid, rid in self._lost if qid == last.quorum_id}
        peers = {m.replica_id: m.address for m in last.participants
                 if m.replica_id != self.replica_id and m.address and m.replica_id not in lost}
        budget = min(PROBE_S, 0.25 * (deadline - time.monotonic()))
        unreachable = tuple(rpc.unreachable_peers(peers, budget)) if peers and budget > 0 else ()
        if unreachable != self._unreachable and unreachable:
            logger.warning("replica group %s cannot reach %s of quorum %d after a failed step; reporting it to the "
                           "lighthouse", self.replica_id, list(unreachable), last.quorum_id)
        self._unreachable = unreachable
        return unreachable

    def _await_heartbeat_stream(self, deadline: float) -> None:
        """Before a round, give a connecting heartbeat stream a moment (no wait once it is up).

        The lighthouse counts a join as alive only while the replica's stream is open after a stream
        of the same replica broke (a restarted group), so a join sent before our stream opens could
        miss the survivors' next round. Bounded: with the stream down the round still goes ahead.
        """
        heartbeat = self._heartbeat
        if heartbeat is None or heartbeat.connected:
            return
        heartbeat.wait_connected(max(min(STREAM_WAIT_S, 0.5 * (deadline - time.monotonic())), 0.0))

    def _lighthouse_quorum(self, member: QuorumMember, deadline: float) -> Quorum:
        """One lighthouse quorum for the group, retried `quorum_retries` times on failures before the deadline."""
        attempts = self.config.quorum_retries + 1
        delays = rpc.backoff_delays(initial=0.1, cap=1.0)
        last: FTError | None = None
        attempt = 0
        while attempt < attempts:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            client = None
            if self._closed:
                last = last or FTError(f"manager server of replica group {self.replica_id} is shutting down")
                break
            try:
                answer = self._stream_quorum(member, _poll_s(member, remaining))
                if answer is not None:
                    return answer
                client = self._lighthouse_client()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                return client.quorum(member, timeout=timedelta(seconds=_poll_s(member, remaining)))
            except FTTimeoutError as exc:
                last = exc
                if not (member.unreachable and deadline - time.monotonic() > 0 and not self._closed):
                    break  # the long poll used the whole budget; a retry has nothing left to wait with
                member = replace(member, unreachable=self._probe_peers(member.commit_failures, deadline))
                attempt -= 1  # a slice is no failed attempt
            except JobFinishedError:
                raise  # the job finished ahead of this group: no retry changes that
            except FTError as exc:
                if isinstance(exc, RPCError) and exc.code == EXCLUDED_CODE:
                    raise  # a shrink-only call from outside the last quorum (rule 2): no retry changes that either
                last = exc
                logger.warning("lighthouse quorum attempt %d/%d for replica group %s failed: %s", attempt,
                               attempts, self.replica_id, exc)
                self._drop_lighthouse_client(client)
                if attempt < attempts:
                    time.sleep(max(min(next(delays), deadline - time.monotonic()), 0))
        where = ",".join(self.config.lighthouse_addrs)
        if self._closed:
            raise RPCError(f"lighthouse quorum for replica group {self.replica_id} ended: the manager server is "
                           f"shutting down", peer=self._address, call="Quorum", code="UNAVAILABLE")
        if last is None or isinstance(last, FTTimeoutError):
            raise FTTimeoutError(f"lighthouse quorum for replica group {self.replica_id} at {where} did not complete "
                                 f"before the deadline ({last or 'no time left'}); check that the lighthouse is up, "
                                 f"its min_replicas and join_timeout, or raise the quorum timeout"
                                 + (f"; the lighthouse said: {said}" if (said := self._wait_notes.last_reason) else ""))
        raise RPCError(f"lighthouse quorum for replica group {self.replica_id} failed after {attempts} attempt(s) at "
                       f"{where}: {last}", peer=self._address, call="Quorum", code="UNAVAILABLE")

    def _stream_quorum(self, member: QuorumMember, timeout_s: float) -> Quorum | None:
        """The quorum over our open heartbeat stream (one message each way, no call set up per round), or
        None when the stream cannot carry it (not open, ended, lighthouse closing): the caller then sends
        a unary call, which also fails over across the lighthouse addresses."""
        heartbeat = self._heartbeat
        if heartbeat is None or not heartbeat.connected or not self._use_stream:
            return None
        try:
            return heartbeat.quorum(member, timeout=timeout_s)
        except StreamUnavailable as exc:
            logger.debug("replica group %s: quorum over the heartbeat stream unavailable (%s); unary call",
                         self.replica_id, exc)
            return None

    def _lighthouse_client(self) -> Any:
        """The lighthouse client for quorum calls, built on first use and again after a failure."""
        with self._lighthouse_lock:
            if self._closed:
                raise RPCError(f"manager server of replica group {self.replica_id} is shutting down",
                               peer=self._address, call="Quorum", code="UNAVAILABLE")
            if self._lighthouse is None:
                self._lighthouse = self._client_cls(list(self.config.lighthouse_addrs),
                                                    connect_timeout=self.config.connect_timeout,
                                                    token=self.config.token)
            return self._lighthouse

    def _drop_lighthouse_client(self, client: Any) -> None:
        with self._lighthouse_lock:
            if client is not None and self._lighthouse is client:
                self._lighthouse = None
        if client is not None:
            client.close()

    # ----------------------------------------------------------------- commit barrier

    def should_commit_local(self, group_rank: int, step: int, should_commit: bool,
                            timeout: timedelta | float) -> bool:
        """Vote for `step` as `group_rank`; True only when every rank of the group votes True for that step."""
        return self.vote_round_local(group_rank, step, should_commit, False, timeout)[0]

    def vote_round_local(self, group_rank: int, step: int, should_commit: bool, healed: bool,
                         timeout: timedelta | float, redoable: bool = False) -> tuple[bool, bool, bool]:
        """The group's commit barrier for `step`: (AND of the ranks' votes, of their `healed` bits, of their
        `redoable` bits (ft_core.redo))."""
        self._check_rank("ShouldCommit", group_rank)
        self._check_step("ShouldCommit", step)
        timeout_s = rpc.seconds(timeout)
        deadline = answer_by(timeout_s)
        token = object()
        with self._cond:
            self._check_open("ShouldCommit")
            rnd = self._commit_round
            if rnd is None:
                rnd = self._commit_round = CommitRound(step)
            elif rnd.step != step:
                rnd.error = RPCError(
                    f"ShouldCommit: group rank {group_rank} of replica group {self.replica_id} voted for step {step} "
                    f"while the vote in progress is for step {rnd.step} (ranks {sorted(rnd.votes)} voted); the "
                    f"ranks of a group disagree on the step", peer=self._address, call="ShouldCommit",
                    code="FAILED_PRECONDITION")
                self._commit_round = None
                self._cond.notify_all()
                raise rnd.error
            rnd.votes[group_rank] = (bool(should_commit), token)
            rnd.healed[group_rank] = bool(healed)
            rnd.redoable[group_rank] = bool(redoable)
            if len(rnd.votes) == self.config.world_size:
                rnd.decision = all(v for v, _ in rnd.votes.values())
                rnd.all_healed = all(rnd.healed.get(r, False) for r in rnd.votes)
                rnd.all_redoable = all(rnd.redoable.get(r, False) for r in rnd.votes)
                self._commit_round = None
                self._cond.notify_all()
                if not rnd.decision and not rnd.all_redoable:  # final: no redo follows
                    self.gave_up()
                return rnd.decision, rnd.all_healed, rnd.all_redoable
            self._cond.notify_all()
            while rnd.decision is None and rnd.error is None:
                if rnd.votes.get(group_rank, (None, None))[1] is not token:
                    raise RPCError(f"ShouldCommit vote of group rank {group_rank} for step {step} was superseded by "
                                   f"a newer vote from the same rank", peer=self._address, call="ShouldCommit",
                                   code="ABORTED")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in range(self.config.world_size) if r not in rnd.votes]
                    del rnd.votes[group_rank]
                    if not rnd.votes and self._commit_round is rnd:
                        self._commit_round = None
                    raise FTTimeoutError(
                        f"ShouldCommit on manager server {self._address} (replica group {self.replica_id}) for step "
                        f"{step} timed out after {timeout_s:.3g}s: group rank(s) {missing} did not vote; they may be "
                        f"dead, hung or slow")
                self._cond.wait(remaining)
            if rnd.error is not None:
                raise rnd.error
            return rnd.decision, rnd.all_healed, rnd.all_redoable

    # ----------------------------------------------------------------- checkpoint metadata

    def checkpoint_metadata_local(self, group_rank: int) -> str:
        """The checkpoint transport address `group_rank` registered at its last Quorum call."""
        self._check_rank("CheckpointMetadata", group_rank)
        with self._cond:
            value = self._checkpoint_metadata.get(group_rank)
        if value is None:
            raise RPCError(f"CheckpointMetadata: group rank {group_rank} of replica group {self.replica_id} has not "
                           f"called Quorum on this manager server yet, so it has no checkpoint address",
                           peer=self._address, call="CheckpointMetadata", code="NOT_FOUND")
        return value

    def _kill(self, msg: str) -> None:
        if not self.config.kill_allowed:
            raise RPCError(f"Kill refused by manager server {self._address} (replica group {self.replica_id}): it "
                           f"runs without a token, so Kill cannot be authenticated; set FT_TOKEN on every process "
                           f"(or allow_kill=True / FT_ALLOW_KILL=1 for a local demo)", peer=self._address,
                           call="Kill", code="PERMISSION_DENIED")
        logger.warning("replica group %s killed by request: %s", self.replica_id, msg,
                       extra={"ft_event": {"type": "kill", "replica_id": self.replica_id, "message": msg}})
        exit_soon = threading.Timer(KILL_EXIT_DELAY_S, os._exit, args=(1,))
        exit_soon.name, exit_soon.daemon = f"ft-manager-kill[{self.replica_id}]", True
        exit_soon.start()
