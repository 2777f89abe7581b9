"""Client of a replica group's manager server, and the wire form of a recovery plan.

Every call carries a deadline and the shared token; a deadline or cancel surfaces as
FTTimeoutError (a TimeoutError), anything else as a typed RPCError naming peer, call and fix.
A rank > 0 also subscribes here to the lighthouse's PeerLost notices, which only its group's server
(on rank 0) receives (`add_failure_listener`, ft_core.control.notices).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ft_core import settings
from ft_core.control import frames, rpc
from ft_core.control.notices import NoticeSubscription
from ft_core.control.proto import ft_pb2, ft_pb2_grpc
from ft_core.control.recovery import QuorumResult
from ft_core.errors import ConfigError

logger = logging.getLogger("ft_core.control.manager_client")

__all__ = ["ManagerClient", "result_from_pb", "result_to_pb"]


def result_to_pb(result: QuorumResult) -> ft_pb2.ManagerQuorumResponse:
    msg = ft_pb2.ManagerQuorumResponse(
        quorum_id=result.quorum_id, recover_src_manager_address=result.recover_src_manager_address,
        recover_dst_replica_ranks=result.recover_dst_replica_ranks, store_address=result.store_address,
        max_step=result.max_step, max_world_size=result.max_world_size, replica_rank=result.replica_rank,
        replica_world_size=result.replica_world_size, heal=result.heal, commit_failures=result.commit_failures,
        replica_ids=result.replica_ids, redo_quorum_id=result.redo_quorum_id)
    if result.recover_src_replica_rank is not None:
        msg.recover_src_replica_rank = result.recover_src_replica_rank
    if result.max_replica_rank is not None:
        msg.max_replica_rank = result.max_replica_rank
    return msg


def result_from_pb(msg: ft_pb2.ManagerQuorumResponse) -> QuorumResult:
    return QuorumResult(
        quorum_id=msg.quorum_id, replica_rank=msg.replica_rank, replica_world_size=msg.replica_world_size,
        recover_src_manager_address=msg.recover_src_manager_address,
        recover_src_replica_rank=msg.recover_src_replica_rank if msg.HasField("recover_src_replica_rank") else None,
        recover_dst_replica_ranks=list(msg.recover_dst_replica_ranks), store_address=msg.store_address,
        max_step=msg.max_step,
        max_replica_rank=msg.max_replica_rank if msg.HasField("max_replica_rank") else None,
        max_world_size=msg.max_world_size, heal=msg.heal, commit_failures=msg.commit_failures,
        replica_ids=list(msg.replica_ids), redo_quorum_id=msg.redo_quorum_id)


class ManagerClient:
    """Client of one group's manager server; every call has a deadline and typed errors."""

    def __init__(self, addr: str, connect_timeout: timedelta | float = timedelta(seconds=10),
                 token: str | None = None, stop: threading.Event | None = None, frames_addr: str = "") -> None:
        """Connects (bounded by connect_timeout, or until `stop` is set: rpc.connect). With `frames_addr` (the
        server's frames_address()) the unary calls go on the frames wire (ft_core.control.frames)."""
        self._addr = rpc.normalize_address(addr)
        if not self._addr:
            raise ConfigError("ManagerClient needs the manager server address (host:port)")
        self._token = settings.value("FT_TOKEN", token) or None
        self._frames = frames.FrameClient(frames_addr, self._token, f"manager server {frames_addr}") \
            if frames_addr and frames.enabled() else None
        self._channel = rpc.connect(self._addr, connect_timeout, call_name=f"connect to manager server {self._addr}",
                                    stop=stop)
        self._stub = ft_pb2_grpc.ManagerServiceStub(self._channel)
        self._notices: NoticeSubscription | None = None

    def address(self) -> str:
        return self._addr

    def add_failure_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call `listener(quorum_id, lost_replica_id)` for each PeerLost notice the lighthouse pushes to this
        group (its manager server forwards them, ft_core.control.notices): as ManagerServer's, for ranks > 0.
        The first call subscribes; called on the subscription's thread, so keep it short and non-blocking."""
        if self._notices is None:  # registered before the subscription starts: it gets the server's backlog
            self._notices = NoticeSubscription(self._stub, self._addr, self._token, listeners=(listener,))
        else:
            self._notices.add_listener(listener)

    def wait_failure_subscription(self, timeout: timedelta | float) -> bool:
        """True once the server has registered this client's subscription (False without a listener)."""
        return self._notices is not None and self._notices.wait_subscribed(rpc.seconds(timeout))

    def _call(self, method: Any, request: Any, name: str, timeout: timedelta | float, response: Any) -> Any:
        wire = self._frames
        if wire is not None:
            try:
                return response.FromString(wire.call(name, request.SerializeToString(), max(rpc.seconds(timeout), 0.001)))
            except frames.FramesUnreachable as exc:  # a firewall between ranks, say: keep to the gRPC port
                logger.warning("%s; using the gRPC port %s from now on", exc, self._addr)
                self._frames = None
                wire.close()
        return rpc.call(method, request, peer=f"manager server {self._addr}", name=name, timeout=timeout,
                        token=self._token)

    def quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool,
               timeout: timedelta | float, init_sync: bool = True, commit_failures: int = 0,
               commit_quorum_id: int = 0, rebuild: bool = False, redo_quorum_id: int = 0) -> QuorumResult:
        """Join the group's quorum as `group_rank`; returns this rank's recovery plan."""
        request = ft_pb2.ManagerQuorumRequest(group_rank=group_rank, step=step,
                                              checkpoint_metadata=checkpoint_metadata, shrink_only=shrink_only,
                                              init_sync=init_sync, commit_failures=commit_failures,
                                              commit_quorum_id=commit_quorum_id, rebuild=rebuild,
                                              redo_quorum_id=redo_quorum_id)
        return result_from_pb(self._call(self._stub.Quorum, request, "Quorum", timeout, ft_pb2.ManagerQuorumResponse))

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta | float) -> bool:
        """The group-wide commit decision for `step` (AND of every rank's vote)."""
        return self.vote_round(group_rank, step, should_commit, False, timeout)[0]

    def vote_round(self, group_rank: int, step: int, should_commit: bool, healed: bool,
                   timeout: timedelta | float, redoable: bool = False) -> tuple[bool, bool, bool]:
        """(AND of the ranks' votes, of their `healed` bits, of their `redoable` bits (ft_core.redo)) for `step`."""
        request = ft_pb2.ShouldCommitRequest(group_rank=group_rank, step=step, should_commit=should_commit,
                                             healed=healed, redoable=redoable)
        response = self._call(self._stub.ShouldCommit, request, "ShouldCommit", timeout, ft_pb2.ShouldCommitResponse)
        return response.should_commit, response.all_healed, response.all_redoable

    def checkpoint_metadata(self, group_rank: int, timeout: timedelta | float) -> str:
        """The checkpoint transport address that `group_rank` of this group registered."""
        request = ft_pb2.CheckpointMetadataRequest(group_rank=group_rank)
        return self._call(self._stub.CheckpointMetadata, request, "CheckpointMetadata", timeout,
                          ft_pb2.CheckpointMetadataResponse).checkpoint_metadata

    def kill(self, msg: str, timeout: timedelta | float) -> None:
        """Ask the server's process to exit (needs the token, see the module docstring)."""
        self._call(self._stub.Kill, ft_pb2.KillRequest(msg=msg), "Kill", timeout, ft_pb2.KillResponse)

    def close(self) -> None:
        if self._notices is not None:
            self._notices.close()
        if self._frames is not None:
            self._frames.close()
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
