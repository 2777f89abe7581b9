"""Work returned by `Manager.allreduce`: never raises into the loop, continuations run at wait().

The collective itself completes eagerly (its future is chained on the backend's completion
thread and never fails: errors were already recorded with the Manager). When the step lost a peer
and is redone at the wait (ft_core.redo), that future completes only after the redo, with the
redone value, so `wait()` and every continuation see the survivors' result. User continuations
added through `get_future().then(...)` are stored and run lazily in `wait()`, on the stream
that issued the work, so the CPU never blocks on them.

CUDA: the Manager's future is device-aware (ft_core.futures), so `wait()` first makes the issuing
stream wait for the collective and its AVG division, runs the continuations on that stream, then
orders the caller's current stream after them: the result can be read with no synchronize().
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ft_core.futures import completed_future

if TYPE_CHECKING:
    from ft_core.manager import Manager


class ManagedWork(dist.distributed_c10d.Work):
    """A Work over a never-failing future; `.then` continuations run at `wait()`."""

    def __init__(self, manager: "Manager", fut: torch.futures.Future, default: Any) -> None:
        super().__init__()
        self._manager = manager
        self._fut = fut
        self._default = default
        self._callbacks: list[Callable[[torch.futures.Future], Any]] = []
        self._lock = threading.Lock()
        self._done = False
        self._value: Any = None
        self._stream = None  # the stream current when the work was issued (CUDA tensors only)
        self._event: Any = None  # recorded on that stream once the chain has run there
        if isinstance(default, torch.Tensor) and default.is_cuda:
            self._stream = torch.cuda.current_stream(default.device)

    def _add_callback(self, callback: Callable[[torch.futures.Future], Any]) -> None:
        with self._lock:
            if self._done:
                raise RuntimeError("cannot chain a continuation onto a ManagedWork that was already waited on")
            self._callbacks.append(callback)

    def _run(self) -> Any:
        with self._lock:
            if not self._done:
                self._value = self._complete()
                self._done = True
            value = self._value
        if self._event is not None:  # every waiter's stream, on every wait, after the issuing stream's chain
            current = torch.cuda.current_stream(self._stream.device)
            if current != self._stream:
                current.wait_event(self._event)
        return value

    def _complete(self) -> Any:
        if self._stream is None:
            return self._run_callbacks(self._fut.wait())  # never fails; bounded by the Manager's timeout
        with torch.cuda.stream(self._stream):
            value = self._fut.wait()  # the issuing stream now waits for the collective and its division
            value = self._run_callbacks(value)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        return value

    def _run_callbacks(self, value: Any) -> Any:
        for callback in self._callbacks:
            try:
                value = callback(completed_future(value))
            except Exception as exc:  # recorded for the step; the loop keeps going
                self._manager.report_error(exc)
                value = self._default
        return value

    def wait(self, timeout: Any = None) -> bool:
        self._run()
        return True

    def synchronize(self) -> None:
        self._run()

    def block_current_stream(self) -> None:
        self._run()

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def get_future(self) -> "ManagedFuture":
        return ManagedFuture(self)

    def value(self) -> Any:
        return self._run()


class ManagedFuture(torch.futures.Future):
    """The future of a ManagedWork: `then` stores the continuation; `wait`/`value` run the chain.

    Not for handing to C++ (a DDP comm hook must return a real future; ft_core.ddp does).
    """

    def __init__(self, work: ManagedWork) -> None:
        super().__init__()
        self._work = work

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> "ManagedFuture":  # type: ignore[override]
        self._work._add_callback(callback)
        return ManagedFuture(self._work)

    def wait(self) -> Any:
        return self._work._run()

    def value(self) -> Any:
        return self._work._run()

    def done(self) -> bool:
        return self._work.is_completed()


def allreduce_kept(manager: Any, tensor: torch.Tensor, reduce_op: dist.ReduceOp = dist.ReduceOp.AVG) -> Any:
    """`manager.allreduce(tensor, reduce_op, keep_input=True)`, for an input its caller cannot rebuild: a peer
    lost mid-reduction then cannot cost the step (ft_core.redo). A wrapped allreduce with torchft's signature
    (no keep_input) is called without it."""
    allreduce = manager.allreduce
    if _takes(getattr(allreduce, "__func__", allreduce), "keep_input"):  # the function: cached per class
        return allreduce(tensor, reduce_op, keep_input=True)
    return allreduce(tensor, reduce_op)


@functools.lru_cache(maxsize=64)
def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
