"""The interface every checkpoint transport implements: how a healing replica gets a live peer's state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(ABC, Generic[T]):
    """Moves one step's state dict from a source replica to healing replicas.

    The source calls `send_checkpoint` (it may return before the bytes move) and, before it next
    mutates the state, `disallow_checkpoint`; a receiver calls `recv_checkpoint` with the source's
    `metadata()` string, which it learned through the quorum.
    """

    #: True when `recv_checkpoint` uses no process group and a source keeps serving a staged step after
    #: `disallow_checkpoint` (for the receivers' timeout): in async mode the staging and the transfer then
    #: run beside the step's collectives (a healer sends the identity anyway), and only the votes wait for them.
    heals_during_the_step: bool = False

    @abstractmethod
    def metadata(self) -> str:
        """The address a peer passes to `recv_checkpoint` to reach this transport."""

    @abstractmethod
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Offer `state_dict` as the state at `step` to `dst_ranks`."""

    def disallow_checkpoint(self) -> None:
        """Stop offering the staged state; after this returns the caller may mutate it."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetch the state at `step` from the source at `metadata` (rank `src_rank`), within `timeout`."""

    def drain(self) -> bool:
        """Before a shutdown with wait: finish serving what healers still fetch (bounded by their deadline);
        True when nothing is left. Transports without heals beside the step have nothing to finish."""
        return True

    def shutdown(self, wait: bool = True) -> None:
        """Release servers, threads and buffers."""

    def __enter__(self) -> CheckpointTransport[T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown(wait=True)


def seconds(value: timedelta | float) -> float:
    """A timeout argument as seconds (timedelta or a number)."""
    return value.total_seconds() if isinstance(value, timedelta) else float(value)
