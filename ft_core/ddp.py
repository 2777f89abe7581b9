"""Fault-tolerant DDP: gradients are averaged inside the group, then across groups by the Manager.

The comm hook returns a future at once (it never blocks per bucket), so the allreduces overlap
the rest of the backward pass.

Bucket layout. torch DDP starts with one bucket holding every parameter and rebuilds its buckets
after each process's first backward pass, from the order gradients became ready. A group that
joins late (healing) would then run a different layout than its peers at that step, and the
cross-group collectives would mismatch; torchft forces find_unused_parameters=True to prevent
the rebuild, paying a graph walk every step. Here the cross-group traffic does not follow DDP's
buckets at all: `_CanonicalReducer` allreduces the gradients in fixed chunks that every group
derives the same way from the module (reverse parameter order, DDP's own size caps), launched in
chunk order. When a DDP bucket coincides with a chunk (the usual steady state, as DDP's rebuilt
buckets follow the same rule) the bucket buffer is reduced in place with no copy; otherwise the
gradients are copied into the chunk and back. Any DDP setting works, including torch DDP models
built by Lightning or Accelerate (`register_comm_hook`).

The average's division. Gloo has no AVG: the hook's reductions sum shares that every group divides
before sending (Manager.allreduce's `divided_by`), so the sum is the average; every group does so
whatever its loop calls, so all groups agree. A plain `loss.backward()` divides each chunk in one pass
before it is sent (torch DDP without a comm hook fuses that pass into its copy into the bucket; with a
hook it cannot). A backward run under `backward_scale` (our DistributedDataParallel.backward, and the
Lightning, Fabric and Accelerate integrations' backward) multiplies the loss by 1 / (groups x group
ranks) instead: backpropagation is linear in the loss, so its gradients arrive already divided, and the
pass is saved. A redo with fewer groups rescales the sum by old / new (ft_core.redo). A Manager whose
`allreduce` is wrapped without `divided_by` (torchft-style code) gets plain AVG calls, divided after the
sum, as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft_core import futures as ft_futures
from ft_core import redo
from ft_core.errors import FTError
from ft_core.process_groups import ProcessGroupDummy

if TYPE_CHECKING:
    from ft_core.manager import Manager

__all__ = ["DistributedDataParallel", "backward_scale", "register_comm_hook", "canonical_chunks", "reductions_digest",
           "register_reductions"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _takes_divided_by(function: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "divided_by" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _participants(manager: "Manager") -> int:
    """This step's number of participating groups, waiting for its quorum (0 if the quorum failed: the step
    fails anyway, and should_commit raises the quorum's error as always)."""
    try:
        return manager.num_participants()
    except Exception:  # noqa: BLE001 (recorded by the quorum future, raised by the step)
        return 0


def _divides_shares(manager: "Manager") -> bool:
    """Whether `manager.allreduce` takes `divided_by` (a wrapper written for torchft's signature does not)."""
    allreduce = manager.allreduce
    return _takes_divided_by(getattr(allreduce, "__func__", allreduce))


def reducer_parameters(module: torch.nn.Module, ignore: set[str] | frozenset[str] = frozenset()) -> list[torch.Tensor]:
    """The parameters DDP reduces, in DDP's order: per module, trainable, shared ones once."""
    seen: set[int] = set()
    params = []
    for module_name, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if not param.requires_grad or full in ignore or id(param) in seen:
                continue
            seen.add(id(param))
            params.append(param)
    return params


def canonical_chunks(params: list[torch.Tensor], first_cap_bytes: int, cap_bytes: int) -> list[list[int]]:
    """Chunks (lists of indices into `params`) in launch order: reverse parameter order, grouped by
    dtype and device, closed when they reach the cap (the first chunk per kind: first_cap_bytes)."""
    order = list(reversed(range(len(params))))
    if not order:
        return []
    indices, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order],
                                                         [first_cap_bytes, cap_bytes], [False] * len(order),
                                                         list(range(len(order))))
    return [[order[j] for j in chunk] for chunk in indices]


class _Chunk:
    __slots__ = ("params", "offsets", "numel", "buffer", "filled", "launched", "fast", "waiters", "delivered",
                 "finished", "divided")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.offsets: dict[int, int] = {}
        offset = 0
        for p in params:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.numel = offset
        self.buffer: torch.Tensor | None = None
        self.filled = 0
        self.launched = False
        self.fast: torch.Tensor | None = None  # the DDP bucket buffer reduced in place, when layouts match
        self.waiters: list[tuple["_BucketState", list[tuple[torch.Tensor, int, int]]]] = []
        self.delivered: list[tuple[torch.Tensor, int, int]] = []  # bucket views filled from it this step
        self.finished = False  # its reduction was delivered this step
        self.divided = 1.0  # the factor its input was multiplied by before sending, this step (1.0: none)


class _BucketState:
    __slots__ = ("buffer", "future", "remaining", "events")

    def __init__(self, buffer: torch.Tensor, remaining: int) -> None:
        self.buffer = buffer
        # Device-aware (CUDA): DDP's wait() on it orders its stream after the reduction and copies.
        self.future: torch.futures.Future = ft_futures.device_future(ft_futures.devices_of(buffer))
        self.remaining = remaining
        self.events: list[Any] = []  # CUDA: one per chunk finished on another stream than the last

    def chunk_done(self) -> None:
        """Record, on the current stream, that one chunk's copies into this bucket were issued."""
        if self.buffer.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.buffer.device))
            self.events.append(event)

    def complete(self) -> None:
        """Complete the bucket's future on the current stream, ordered after every chunk's copies."""
        if self.events:
            current = torch.cuda.current_stream(self.buffer.device)
            for event in self.events:
                current.wait_event(event)
        self.future.set_result(self.buffer)


class _CanonicalReducer:
    """Cross-group allreduce of gradients in a layout every group derives identically."""

    def __init__(self, manager: "Manager", params: list[torch.Tensor], first_cap_bytes: int, cap_bytes: int,
                 intra_size: int = 1) -> None:
        self._manager = manager
        self._intra_size = intra_size
        self._lock = threading.Lock()
        self._chunks = [_Chunk([params[i] for i in chunk]) for chunk in canonical_chunks(params, first_cap_bytes,
                                                                                          cap_bytes)]
        self._where = {id(p): ci for ci, chunk in enumerate(self._chunks) for p in chunk.params}
        # what this model sends across groups, chunk by chunk: groups whose digests differ would send collectives
        # of different sizes to each other, which Gloo answers by aborting the process (reductions_digest)
        shape = ";".join(f"{c.numel}:{c.params[0].dtype}" for c in self._chunks if c.params)
        self.digest = (sum(c.numel for c in self._chunks), zlib.crc32(shape.encode()))
        self.parameters = frozenset(self._where)  # the same model wrapped again (a second fit) counts once
        self._next = 0
        self.copies = 0  # buckets that needed the copy path (for tests and benchmarks)
        # the parameters' .grad hold this rank's own gradients until DDP's finalize (no bucket views, no
        # intra-group average): a failed reduction's input can be rebuilt from them (ft_core.redo)
        self.restorable = False
        self._divided_by: int | None = None  # this backward's gradients arrive divided by it (backward_scale)
        self._shares = True  # this step's reductions send divided shares (the Manager's allreduce takes divided_by)

    def reset(self, divided_by: int | None = None) -> None:
        shares = _divides_shares(self._manager)
        with self._lock:
            self._divided_by = divided_by
            self._shares = shares
            for chunk in self._chunks:
                chunk.divided = 1.0
                chunk.filled = 0
                chunk.launched = False
                chunk.fast = None
                chunk.waiters = []
                chunk.delivered = []
                chunk.finished = False
            self._next = 0

    def add_bucket(self, buffer: torch.Tensor, params: list[torch.Tensor],
                   grads: list[torch.Tensor] | Callable[[], list[torch.Tensor]]) -> torch.futures.Future:
        """Hand over one DDP bucket's (group-averaged) gradients; the future completes with `buffer`
        holding the cross-group average once every chunk it touches is reduced. `grads` (the bucket's
        views, or a call returning them) is read only when the bucket is not a chunk (the copy path)."""
        with self._lock:
            first = self._chunks[self._where[id(params[0])]] if params and id(params[0]) in self._where else None
            state = _BucketState(buffer, 0)
            if first is not None and buffer.numel() == first.numel and len(params) == len(first.params) \
                    and all(a is b for a, b in zip(params, first.params)):  # the bucket is the chunk: no copy
                first.fast = buffer
                first.filled = first.numel
                first.waiters.append((state, []))
                state.remaining = 1
            else:
                try:
                    chunk_ids = [self._where[id(p)] for p in params]
                except KeyError:
                    raise FTError("a DDP bucket holds a parameter this fault-tolerant hook does not know; build the "
                                  "hook from the same module DDP wraps (parameters_to_ignore must match)") from None
                self.copies += 1
                if callable(grads):
                    grads = grads()
                per_chunk: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
                for p, g, ci in zip(params, grads, chunk_ids):
                    chunk = self._chunks[ci]
                    if chunk.buffer is None or chunk.buffer.dtype != g.dtype or chunk.buffer.device != g.device:
                        chunk.buffer = torch.empty(chunk.numel, dtype=g.dtype, device=g.device)
                    offset = chunk.offsets[id(p)]
                    chunk.buffer[offset:offset + g.numel()].copy_(g.reshape(-1))
                    chunk.filled += g.numel()
                    per_chunk.setdefault(ci, []).append((g, offset, g.numel()))
                state.remaining = len(per_chunk)
                for ci, views in per_chunk.items():
                    chunk = self._chunks[ci]
                    chunk.waiters.append((state, views))
            launch = []
            while self._next < len(self._chunks) and self._chunks[self._next].filled == self._chunks[self._next].numel:
                chunk = self._chunks[self._next]
                chunk.launched = True
                launch.append(chunk)
                self._next += 1
        for chunk in launch:  # in chunk order: every group issues the same sequence of collectives
            self._launch(chunk)
        return state.future

    def _launch(self, chunk: _Chunk) -> None:
        tensor = chunk.fast if chunk.fast is not None else chunk.buffer
        assert tensor is not None
        divided = self._divided_by
        if divided is None:  # a plain backward: this group's share is divided here, in one pass, before it is sent
            if self._shares:
                divided = _participants(self._manager)
                chunk.divided = 1.0 / (divided * self._intra_size) if divided else 1.0
            else:  # AVG divides by the groups after the sum
                chunk.divided = 1.0 / self._intra_size
            if chunk.divided != 1.0:
                tensor.mul_(chunk.divided)  # by the reciprocal, as DDP scales (cheaper than a division)
        on_redo = getattr(self._manager, "on_redo", None)  # a redone step rewrites the gradients (ft_core.redo)
        if on_redo is not None:  # said before issuing: a failure right after it must find the restore
            on_redo(tensor, lambda chunk=chunk, tensor=tensor: self._rewrite_grads(chunk, tensor),
                    (lambda chunk=chunk, tensor=tensor: self._restore_input(chunk, tensor)) if self.restorable
                    else None, next_reduction=True)
        # the public call, so a wrapped or overridden Manager.allreduce is honoured; a ManagedWork's own
        # future completes eagerly (its get_future() defers continuations to wait())
        work = self._manager.allreduce(tensor, ReduceOp.AVG, divided_by=divided) if divided else \
            self._manager.allreduce(tensor, ReduceOp.AVG)
        fut = getattr(work, "_fut", None) or work.get_future()
        fut.add_done_callback(lambda _f, chunk=chunk: self._finish(chunk))

    def _restore_input(self, chunk: _Chunk, tensor: torch.Tensor) -> bool:
        """Refill `tensor` with the chunk's local gradients (divided as when first sent), to reduce it again
        (ft_core.redo). Only while the chunk is not delivered: DDP's finalize copies a bucket's results into
        .grad once its future is done, so until then .grad holds this rank's own gradients."""
        with self._lock:
            if chunk.finished:
                return False
        if any(p.grad is None for p in chunk.params):  # checked first: a False leaves `tensor` as it was
            return False
        for p in chunk.params:
            offset = chunk.offsets[id(p)]
            torch.mul(p.grad.reshape(-1), chunk.divided, out=tensor[offset:offset + p.numel()])
        return True

    def _rewrite_grads(self, chunk: _Chunk, tensor: torch.Tensor) -> None:
        """After a redo reduced `tensor` (the chunk's flat gradients) again: copy it into the bucket views
        already filled from it (DDP's finalize copies those into .grad) and into the gradients."""
        with self._lock:
            delivered = list(chunk.delivered)
        for grad, offset, numel in delivered:
            grad.copy_(tensor[offset:offset + numel].view_as(grad))
        for p in chunk.params:
            if p.grad is not None:
                offset = chunk.offsets[id(p)]
                p.grad.copy_(tensor[offset:offset + p.numel()].view_as(p.grad))

    def _finish(self, chunk: _Chunk) -> None:
        with self._lock:
            waiters, chunk.waiters = chunk.waiters, []
            chunk.finished = True
            if chunk.fast is None:
                chunk.delivered.extend(v for _state, views in waiters for v in views)
        done = []
        for state, views in waiters:
            if chunk.fast is None:
                assert chunk.buffer is not None
                for grad, offset, numel in views:
                    grad.copy_(chunk.buffer[offset:offset + numel].view_as(grad))
            with self._lock:
                state.remaining -= 1
                if state.remaining == 0:
                    done.append(state)
                else:  # another chunk completes the bucket, maybe on another stream: it waits for ours
                    state.chunk_done()
        for state in done:
            state.complete()


class _HookState:
    def __init__(self, manager: "Manager", reducer: _CanonicalReducer, intra_group_pg: Any, intra_size: int) -> None:
        self.manager = manager
        self.reducer = reducer
        self.intra_group_pg = intra_group_pg
        self.intra_size = intra_size
        self.divided_by: int | None = None  # set by backward_scale for the backward it wraps


_HOOKS: "weakref.WeakKeyDictionary[Manager, weakref.WeakSet[_HookState]]" = weakref.WeakKeyDictionary()
# what other users of `Manager.allreduce` reduce (LocalSGD, DiLoCo's fragments), by owner, while the owner lives
_OTHERS: "weakref.WeakKeyDictionary[Manager, weakref.WeakKeyDictionary[Any, tuple[frozenset[int], tuple[int, int]]]]" \
    = weakref.WeakKeyDictionary()


def register_reductions(manager: "Manager", owner: Any, tensors: list[torch.Tensor], layout: str = "") -> None:
    """Count `tensors` (what `owner` reduces across groups with `manager.allreduce`, in this order, packed as
    `layout` says) in `manager`'s reductions digest for as long as `owner` lives."""
    shape = ";".join(f"{t.numel()}:{t.dtype}" for t in tensors) + layout
    entry = (frozenset(id(t) for t in tensors), (sum(t.numel() for t in tensors), zlib.crc32(shape.encode())))
    _OTHERS.setdefault(manager, weakref.WeakKeyDictionary())[owner] = entry


def reductions_digest(manager: "Manager") -> str:
    """What `manager`'s fault-tolerant DDP models (and LocalSGD, DiLoCo) reduce across groups, in short
    ("3680522 values (1a2b3c4d)"; "" with none yet): sent with each quorum request, so a quorum mixing groups
    whose models (or bucket sizes) differ is refused naming them (ft_core.control.recovery) instead of running
    mismatched collectives. The same tensors registered twice (a model wrapped again) count once."""
    entries = {state.reducer.parameters: state.reducer.digest for state in list(_HOOKS.get(manager, ()))}
    entries.update(list(_OTHERS.get(manager, {}).values()))
    digests = sorted(entries.values())
    if not digests:
        return ""
    return f"{sum(n for n, _ in digests)} values ({zlib.crc32(repr(digests).encode()):08x})"


@contextlib.contextmanager
def backward_scale(manager: "Manager") -> Iterator[float]:
    """Multiply the loss by the value yielded and run backward inside: the gradients of `manager`'s
    fault-tolerant DDP models then arrive divided for the average, and the step skips the separate
    division pass (see the module's docstring). Waits for this step's quorum, as the first reduction
    would. Yields 1.0 (and changes nothing) when no such model is registered, the quorum failed (the
    step will not commit), the models' groups differ in size or `manager.allreduce` is wrapped without
    `divided_by`. Every backward of one step must run inside it, or none: gradients accumulated under
    no_sync from a plain backward would not be divided."""
    states = list(_HOOKS.get(manager, ()))
    sizes = {state.intra_size for state in states}
    n = _participants(manager) if len(sizes) == 1 and _divides_shares(manager) else 0
    if n <= 0:
        yield 1.0
        return
    for state in states:
        state.divided_by = n
    try:
        yield 1.0 / (n * sizes.pop())
    finally:
        for state in states:
            state.divided_by = None


def _ft_comm_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average inside the group (async), then across groups; returns at once."""
    divided = state.divided_by
    if bucket.index() == 0:
        state.reducer.reset(divided)
    buffer = bucket.buffer()
    params = bucket.parameters()
    if state.intra_size <= 1:  # the bucket's gradient views are built only if it takes the copy path
        return state.reducer.add_bucket(buffer, params, bucket.gradients)
    grads = bucket.gradients()

    out = ft_futures.device_future(ft_futures.devices_of(buffer))  # DDP's wait() orders its stream after it

    def cross(fut: torch.futures.Future) -> None:
        try:
            fut.value()  # the group's sum: divided with the groups' (_CanonicalReducer._launch), or by the loss
        except Exception as exc:  # recorded; the bucket still goes through so collectives stay aligned
            state.manager.report_error(exc)
        try:
            inner = state.reducer.add_bucket(buffer, params, grads)
        except Exception as exc:
            state.manager.report_error(exc)
            out.set_result(buffer)
            return
        inner.add_done_callback(lambda _f: out.set_result(buffer))

    try:
        work = dist.all_reduce(buffer, op=ReduceOp.SUM, group=state.intra_group_pg, async_op=True)
        work.get_future().add_done_callback(cross)
    except Exception as exc:
        state.manager.report_error(exc)
        cross(ft_futures.completed_future(buffer))
    return out


# torch checks the hook's annotations as objects; this module uses postponed (string) annotations.
_ft_comm_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


def _began(manager: "Manager", module: Any, args: Any) -> None:
    """A training forward (grad enabled) of the wrapped model: the step began (ft_core.redo.began)."""
    if torch.is_grad_enabled():
        redo.began(manager)


def _default_intra_group_pg() -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, manager: "Manager",
                       intra_group_pg: Any = None) -> None:
    """Install the fault-tolerant comm hook on an existing torch DDP model (Lightning, Accelerate).

    intra_group_pg: the group's own process group (default: torch's default group when it has
    more than one rank); gradients are averaged on it first, then across groups via the Manager.
    With the model's `broadcast_buffers` (DDP's default, True) its buffers are made identical on every
    group before each vote (Manager.register_buffers); pass broadcast_buffers=False to DDP to opt out.
    """
    if intra_group_pg is None:
        intra_group_pg = _default_intra_group_pg()
    if intra_group_pg is not None and dist.get_world_size(intra_group_pg) <= 1:
        intra_group_pg = None
    config = getattr(ddp_model, "_bucket_config", None)
    cap = getattr(ddp_model, "bucket_bytes_cap", 25 * 1024 * 1024)
    first_cap = getattr(config, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES)
    params = reducer_parameters(ddp_model.module, set(getattr(ddp_model, "parameters_to_ignore", ())))
    intra_size = dist.get_world_size(intra_group_pg) if intra_group_pg is not None else 1
    reducer = _CanonicalReducer(manager, params, first_cap, cap, intra_size)
    reducer.restorable = intra_group_pg is None and not getattr(ddp_model, "gradient_as_bucket_view", False)
    state = _HookState(manager, reducer, intra_group_pg, intra_size)
    ddp_model.register_comm_hook(state, _ft_comm_hook)
    ddp_model.register_forward_pre_hook(functools.partial(_began, manager))
    _HOOKS.setdefault(manager, weakref.WeakSet()).add(state)
    ddp_model._ft_hook_state = state  # type: ignore[attr-defined]
    module = ddp_model.module
    # DDP's own semantics, now across groups too; like DDP (which lists the buffers once, when it wraps),
    # a module with no buffers then has none to sync: no per-step walk of its modules.
    if getattr(ddp_model, "broadcast_buffers", True) and any(True for _ in module.buffers()):
        manager.register_buffers(module, lambda: list(module.buffers()))


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch DDP whose gradients go through `manager.allreduce` (inside the group first when the
    group has several ranks)."""

    def __init__(self, manager: "Manager", module: torch.nn.Module, intra_group_pg: Any = None,
                 **ddp_kwargs: Any) -> None:
        if intra_group_pg is None:
            intra_group_pg = _default_intra_group_pg()
        if intra_group_pg is None:
            process_group: Any = ProcessGroupDummy()
        else:
            process_group = intra_group_pg
        super().__init__(module, process_group=process_group, **ddp_kwargs)
        self.manager = manager
        register_comm_hook(self, manager, intra_group_pg)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward(**kwargs)`, with the average's division done by the loss (`backward_scale`): one
        pass over the gradients less per step than a plain `loss.backward()`, which also works."""
        with backward_scale(self.manager) as scale:
            (loss if scale == 1.0 else loss * scale).backward(**kwargs)
