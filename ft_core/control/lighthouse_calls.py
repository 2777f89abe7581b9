"""A Quorum call waiting in the lighthouse (`Waiter`), and an issued quorum's answer (`Issued`), serialized
once for all its participants, on either wire (a unary call, or a heartbeat stream's message).

ft_core.control.lighthouse_state decides and sets a waiter's outcome under its lock; ft_core.control.lighthouse
sends it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ft_core.control.proto import ft_pb2
from ft_core.control.types import Quorum, QuorumMember

__all__ = ["Issued", "Waiter"]


class Issued:
    """An issued quorum and its response, serialized once for all its participants."""

    __slots__ = ("_lock", "_response", "_stream_field", "quorum")

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self._lock = threading.Lock()
        self._response: bytes | None = None
        self._stream_field: bytes | None = None

    def response(self) -> bytes:
        """The unary Quorum answer (a LighthouseQuorumResponse)."""
        with self._lock:
            if self._response is None:
                self._response = ft_pb2.LighthouseQuorumResponse(quorum=self.quorum.to_pb()).SerializeToString()
            return self._response

    def stream_response(self, request_id: int) -> bytes:
        """The answer on a heartbeat stream: a LighthouseHeartbeatResponse for `request_id`.

        Serialized messages concatenate into their merge, so only the few bytes of the request id are
        encoded per member; the quorum_response field (the quorum itself) is encoded once."""
        field = self._stream_field
        if field is None:
            payload = self.response()
            with self._lock:
                if self._stream_field is None:
                    self._stream_field = ft_pb2.LighthouseHeartbeatResponse(
                        quorum_response=payload).SerializeToString()
                field = self._stream_field
        return _request_id_field(request_id) + field


def _request_id_field(request_id: int) -> bytes:
    """LighthouseHeartbeatResponse.request_id (field 2, varint) on the wire, without building a message."""
    if request_id <= 0:
        return b""  # proto3 leaves a zero out
    out = bytearray(b"\x10")
    while request_id > 0x7F:
        out.append((request_id & 0x7F) | 0x80)
        request_id >>= 7
    out.append(request_id)
    return bytes(out)


class Waiter:
    """One in-flight Quorum call; `wake` is called (under the core's lock) once it has an answer or must end."""

    __slots__ = ("excluded", "issued", "member", "redirect", "refusal", "wake")

    def __init__(self, member: QuorumMember, wake: Callable[[], None]) -> None:
        self.member = member
        self.issued: Issued | None = None
        self.refusal: str | None = None  # set instead of waiting: the job finished ahead of it (job_end)
        self.excluded: str | None = None  # set instead of waiting: shrink-only outside the last quorum (rule 2)
        self.redirect: str | None = None  # set instead of waiting: this lighthouse stands by (lighthouse_peers)
        self.wake = wake
