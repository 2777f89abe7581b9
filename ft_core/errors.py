"""Typed errors for ft-lightning: one root, messages that name the peer, the call and the fix."""

from __future__ import annotations


class FTError(RuntimeError):
    """Root of every error raised by ft-lightning."""


class ConfigError(FTError, ValueError):
    """A setting (argument or FT_* environment variable) is missing or invalid."""


class RPCError(FTError):
    """A control-plane call failed for a reason other than its deadline."""

    def __init__(self, message: str, *, peer: str = "", call: str = "", code: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.call = call
        self.code = code


class AuthError(RPCError):
    """A peer rejected our token, or we rejected theirs."""


class QuorumError(FTError):
    """No quorum could be formed or this replica group is not part of it."""


class CommitError(FTError):
    """Too many consecutive steps failed to commit (see max_retries)."""


class CheckpointError(FTError):
    """A live checkpoint could not be served, fetched or decoded."""


class ProcessGroupError(FTError):
    """A collective or the process group itself failed."""


class FTTimeoutError(FTError, TimeoutError):
    """A deadline passed. Also a builtin TimeoutError so `except TimeoutError` works."""


class JobFinishedError(RPCError, QuorumError):
    """This replica group joined a job that had already finished, at a step behind its end, with no live
    group to heal from: it must not retrain the job alone (docs/guarantees.md, "A group that comes back
    after the end").

    Raised by the Manager's quorum (`should_commit()`, `start_quorum()` in sync mode). Catch it to resume
    from the job's last durable checkpoint (load it so the Manager's step is `finished_step`) or end the
    process; `finished_step`, `step` and `finished_groups` say where the job ended and where this group
    was (None / empty when the message did not carry them)."""

    def __init__(self, message: str, *, peer: str = "", call: str = "", code: str = "OUT_OF_RANGE",
                 finished_step: int | None = None, step: int | None = None,
                 finished_groups: tuple[str, ...] = ()) -> None:
        super().__init__(message, peer=peer, call=call, code=code)
        self.finished_step = finished_step
        self.step = step
        self.finished_groups = finished_groups
