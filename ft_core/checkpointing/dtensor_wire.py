"""DTensors (FSDP2, tensor parallel) on the checkpoint wire: each rank's local shard plus its layout.

A DTensor travels as {"$": "dtensor", "i": <its local shard, an ordinary tensor record>, "shape",
"stride" (global), "placements", "mesh": {device_type, ranks, shape, dim_names}}. Each rank of a
group sends only its own shard to the same rank of the healing group, so nothing is gathered.
The receiver rebuilds the DTensor on an equal DeviceMesh (same device type, ranks and dim names;
built without creating process groups), or fills its own DTensor in place when the transport was
given the local state. Every field is validated like the rest of the header.

`torch.distributed.tensor` costs about a second of import time, so it is imported only here, on the
first DTensor met: an object can be a DTensor only once some code has imported that module (`is_dtensor`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ft_core.errors import CheckpointError

__all__ = ["build_dtensor", "encode_mesh", "encode_placements", "is_dtensor"]

MAX_MESH_RANKS = 1 << 20
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mtia", "meta")
_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def is_dtensor(obj: Any) -> bool:
    """Whether `obj` is a DTensor, without importing torch.distributed.tensor when nothing has."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(obj, cls)


def encode_placements(placements: tuple[Any, ...], where: str) -> list[list[Any]]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[list[Any]] = []
    for p in placements:
        if type(p) is Shard:
            out.append(["S", int(p.dim)])
        elif type(p) is Replicate:
            out.append(["R"])
        elif type(p) is Partial:
            out.append(["P", str(p.reduce_op)])
        else:
            raise CheckpointError(f"cannot serialize {where}: DTensor placement {p!r} is not supported (Shard, "
                                  f"Replicate and Partial are); redistribute it or send full_tensor()")
    return out


def encode_mesh(mesh: DeviceMesh) -> dict[str, Any]:
    return {"device_type": mesh.device_type, "ranks": mesh.mesh.reshape(-1).tolist(), "shape": list(mesh.mesh.shape),
            "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None}


def _bad(what: str) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint header: {what}")


def _ints(value: Any, what: str, lo: int = 0, hi: int = 1 << 48) -> list[int]:
    if type(value) is not list or len(value) > 64 and what != "mesh ranks":
        raise _bad(f"{what} must be a list")
    if len(value) > MAX_MESH_RANKS or any(type(v) is not int or not lo <= v <= hi for v in value):
        raise _bad(f"{what} must hold integers in [{lo}, {hi}]")
    return value


def _placements(value: Any, ndim: int) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(value) is not list:
        raise _bad("DTensor placements must be a list")
    out: list[Any] = []
    for p in value:
        if type(p) is not list or not p or p[0] not in ("S", "R", "P"):
            raise _bad(f"unknown DTensor placement {p!r:.40}")
        if p[0] == "S":
            if len(p) != 2 or type(p[1]) is not int or not -ndim <= p[1] < max(ndim, 1):
                raise _bad(f"DTensor Shard placement {p!r:.40} does not fit a {ndim}-d tensor")
            out.append(Shard(p[1]))
        elif p[0] == "R":
            out.append(Replicate())
        else:
            if len(p) != 2 or p[1] not in _REDUCE_OPS:
                raise _bad(f"DTensor Partial placement {p!r:.40} has an unknown reduce op")
            out.append(Partial(p[1]))
    return out


class MeshCache:
    """One DeviceMesh per distinct layout in a decoded checkpoint (meshes compare equal by layout)."""

    def __init__(self) -> None:
        self._meshes: dict[tuple[Any, ...], DeviceMesh] = {}

    def get(self, spec: Any) -> DeviceMesh:
        if type(spec) is not dict or spec.get("device_type") not in _DEVICE_TYPES:
            raise _bad(f"DTensor mesh {str(spec)[:60]} has no known device type")
        shape = _ints(spec.get("shape"), "mesh shape", 1, MAX_MESH_RANKS)
        ranks = _ints(spec.get("ranks"), "mesh ranks", 0, MAX_MESH_RANKS)
        numel = 1
        for d in shape:
            numel *= d
        if numel != len(ranks) or len(set(ranks)) != len(ranks):
            raise _bad("DTensor mesh ranks do not match its shape")
        names = spec.get("dim_names")
        if names is not None and (type(names) is not list or len(names) != len(shape)
                                  or any(type(n) is not str for n in names)):
            raise _bad("DTensor mesh dim names do not match its shape")
        key = (spec["device_type"], tuple(shape), tuple(ranks), tuple(names) if names else None)
        mesh = self._meshes.get(key)
        if mesh is None:
            if not dist.is_initialized():
                raise CheckpointError("this checkpoint holds DTensors: initialise torch.distributed on the receiver "
                                      "(as the sender did for FSDP/TP) before receiving it, or give the transport "
                                      "the local state to fill in place")
            mesh = DeviceMesh(spec["device_type"], torch.tensor(ranks, dtype=torch.int64).reshape(shape),
                              mesh_dim_names=tuple(names) if names else None, _init_backend=False)
            self._meshes[key] = mesh
        return mesh


def build_dtensor(node: dict[str, Any], local: torch.Tensor, meshes: MeshCache) -> torch.Tensor:
    """The DTensor of a validated "dtensor" node around its received local shard."""
    from torch.distributed.tensor import DTensor

    shape = _ints(node.get("shape"), "DTensor shape")
    stride = _ints(node.get("stride"), "DTensor stride")
    if len(stride) != len(shape) or type(node.get("rg")) is not bool or type(node.get("param")) is not bool:
        raise _bad("DTensor shape, stride and flags do not match")
    placements = _placements(node.get("placements"), len(shape))
    mesh = meshes.get(node.get("mesh"))
    if len(placements) != mesh.ndim:
        raise _bad(f"{len(placements)} DTensor placements for a {mesh.ndim}-d mesh")
    if local.requires_grad:
        local = local.detach()
    try:
        out = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                 stride=tuple(stride))
    except (RuntimeError, ValueError, IndexError) as exc:
        raise _bad(f"DTensor {shape} cannot be rebuilt: {exc}") from exc
    if node["param"]:
        return torch.nn.Parameter(out, requires_grad=node["rg"])
    return out.requires_grad_(True) if node["rg"] else out
