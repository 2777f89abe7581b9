"""Healing a replica group that is behind: fetch the source's state during the step, load it at
commit (DESIGN.md section 7). What is adopted and when is ft_core.step_rules' decision; this module
moves the bytes and loads them.

`HealSources` keeps the manager clients of recent heal sources open: closing a fresh gRPC channel
blocks ~0.2 s (grpc's connectivity poller), which would stall every group waiting on the healer.
It also abandons a heal when the lighthouse says a member of its quorum is lost (`lost`): that step
fails anyway, and the healer must rejoin the next quorum at once, not after the heal timeout (the
survivors' next quorum may need it: more than half of the healthy replicas, lighthouse rule 4).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch

from ft_core import net
from ft_core import step_rules as rules
from ft_core.cancels import Attempt, QuorumCancels
from ft_core.control.manager_client import ManagerClient
from ft_core.control.recovery import QuorumResult
from ft_core.errors import CheckpointError, FTError, FTTimeoutError

__all__ = ["FetchedHeal", "HealSources", "apply_heal", "load_healed_state", "nbytes"]

logger = logging.getLogger("ft_core.manager")  # heal lines belong with the Manager's step log

MAX_SOURCE_CLIENTS = 4  # heal-source manager clients kept open


def nbytes(obj: Any) -> int:
    """Bytes of the tensors (and array-likes) in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    size = getattr(obj, "nbytes", None)
    return int(size) if isinstance(size, int) else 0


@dataclass
class FetchedHeal:
    """A source's state, fetched this step: loaded at commit, its progress adopted if the step commits."""

    user: dict[str, Any]
    target: rules.HealTarget
    source_replica_rank: int | None
    source: str
    transfer_seconds: float
    nbytes: int
    loaded: bool = False
    load_seconds: float = 0.0

    @property
    def bandwidth_mb_s(self) -> float:
        return self.nbytes / max(self.transfer_seconds, 1e-9) / 1e6


class _Heal(Attempt):
    """The heal in flight: its quorum, its source, and why it was abandoned (None while it goes on)."""

    def __init__(self, quorum_id: int, source: str) -> None:
        super().__init__(quorum_id)
        self.source = source  # the source's replica id


class HealSources:
    """Fetches healed states from sources' manager servers and checkpoint transports."""

    def __init__(self, connect_timeout: timedelta, token: str | None) -> None:
        self._connect_timeout = connect_timeout
        self._token = token
        self._clients: dict[str, ManagerClient] = {}
        self._cancels: QuorumCancels[_Heal] = QuorumCancels(_abandoned_because)

    def lost(self, quorum_id: int, replica_id: str) -> None:
        """The lighthouse dropped `replica_id` from quorum `quorum_id` while this rank's quorum thread still
        works on its quorum (ft_core.redo.on_peer_lost): a heal in that quorum, in flight or starting before
        `forget`, is abandoned. Never blocks (called on a notice thread)."""
        self._cancels.cancel(quorum_id, replica_id)

    def forget(self, quorum_id: int, replica_id: str) -> None:
        """The quorum thread's run that heard this notice ended: later heals are not concerned."""
        self._cancels.forget(quorum_id, replica_id)

    def fetch(self, result: QuorumResult, group_rank: int, transport: Any, timeout: timedelta) -> FetchedHeal:
        """The checkpoint of result.max_step from this rank's source (raises on any failure, and at once
        when the lighthouse says a member of the quorum is lost, `lost`)."""
        rank = result.recover_src_replica_rank
        source = result.replica_ids[rank] if rank is not None and rank < len(result.replica_ids) else ""
        heal = self._cancels.begin(_Heal(result.quorum_id, source or result.recover_src_manager_address))
        try:
            return self._fetch(heal, result, group_rank, transport, timeout)
        except Exception as exc:
            if heal.reason is None or (isinstance(exc, FTError) and str(exc) == heal.reason):
                raise
            raise FTError(heal.reason) from exc
        finally:
            self._cancels.end(heal)

    def _fetch(self, heal: _Heal, result: QuorumResult, group_rank: int, transport: Any,
               timeout: timedelta) -> FetchedHeal:
        started = time.perf_counter()
        heal.check()
        address = result.recover_src_manager_address
        client = self._clients.get(address)
        if client is None:
            if len(self._clients) >= MAX_SOURCE_CLIENTS:  # oldest first; an old channel closes at once
                self._clients.pop(next(iter(self._clients))).close()
            # The heal's deadline bounds the connect too: a source that died after the quorum refuses connections,
            # and gRPC would retry them for the whole connect_timeout (60 s by default) before the heal fails.
            # A PeerLost notice for the quorum ends it sooner (`lost`).
            connect_timeout = min(self._connect_timeout, timeout)
            client = self._clients[address] = ManagerClient(address, connect_timeout, token=self._token,
                                                            stop=heal.stop)
        try:
            heal.check()
            metadata = client.checkpoint_metadata(group_rank, timeout)
        except FTError:
            self._clients.pop(address, None)  # likely dead: drop it (its channel is old, closing is quick)
            client.close()
            raise
        heal.check()
        state = transport.recv_checkpoint(result.recover_src_replica_rank, metadata, result.max_step, timeout)
        heal.check()
        source = f"replica rank {result.recover_src_replica_rank} ({address})"
        if not isinstance(state, dict) or not isinstance(state.get("user"), dict):
            raise CheckpointError(f"checkpoint from {source} is malformed: expected "
                                  f"{{'user': ..., 'ft': {{step, batches_committed}}}}")
        target = rules.heal_target(state.get("ft"), result.max_step, source)
        return FetchedHeal(user=state["user"], target=target, source_replica_rank=result.recover_src_replica_rank,
                           source=address, transfer_seconds=time.perf_counter() - started,
                           nbytes=nbytes(state["user"]))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _abandoned_because(heal: _Heal, lost: str) -> str:
    """A heal's error when the lighthouse says member `lost` of its quorum is gone (its waits end now)."""
    what = "heal source replica group" if lost == heal.source else "replica group"
    return (f"{what} {lost} of quorum {heal.quorum_id} was lost (the lighthouse dropped it): this step's heal is "
            f"abandoned, and done again at the next quorum")


def load_healed_state(heal: FetchedHeal, state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]]
                      ) -> None:
    """Hand each registered load function its part of the healed state (raises on any failure)."""
    started = time.perf_counter()
    missing = sorted(set(state_fns) - set(heal.user))
    if missing:
        raise CheckpointError(f"healed state lacks registered key(s) {missing}; every group must register the same "
                              f"state dict functions")
    for key, (load, _) in state_fns.items():
        load(heal.user[key])
    heal.loaded = True
    heal.load_seconds = time.perf_counter() - started


def apply_heal(heal: FetchedHeal, state_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]],
               report_error: Callable[[Exception], None], emit: Callable[..., None], prefix: str) -> None:
    """Load a fetched heal at commit; a failure is recorded for the step (the group heals again)."""
    try:
        load_healed_state(heal, state_fns)
    except Exception as exc:
        report_error(exc)
        return
    logger.info("%s healed from replica rank %s (%s) to step %d: %d bytes in %.3fs (%.1f MB/s), load %.3fs; "
                "adopted if this step commits", prefix, heal.source_replica_rank, net.describe_route(heal.source),
                heal.target.step, heal.nbytes, heal.transfer_seconds, heal.bandwidth_mb_s, heal.load_seconds)
    emit("heal", source_replica_rank=heal.source_replica_rank, source=heal.source, healed_step=heal.target.step,
         seconds=heal.transfer_seconds + heal.load_seconds, transfer_seconds=heal.transfer_seconds,
         load_seconds=heal.load_seconds, nbytes=heal.nbytes, bandwidth_mb_s=heal.bandwidth_mb_s)


def beside_the_step(transport: Any) -> bool:
    """In async mode a healer sends the identity whatever its state, so the step's collectives need not wait
    for the checkpoint's staging (at its source) or transfer (at the healer): both run beside the step and
    the vote waits for them, with transports that say so (CheckpointTransport.heals_during_the_step)."""
    return bool(getattr(transport, "heals_during_the_step", False))


def await_beside(fut: concurrent.futures.Future, bound_s: float, prefix: str) -> FetchedHeal | None:
    """The staging or heal that ran beside the step, awaited before the vote (bounded); raises its failure."""
    if not concurrent.futures.wait([fut], timeout=bound_s)[0]:
        raise FTTimeoutError(f"{prefix} checkpoint staging or transfer did not finish within {bound_s:.3g}s")
    if fut.cancelled():
        raise FTError(f"{prefix} checkpoint staging or transfer cancelled (the manager is shutting down)")
    return fut.result()
