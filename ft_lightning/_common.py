"""What the Trainer and Fabric strategies share: settings, Manager creation, state made safe for the
checkpoint transport, RNG snapshots, and keeping an AMP GradScaler consistent on a skipped step.

No Lightning imports here: both Lightning namespaces (and Fabric) use these helpers.
"""

from __future__ import annotations

import logging
import random
import sys
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from enum import Enum
from os import PathLike, fspath
from typing import Any

import numpy as np
import torch

from ft_core import settings as ft_settings
from ft_core.errors import ConfigError
from ft_core.manager import Manager, WorldSizeMode
from ft_core.process_groups import ProcessGroupGloo, ProcessGroupNCCL
from ft_lightning import _events

logger = logging.getLogger(__name__)

BACKENDS = ft_settings.get("FT_BACKEND").choices
WORLD_SIZE_MODES = ft_settings.get("FT_WORLD_SIZE_MODE").choices


@dataclass(frozen=True)
class FTSettings:
    """Fault-tolerance settings of one replica group, resolved once from ft_core.settings: a set environment
    variable overrides the argument, which overrides the default (the names match the Accelerate plugin)."""

    lighthouse_addr: str | None
    replica_id: str | None
    replica_group_id: int
    num_replica_groups: int
    min_replica_size: int
    timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    world_size_mode: str
    token: str | None = field(repr=False)
    backend: str
    use_async_quorum: bool
    manager_port: int
    host: str | None = None  # FT_HOST: the address this group advertises (None: the route toward the lighthouse)

    @classmethod
    def resolve(cls, *, lighthouse_addr: str | None = None, replica_id: str | None = None,
                replica_group_id: int | None = None, num_replica_groups: int | None = None,
                min_replica_size: int | None = None, timeout: timedelta | float | None = None,
                quorum_timeout: timedelta | float | None = None,
                connect_timeout: timedelta | float | None = None, world_size_mode: str | None = None,
                token: str | None = None, cross_group_backend: str | None = None,
                use_async_quorum: bool | None = None, manager_port: int | None = None,
                host: str | None = None) -> FTSettings:
        value = ft_settings.value
        groups = value("NUM_REPLICA_GROUPS", num_replica_groups)
        group = value("REPLICA_GROUP_ID", replica_group_id)
        if groups < 1:
            raise ConfigError(f"num_replica_groups (NUM_REPLICA_GROUPS) must be >= 1, got {groups}")
        if not 0 <= group < groups:
            raise ConfigError(f"replica_group_id (REPLICA_GROUP_ID) must be in 0..{groups - 1} for "
                              f"num_replica_groups={groups}, got {group}; set NUM_REPLICA_GROUPS to the number "
                              f"of replica groups")
        min_size = value("FT_MIN_REPLICA_SIZE", min_replica_size)
        if min_size < 1:
            raise ConfigError(f"min_replica_size (FT_MIN_REPLICA_SIZE) must be >= 1, got {min_size}")
        return cls(
            lighthouse_addr=value("FT_LIGHTHOUSE", lighthouse_addr),
            replica_id=replica_id,
            replica_group_id=group,
            num_replica_groups=groups,
            min_replica_size=min_size,
            timeout=value("FT_TIMEOUT_SEC", timeout),
            quorum_timeout=value("FT_QUORUM_TIMEOUT_SEC", quorum_timeout),
            connect_timeout=value("FT_CONNECT_TIMEOUT_SEC", connect_timeout),
            world_size_mode=value("FT_WORLD_SIZE_MODE", world_size_mode),
            token=value("FT_TOKEN", token),
            backend=value("FT_BACKEND", cross_group_backend),
            use_async_quorum=value("FT_ASYNC_QUORUM", use_async_quorum),
            manager_port=value("FT_MANAGER_PORT", manager_port),
            host=value("FT_HOST", host),
        )

    def group_dir_name(self) -> str:
        """Directory every file of this replica group goes under (logs, checkpoints)."""
        return f"replica_group_{self.replica_group_id}"

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["token"] = "set" if self.token else None
        return out


def cross_group_backend(settings: FTSettings, device: torch.device) -> str:
    """The cross-group backend ("gloo" or "nccl") of this rank, resolved as for core-API users."""
    return ft_settings.cross_group_backend(device.type, settings.backend, environ={})


def cross_group_pg(settings: FTSettings, device: torch.device) -> Any:
    """The reconfigurable cross-group process group of the chosen backend (the Manager configures it)."""
    if cross_group_backend(settings, device) == "nccl":
        return ProcessGroupNCCL(timeout=settings.timeout, device=device)
    return ProcessGroupGloo(timeout=settings.timeout)


def create_manager(settings: FTSettings, *, group_rank: int, group_world_size: int, device: torch.device,
                   store_addr: str | None = None, store_port: int | None = None,
                   extra: dict[str, Any] | None = None, pg: Any = None) -> Any:
    """A Manager for this rank of the replica group, with a cross-group process group of the chosen backend
    (`pg`: one from `cross_group_pg`, kept by a caller that reduces on it between steps)."""
    backend = cross_group_backend(settings, device)
    if pg is None:
        pg = cross_group_pg(settings, device)
    mode = WorldSizeMode.FIXED_WITH_SPARES if settings.world_size_mode == "fixed_with_spares" else WorldSizeMode.DYNAMIC
    replica_id = settings.replica_id or f"{settings.group_dir_name()}"
    kwargs: dict[str, Any] = {
        "pg": pg, "min_replica_size": settings.min_replica_size, "use_async_quorum": settings.use_async_quorum,
        "timeout": settings.timeout, "quorum_timeout": settings.quorum_timeout, "connect_timeout": settings.connect_timeout,
        "rank": group_rank, "world_size": group_world_size, "world_size_mode": mode, "store_addr": store_addr,
        "store_port": store_port, "lighthouse_addr": settings.lighthouse_addr, "replica_id": replica_id,
        "port": settings.manager_port, "token": settings.token, "hostname": settings.host,
    }
    kwargs.update(extra or {})
    logger.info("ft_lightning: starting the Manager of replica group %d/%d, group rank %d/%d, cross-group %s: %s",
                settings.replica_group_id, settings.num_replica_groups, group_rank, group_world_size, backend,
                settings.describe())
    _events.attach_console()  # one line per membership change, heal and failed step on the console
    return Manager(**kwargs)


# ---- state sent to a healing group -----------------------------------------------------------
# The transport carries str-keyed dicts, lists, tensors, numpy arrays and scalars. Everything else
# is encoded into those (tuples, dicts with int keys such as optimizer state) and decoded back.
_TUPLE = "__ft_tuple__"
_ITEMS = "__ft_items__"
_SCALARS = (bool, int, float, str, type(None))


def to_transport(obj: Any, *, clone: bool = False, where: str = "state") -> Any:
    """Encode `obj` for the checkpoint transport; `clone` copies tensors (the owner keeps training) to
    host memory: a GPU tensor goes to pinned host memory on a side stream (never a second copy on the
    GPU), and the call returns once every copy has landed. Raises TypeError naming the key for values
    that cannot be sent."""
    copies = _HostCopies() if clone else None
    out = _encode(obj, copies, where)
    if copies is not None:
        copies.wait()
    return out


def _encode(obj: Any, copies: _HostCopies | None, where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        return copies.copy(tensor) if copies is not None else tensor
    if isinstance(obj, Enum):
        return _encode(obj.value, copies, where)
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, PathLike):
        return fspath(obj)
    if type(obj).__module__ == "numpy":
        if isinstance(obj, np.ndarray):
            return obj.copy() if copies is not None else obj
        if isinstance(obj, np.generic):
            return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__ft_") for k in obj):
            return {k: _encode(v, copies, f"{where}.{k}") for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, None, where), _encode(v, copies, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, copies, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, copies, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{where} holds a {type(obj).__name__}, which cannot be sent to a healing replica group")


_COPY_STREAMS: dict[torch.device, Any] = {}  # one heal-snapshot copy stream per device, made on first use


class _HostCopies:
    """Host copies of one snapshot: CPU tensors cloned; CUDA tensors copied into pinned host memory on
    one side stream per device (ordered after the work queued so far), waited on once by `wait()`.
    The pinned blocks go back to torch's host cache with the snapshot; the HTTP transport hands that
    cache back to the system after the heal."""

    def __init__(self) -> None:
        self._used: list[Any] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor.clone()
        if tensor.device.type != "cuda" or tensor.layout != torch.strided:
            return tensor.to("cpu")  # other devices and layouts: a plain synchronous copy
        stream = _COPY_STREAMS.get(tensor.device)
        if stream is None:
            stream = _COPY_STREAMS.setdefault(tensor.device, torch.cuda.Stream(tensor.device))
        if stream not in self._used:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # what has been written so far
            self._used.append(stream)
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its device memory stays valid until the copy ran
        return host

    def wait(self) -> None:
        for stream in self._used:
            stream.synchronize()


def from_transport(obj: Any) -> Any:
    """Inverse of `to_transport` (tuples and non-str keys come back as they were)."""
    if isinstance(obj, dict):
        if set(obj) == {_TUPLE}:
            return tuple(from_transport(v) for v in obj[_TUPLE])
        if set(obj) == {_ITEMS}:
            return {_hashable(from_transport(k)): from_transport(v) for k, v in obj[_ITEMS]}
        return {k: from_transport(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [from_transport(v) for v in obj]
    return obj


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ---- RNG --------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy when imported, torch CPU, CUDA when initialized)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_initialized():  # False without CUDA too; the cheap check, as this runs every step
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Load states from `capture_rng` (after `from_transport`); parts this process lacks are skipped."""
    python = state.get("python")
    if python is not None:
        version, internal, gauss = python
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    np = sys.modules.get("numpy")
    if np is not None and state.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.to(torch.uint8).cpu() for t in cuda])


# ---- AMP --------------------------------------------------------------------------------------

def forget_unscale(scaler: Any, optimizer: Any) -> None:
    """After a skipped step, drop what `scaler.unscale_(optimizer)` recorded (it is normally cleared by
    `update()`), so the next step can unscale again. Nothing else in the scaler changes."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):
        states.pop(id(optimizer), None)
