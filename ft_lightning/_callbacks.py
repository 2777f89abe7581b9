"""Callbacks, loggers and metrics over the live quorum, for the Trainer strategy.

Lightning's own world is one replica group. This module widens what Lightning's callbacks decide
together to the live replica groups, as plain DDP would over its whole world:

- `reduce` (`self.log(..., sync_dist=True)`) and `reduce_boolean_decision` (ModelCheckpoint's
  top-k and file-exists checks, EarlyStopping's stop) are reduced inside the group first (Lightning's
  own process group), then across the groups of the last quorum:
  * inside `training_step` (between the quorum and the vote) through the Manager's allreduce, part
    of the step: a failure fails the step, which then does not commit;
  * between steps, at the points every group of the quorum reaches in the same order whatever its
    own commits (validation, which runs at the same batch on every group, and the end of a training
    epoch), on the Manager's cross-group process group directly, bounded by `timeout` and checked
    (every group must be at the same step and call the same reduction). When it cannot be made (no
    quorum yet, a peer lost, the deadline passed, a mismatch), the answer is the group's own value
    (the in-group reduction) and the process group is aborted, so the Manager rebuilds it at the next
    quorum (that step fails and is retried). The safe local answer never blocks a step;
  * anywhere else (`on_train_batch_end`, `on_before_optimizer_step`, ..., e.g.
    `ModelCheckpoint(every_n_train_steps=)`): the group's own value. There a group whose step did not
    commit while the others' did is one global_step behind until its next quorum heals it (and a
    group resumed from its own checkpoint saves again), so its callbacks may reduce when the others'
    do not, and a reduction of ours would be paired with another group's gradient allreduce.
- `broadcast` and `barrier` with `rank_zero="quorum"` (the default; with "group" each group is its own rank zero, so
  they stay in the group), at the same sync points: the leader group's value (JSON values only, as UTF-8
  bytes in a tensor after a checked header round; never pickled, anything else stays in the group with
  a warning once) and a checked barrier every live group must reach within `timeout`, failing open (the
  process group aborted, as for reductions). Lightning's set-up and data-loading barriers stay in-group.
- `gather`: torchmetrics states across the live groups at a training epoch's end (ft_lightning/_metrics.py).
- "rank zero" with `rank_zero="quorum"` (the default): `trainer.is_global_zero` and Lightning's `rank_zero_only`
  functions (loggers, `rank_zero_info`) are true on group rank 0 of the group with participating
  rank 0 in the last quorum (the live participating group with the lowest replica rank), so one
  process writes each checkpoint file and each log line. Before the first quorum it is group rank 0
  of replica group 0 unless the group was restarted (FT_RESTART_COUNT > 0). Checkpoints then go to one
  folder shared by the groups (ft_lightning/_dirs.py); logs stay in each group's folder.
- ModelCheckpoint's state (best score, top-k, paths, the step it last saved) is sent to a healing
  group with `rank_zero="quorum"`; paths under the source's directory are rewritten to the same
  names under the healed group's directory (identical when the checkpoint directory is shared).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from ft_core import futures as ft_futures
from ft_core import settings as ft_settings
from ft_core.managed_work import allreduce_kept

logger = logging.getLogger(__name__)

_KIND = {"reduction": 1, "decision": 2, "broadcast": 3, "barrier": 4, "gather": 5}
_OPCODES = {"sum": 1, "mean": 2, "max": 3, "min": 4, "gather": 5}
_SLOTS = 64  # every checked reduction between steps sends exactly this many float64 values
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
MAX_BROADCAST_BYTES = 1 << 20  # a broadcast value across groups is at most this much JSON
_JSON_DEPTH = 32


def _json_value(obj: Any, depth: int = 0) -> bool:
    """Whether `obj` comes back from JSON as the same value and type: str, int, float, bool, None, and
    lists and str-keyed dicts of them (a tuple or a Path would come back as another type)."""
    if obj is None or type(obj) in (str, int, bool):
        return True
    if type(obj) is float:
        return math.isfinite(obj)
    if depth >= _JSON_DEPTH:
        return False
    if type(obj) is list:
        return all(_json_value(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return all(type(k) is str and _json_value(v, depth + 1) for k, v in obj.items())
    return False


def json_payload(obj: Any) -> tuple[bytes | None, str]:
    """`obj` as the UTF-8 JSON a broadcast carries across groups, or (None, why not)."""
    if not _json_value(obj):
        return None, (f"a {type(obj).__name__} is not a JSON value (str, finite numbers, bools, None, lists and "
                      f"str-keyed dicts of them, at most {_JSON_DEPTH} deep); values are never pickled across groups")
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) > MAX_BROADCAST_BYTES:
        return None, f"its JSON is {len(data)} bytes, over the {MAX_BROADCAST_BYTES} a cross-group broadcast carries"
    return data, ""


# Lightning's barriers that order a group's own set-up and data loading: a group that restarted reaches
# them at other times than the others, so they never cross groups.
_GROUP_BARRIERS = frozenset({"pre_setup", "post_setup", "run-stage", "_CheckpointConnector.resume_end",
                             "download_model_from_registry"})


def crosses_groups(barrier_name: str | None) -> bool:
    """Whether a barrier of this name spans the live groups at a sync point (a user's, ModelCheckpoint's and
    `Trainer.save_checkpoint`'s do; Lightning's set-up and `*_dataloader()` barriers stay in the group)."""
    return barrier_name is None or not (barrier_name in _GROUP_BARRIERS or barrier_name.endswith("_dataloader()"))


def reduce_op_name(reduce_op: Any) -> str | None:
    """Lightning's reduce_op (None, "mean"/"avg"/"sum"/"max"/"min", or a ReduceOp) as one of _OPS (None: unsupported)."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return "mean" if name in ("mean", "avg") else name if name in _OPS else None
    return next((name for name, op in _OPS.items() if reduce_op == op), None)


def static_leader(replica_group_id: int, group_rank: int) -> bool:
    """Rank zero before the first quorum: group rank 0 of replica group 0, unless that group was restarted."""
    return replica_group_id == 0 and group_rank == 0 and ft_settings.value("FT_RESTART_COUNT") <= 0


def set_rank_zero(leader: bool, group_rank: int) -> None:
    """Point Lightning's `rank_zero_only` (one object shared by lightning.pytorch, lightning.fabric,
    pytorch_lightning and lightning_utilities) at this process's role."""
    rank_zero_only.rank = 0 if leader else max(1, group_rank)


class LiveQuorum:
    """Reductions over the live groups and who is rank zero (see the module docstring)."""

    def __init__(self, manager: Any, pg: Any, *, group_rank: int, replica_group_id: int, timeout_s: float,
                 in_step: Callable[[], bool], at_sync_point: Callable[[], bool]) -> None:
        self._manager = manager
        self._pg = pg
        self._group_rank = group_rank
        self._timeout_s = timeout_s
        self._in_step = in_step
        self._at_sync_point = at_sync_point
        self._told_local = False
        self._voted = False  # a quorum has been formed: the process group spans the live groups
        self.leader = static_leader(replica_group_id, group_rank)
        self.leader_group = False  # this group has participating rank 0 in the last quorum
        self.fallbacks = 0  # reductions answered locally (for tests and logs)
        self.crossed = 0  # collectives between steps made across more than one group (for tests and logs)
        self._told_broadcast: set[str] = set()
        self._members = 1  # members of the last checked reduction's process group

    def after_vote(self) -> None:
        """This step's quorum is known: rank zero is participating rank 0's group rank 0."""
        try:
            rank = self._manager.participating_rank()
        except Exception:  # noqa: BLE001 - the quorum failed: this group is in no live quorum
            rank = None
        self._voted = True
        self.leader_group = rank == 0
        self.leader = rank == 0 and self._group_rank == 0

    def reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor | None:
        """`tensor` (already reduced in the group) reduced across the live groups, or None (keep the local value)."""
        if self._in_step():
            return self._managed(tensor, op)
        return self._direct(tensor, op, "reduction")

    def decide(self, decision: bool, all_: bool) -> bool | None:
        """A boolean decision (already made in the group) across the live groups, or None."""
        value = torch.tensor([1.0 if decision else 0.0], dtype=torch.float64)
        if self._in_step():
            out = self._managed(value, "min" if all_ else "max")
            return None if out is None else bool(out.reshape(-1)[0].item() > 0.5)
        out = self._direct(value, "sum", "decision")
        if out is None:
            return None
        votes, n = float(out.reshape(-1)[0].item()), self._members
        return votes >= n - 0.5 if all_ else votes > 0.5

    def broadcast(self, obj: Any) -> tuple[bool, Any]:
        """(True, the leader group's `obj`) at a sync point, where every live group broadcasts (each group's
        `obj` is already its own rank zero's); (False, None) elsewhere or when it cannot be made. Two checked
        rounds: a header (who is the leader, the length, whether every group's value is JSON), then the
        leader's JSON bytes, summed with zeros from the others. Nothing is pickled."""
        payload, why = json_payload(obj)
        length = float(len(payload)) if payload is not None and self.leader_group else 0.0
        header = torch.tensor([1.0 if self.leader_group else 0.0, length, 0.0 if payload is not None else 1.0],
                              dtype=torch.float64)
        deadline = time.monotonic() + self._timeout_s
        summed = self._direct(header, "sum", "broadcast")
        if summed is None or self._members == 1:
            return False, None
        leaders, length, unfit = (int(round(float(v))) for v in summed.tolist())
        if unfit:
            self._tell_once(why or "another group's value is not a JSON value", "stays inside each group")
            return False, None
        if leaders != 1:  # every member sees the same sums: all keep their own value, the group stays usable
            self._fallback(f"{leaders} groups claimed to be rank zero's for a broadcast")
            return False, None
        pg = self._pg
        device = self._device(pg, torch.device("cpu"))
        data = torch.zeros(max(length, 1), dtype=torch.uint8, device=device)
        if self.leader_group and payload:
            data[:length] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if not self._exchange(pg, data, max(0.0, deadline - time.monotonic()), "cross-group broadcast"):
            return False, None
        try:
            return True, json.loads(data[:length].cpu().numpy().tobytes().decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # the same bytes on every member: all answer locally
            self._fallback(f"the broadcast value could not be decoded ({exc})")
            return False, None

    def barrier(self) -> bool:
        """At a sync point: a checked reduction every live group must reach, bounded by the timeout; False
        (logged, the process group aborted, nothing wedged) when it is not made or not at a sync point."""
        return self._direct(torch.ones(1, dtype=torch.float64), "sum", "barrier") is not None

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every live group's `tensor` (this group's among them, in member order), or None (keep the local
        value). Two checked rounds: each member's first-dimension size and a code of its dtype and other
        dimensions (they must agree), then the tensors at their offsets, summed with zeros."""
        wire = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype
        rows = int(tensor.shape[0]) if tensor.dim() else 1
        trailing = tuple(tensor.shape[1:]) if tensor.dim() else ()
        code = float(zlib.crc32(f"{wire}|{trailing}|{tensor.dim() == 0}".encode()))
        deadline = time.monotonic() + self._timeout_s
        header = self._direct(torch.tensor([float(rows), code], dtype=torch.float64), "gather", "gather")
        if header is None:
            return None
        if self._members == 1:
            return [tensor]
        sizes = [int(v) for v in header[:, 0].tolist()]
        if len(set(header[:, 1].tolist())) != 1:  # the same on every member: all answer locally
            self._fallback("the groups' metric states differ in dtype or shape")
            return None
        pg = self._pg
        me = int(pg.rank())
        device = self._device(pg, tensor.device)
        data = torch.zeros((sum(sizes), *trailing), dtype=wire, device=device)
        start = sum(sizes[:me])
        data[start:start + rows] = tensor.detach().reshape(rows, *trailing).to(device=device, dtype=wire)
        if not self._exchange(pg, data, max(0.0, deadline - time.monotonic()), "cross-group gather"):
            return None
        out, offset = [], 0
        for size in sizes:
            part = data[offset:offset + size].to(device=tensor.device, dtype=tensor.dtype)
            out.append(part.reshape(tensor.shape) if tensor.dim() == 0 else part)
            offset += size
        return out

    def _tell_once(self, why: str, what: str) -> None:
        if why not in self._told_broadcast:
            self._told_broadcast.add(why)
            logger.warning("ft_lightning: a broadcast across the replica groups %s: %s", what, why)

    # ---- inside a step: part of the step's reductions ------------------------------------------

    def _managed(self, tensor: torch.Tensor, op: str) -> torch.Tensor | None:
        work = tensor.detach().double() if op == "mean" and not tensor.is_floating_point() else tensor.detach().clone()
        try:
            pending = allreduce_kept(self._manager, work, _OPS[op])  # kept: a redo (ft_core.redo) reduces it again
            pending.wait()
        except Exception as exc:  # noqa: BLE001 - any failure: the local answer (the step fails on its own)
            self._fallback(f"the step's reduction raised {exc!r}")
            return None
        error = self._manager.errored()
        if error is not None:  # the step will not commit either
            self._fallback(f"the step failed ({error})")
            return None
        return work.to(tensor.dtype) if work.dtype != tensor.dtype and op != "mean" else work

    # ---- between steps: on the cross-group process group, checked and bounded ------------------

    def _direct(self, tensor: torch.Tensor, op: str, kind: str) -> torch.Tensor | None:
        """One SUM allreduce of a fixed-size buffer: [tag, size, payload...]. The tag names the kind, the
        op and the step, so members at different reductions or steps see a sum that is not n times their
        own and all answer locally; the size never varies, so a mispaired call cannot break the group
        (max/min gather each member's values into its own slots)."""
        if not self._voted:
            return None  # no quorum yet (sanity check, set-up): the group's own value, silently
        if not self._at_sync_point():
            if not self._told_local:
                self._told_local = True
                logger.info("ft_lightning: a %s outside training_step, validation and epoch ends (e.g. in "
                            "on_train_batch_end) is made inside the group only", kind)
            return None
        pg = self._pg
        try:
            broken = pg.errored()
            n, me = int(pg.size()), int(pg.rank())
        except Exception as exc:  # noqa: BLE001 - not configured: the local answer
            broken, n, me = exc, 0, 0
        if broken is not None or n < 1:
            self._fallback(f"the cross-group process group is not usable ({broken})")
            return None
        self._members = n
        if n == 1:
            return tensor
        flat = tensor.detach().reshape(-1)
        k = flat.numel()
        gather = op in ("max", "min", "gather")
        if 2 + (n * k if gather else k) > _SLOTS:
            self._fallback(f"{k} values x {n} groups do not fit one checked reduction ({_SLOTS - 2} slots)")
            return None
        device = self._device(pg, tensor.device)
        tag = float((_KIND[kind] * 8 + _OPCODES[op]) * 10_000_000 + int(self._manager.current_step()) % 10_000_000)
        buf = torch.zeros(_SLOTS, dtype=torch.float64, device=device)
        buf[0], buf[1] = tag, float(k)
        start = 2 + (me * k if gather else 0)
        buf[start:start + k] = flat.to(device=device, dtype=torch.float64)
        if not self._exchange(pg, buf, self._timeout_s, f"cross-group {kind}"):
            return None
        if (float(buf[0].item()), float(buf[1].item())) != (n * tag, float(n * k)):
            self._abort(f"the groups were not at the same reduction (this group: {op} {kind} at step "
                        f"{self._manager.current_step()})")
            return None
        self.crossed += 1
        if gather:
            values = buf[2:2 + n * k].reshape(n, k)
            if op == "gather":  # every member's values, in member order
                return values.clone()
            out = values.max(dim=0).values if op == "max" else values.min(dim=0).values
        else:
            out = buf[2:2 + k] / n if op == "mean" else buf[2:2 + k]
        out = out.reshape(tensor.shape)
        if op != "mean" or tensor.is_floating_point():
            out = out.to(tensor.dtype)
        return out.to(tensor.device)

    @staticmethod
    def _device(pg: Any, device: torch.device) -> torch.device:
        return device if "nccl" in str(pg.getBackendName()).lower() else torch.device("cpu")

    def _exchange(self, pg: Any, buf: torch.Tensor, timeout_s: float, what: str) -> bool:
        """One SUM allreduce of `buf` in place, bounded by `timeout_s`; on failure the group is aborted."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        try:
            ft_futures.future_wait(pg.allreduce([buf], opts).get_future(), timeout_s, what=what)
        except Exception as exc:  # noqa: BLE001 - a lost peer, the deadline: the local answer
            self._abort(f"{what} failed: {exc}")
            return False
        return True

    def _abort(self, why: str) -> None:
        self._fallback(why)
        try:
            self._pg.abort()  # no collective of ours left in flight; the Manager rebuilds it at the next quorum
        except Exception as exc:  # noqa: BLE001 - best effort: the next configure rebuilds it anyway
            logger.info("ft_lightning: aborting the cross-group process group failed: %s", exc)

    def _fallback(self, why: str) -> None:
        self.fallbacks += 1
        logger.warning("ft_lightning: a reduction, broadcast or barrier over the live replica groups was not made "
                       "(%s); this group uses its own value", why)


# ---- ModelCheckpoint's state for a healing group ---------------------------------------------------

def checkpoint_state(callback: Any) -> dict[str, Any]:
    """What a healing group takes over from a ModelCheckpoint: its state_dict and the step it last saved."""
    state = dict(callback.state_dict())
    for key in ("best_model_score", "current_score", "kth_value"):  # tensors (or None) -> floats
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            state[key] = float(value.item())
    state["best_k_models"] = {str(k): float(v.item()) if isinstance(v, torch.Tensor) else float(v)
                              for k, v in (state.get("best_k_models") or {}).items()}
    state["dirpath"] = os.fspath(state["dirpath"]) if state.get("dirpath") is not None else None
    state["_last_global_step_saved"] = int(getattr(callback, "_last_global_step_saved", 0))
    state["_last_checkpoint_saved"] = str(getattr(callback, "_last_checkpoint_saved", "") or "")
    return state


def load_checkpoint_state(callback: Any, state: dict[str, Any]) -> None:
    """Take over the source's ModelCheckpoint state, its paths moved into this callback's directory."""
    src = state.get("dirpath")
    own = os.fspath(callback.dirpath) if callback.dirpath is not None else None

    def moved(path: Any) -> Any:
        if not path or src is None or own is None or src == own:
            return path
        rel = os.path.relpath(os.fspath(path), src)
        return os.path.join(own, rel) if not rel.startswith("..") else path

    def tensor(value: Any) -> Any:
        return None if value is None else torch.tensor(float(value))

    callback.best_model_score = tensor(state.get("best_model_score"))
    callback.current_score = tensor(state.get("current_score"))
    callback.kth_value = tensor(state.get("kth_value")) if state.get("kth_value") is not None else callback.kth_value
    callback.best_k_models = {moved(k): torch.tensor(v) for k, v in (state.get("best_k_models") or {}).items()}
    callback.best_model_path = moved(state.get("best_model_path", ""))
    callback.kth_best_model_path = moved(state.get("kth_best_model_path", ""))
    callback.last_model_path = moved(state.get("last_model_path", ""))
    callback._last_global_step_saved = int(state.get("_last_global_step_saved", 0))
    callback._last_checkpoint_saved = moved(state.get("_last_checkpoint_saved", ""))
