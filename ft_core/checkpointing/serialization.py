"""The safe checkpoint wire format: a JSON header plus raw tensor bytes, checksummed per chunk.

Nothing here unpickles: the header is JSON whose every field is validated (dtype names from an
allow-list, shapes and strides against the declared byte sizes, indices in range), so corrupt or
truncated input gives a CheckpointError, never a crash or an allocation larger than declared sizes
that were checked first.

Layout of an encoded checkpoint (what `dumps` returns; the transports move the same frames piecewise):

    header frame:  MAGIC (8 bytes) | u64 header length | header JSON (utf-8) | u32 crc32(header JSON)
    chunk frames:  for each chunk i: payload[i*chunk_bytes : (i+1)*chunk_bytes] | u64 digest(those bytes)

The chunk digest is named in the header: "xxh3_64" (xxhash, ~8x faster than zlib's crc32 on these
machines, where crc32 halved the loopback throughput) when the xxhash package is installed, else "crc32".
Both are streaming digests, so how a chunk is split into pieces while hashing does not matter.

The payload is the concatenation of the blobs (raw bytes of tensor storages, numpy arrays, bytes).
Tensors that share a storage share one blob, so views come back as views of one storage.
"""


from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ft_core.checkpointing.decoding import (
    ArraySpec,
    Plan,
    TensorSpec,
    check_crc,
    check_step,
    fill_copies,
    in_place_targets,
    loads,
    make_tensor,
    parse_header,
    parse_header_frame,
    physical_memory_bytes,
    split_header_prefix,
    walk_tensors,
)
from ft_core.checkpointing.dtensor_wire import encode_mesh, encode_placements, is_dtensor
from ft_core.checkpointing.wire import (
    CHECKSUMS,
    CRC,
    DEFAULT_CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    DIGEST,
    DTYPE_NAMES,
    DTYPES,
    FORMAT,
    HEADER_PREFIX_BYTES,
    LEN,
    MAGIC,
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    NP_DTYPE_RE,
    VERSION,
    chunk_segments,
    digest_views,
    encode_header_frame,
    new_digest,
    num_chunks,
    storage_span,
    tensor_bytes,
)
from ft_core.errors import CheckpointError

__all__ = [
    "CHECKSUMS",
    "CRC",
    "DEFAULT_CHECKSUM",
    "DEFAULT_CHUNK_BYTES",
    "DIGEST",
    "DTYPES",
    "DTYPE_NAMES",
    "FORMAT",
    "HEADER_PREFIX_BYTES",
    "LEN",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "VERSION",
    "ArraySpec",
    "Blob",
    "Encoded",
    "Plan",
    "TensorSpec",
    "check_crc",
    "check_step",
    "chunk_segments",
    "digest_views",
    "dumps",
    "encode",
    "encode_header_frame",
    "fill_copies",
    "in_place_targets",
    "loads",
    "make_tensor",
    "new_digest",
    "num_chunks",
    "parse_header",
    "parse_header_frame",
    "physical_memory_bytes",
    "split_header_prefix",
    "storage_span",
    "tensor_bytes",
    "walk_tensors",
]

_SUPPORTED = ("tensors, numpy arrays and scalars, dict/OrderedDict/list/tuple, str, int, float, bool, "
              "None, bytes")


# ---------------------------------------------------------------- encoding


@dataclass
class Blob:
    """One run of payload bytes on the sender: a uint8 tensor (any device) or a host buffer."""

    nbytes: int
    kind: str  # "t" tensor storage, "a" numpy array, "b" bytes
    tensor: torch.Tensor | None = None
    buffer: memoryview | None = None

    def host_view(self) -> memoryview:
        """The bytes as a memoryview; only valid for host blobs (staged ones included)."""
        if self.buffer is not None:
            return self.buffer
        assert self.tensor is not None and self.tensor.device.type == "cpu", "stage device blobs to host first"
        return memoryview(self.tensor.numpy()).cast("B") if self.nbytes else memoryview(b"")


@dataclass
class Encoded:
    """A state flattened for the wire: the header (JSON-able) and the blobs it describes, in payload order."""

    header: dict[str, Any]
    blobs: list[Blob]
    chunk_bytes: int
    keepalive: list[Any] = field(default_factory=list, repr=False)  # owners of the memory the blobs view
    _header_frame: bytes | None = field(default=None, repr=False)

    @property
    def payload_nbytes(self) -> int:
        return sum(blob.nbytes for blob in self.blobs)

    @property
    def checksum(self) -> str:
        return self.header["checksum"]

    @property
    def num_chunks(self) -> int:
        return num_chunks(self.payload_nbytes, self.chunk_bytes)

    def header_frame(self) -> bytes:
        if self._header_frame is None:
            self._header_frame = encode_header_frame(self.header)
        return self._header_frame

    def chunk_last_blob(self, index: int) -> int:
        """The last blob chunk `index` covers (-1 for an empty chunk)."""
        segments = chunk_segments([blob.nbytes for blob in self.blobs], self.chunk_bytes, index)
        return segments[-1][0] if segments else -1

    def chunk_views(self, index: int) -> list[memoryview]:
        """Host byte views making up chunk `index` (blobs must be on the host)."""
        sizes = [blob.nbytes for blob in self.blobs]
        return [self.blobs[b].host_view()[lo:hi] for b, lo, hi in chunk_segments(sizes, self.chunk_bytes, index)]



def _path_str(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{part!r}]" if not isinstance(part, str) or not part.startswith(".") else part
                             for part in path)


def _refuse(path: tuple[Any, ...], why: str) -> CheckpointError:
    return CheckpointError(f"cannot serialize {_path_str(path)}: {why}; a checkpoint may hold {_SUPPORTED}. "
                           "Convert the value (e.g. to a tensor or a plain dict) or keep it out of the state dict")


class _Encoder:
    """Walks the state once, emitting the JSON tree and collecting tensors, arrays and byte blobs."""

    def __init__(self) -> None:
        self.tensors: list[tuple[torch.Tensor, bool, bool]] = []  # (detached tensor, requires_grad, is_param)
        self.tensor_ids: dict[int, int] = {}
        self.arrays: list[list[Any]] = []
        self.blobs: list[Blob] = []
        self.keepalive: list[Any] = []

    def node(self, obj: Any, path: tuple[Any, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _refuse(path, f"it is nested deeper than {MAX_DEPTH} levels (a reference cycle?)")
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            return obj
        if kind is float:
            return obj
        if kind is list:
            return [self.node(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
        if kind is tuple:
            return {"$": "tuple", "v": [self.node(v, path + (i,), depth + 1) for i, v in enumerate(obj)]}
        if kind is dict or kind is OrderedDict:
            return self.mapping(obj, path, depth)
        if is_dtensor(obj):
            return self.dtensor(obj, path)
        if isinstance(obj, torch.Tensor):
            return {"$": "tensor", "i": self.tensor(obj, path)}
        if kind is np.ndarray or isinstance(obj, np.generic):
            return self.array(obj, path)
        if kind is bytes or kind is bytearray:
            self.blobs.append(Blob(len(obj), "b", buffer=memoryview(obj)))
            return {"$": kind.__name__, "b": len(self.blobs) - 1}
        raise _refuse(path, f"type {kind.__module__}.{kind.__qualname__} is not supported")

    def mapping(self, obj: dict, path: tuple[Any, ...], depth: int) -> dict[str, Any]:
        keys, values = [], []
        for key, value in obj.items():
            if key is not None and type(key) not in (str, int, float, bool):
                raise _refuse(path + (key,), f"dict key of type {type(key).__qualname__} is not supported "
                                             "(keys must be str, int, float, bool or None)")
            keys.append(key)
            values.append(self.node(value, path + (key,), depth + 1))
        out: dict[str, Any] = {"$": "dict" if type(obj) is dict else "odict", "k": keys, "v": values}
        meta = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info, used by load_state_dict
        if type(obj) is OrderedDict and meta is not None:
            out["m"] = self.node(meta, path + ("._metadata",), depth + 1)
        return out

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        known = self.tensor_ids.get(id(t))
        if known is not None:
            return known
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _refuse(path, f"tensor subclass {type(t).__qualname__} is not supported (send a plain tensor "
                                "or a DTensor)")
        if t.layout != torch.strided:
            raise _refuse(path, f"tensor layout {t.layout} is not supported (call .to_dense())")
        if t.device.type == "meta":
            raise _refuse(path, "meta tensors have no data")
        if t.dtype not in DTYPE_NAMES:
            raise _refuse(path, f"tensor dtype {t.dtype} is not supported (allowed: {', '.join(DTYPES)})")
        requires_grad, is_param = t.requires_grad, type(t) is torch.nn.Parameter
        plain = t.detach()
        if plain.is_conj():
            plain = plain.resolve_conj()
        if plain.is_neg():
            plain = plain.resolve_neg()
        self.keepalive.append(t)
        self.tensors.append((plain, requires_grad, is_param))
        self.tensor_ids[id(t)] = len(self.tensors) - 1
        return len(self.tensors) - 1

    def dtensor(self, obj: Any, path: tuple[Any, ...]) -> dict[str, Any]:
        """A DTensor as its local shard plus its layout: each rank sends its own shard, nothing is gathered."""
        placements = encode_placements(obj.placements, _path_str(path))
        local = obj.detach().to_local()
        return {"$": "dtensor", "i": self.tensor(local, path), "shape": list(obj.shape), "stride": list(obj.stride()),
                "placements": placements, "mesh": encode_mesh(obj.device_mesh), "rg": bool(obj.requires_grad),
                "param": isinstance(obj, torch.nn.Parameter)}

    def array(self, obj: np.ndarray | np.generic, path: tuple[Any, ...]) -> dict[str, Any]:
        arr = np.asarray(obj)
        dtype = arr.dtype.str
        if arr.dtype.kind == "b":
            dtype = "|b1"
        if not NP_DTYPE_RE.match(dtype):
            raise _refuse(path, f"numpy dtype {arr.dtype} is not supported (only bool, int, uint, float, complex)")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # np.ascontiguousarray would turn a 0-dim array into 1-dim
        self.keepalive.append(arr)
        raw = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
        self.blobs.append(Blob(arr.nbytes, "a", buffer=raw))
        self.arrays.append([dtype, list(arr.shape), len(self.blobs) - 1])
        return {"$": "ndarray" if type(obj) is np.ndarray else "npscalar", "i": len(self.arrays) - 1}

    def tensor_records(self) -> list[list[Any]]:
        """Assign tensors to blobs: tensors sharing a storage share the span of it that they use."""
        records: list[list[Any] | None] = [None] * len(self.tensors)
        groups: dict[tuple[str, int], list[int]] = {}
        for index, (t, requires_grad, is_param) in enumerate(self.tensors):
            if t.numel() == 0:
                records[index] = [DTYPE_NAMES[t.dtype], list(t.shape), list(t.stride()), -1, 0,
                                  requires_grad, is_param]
            else:
                groups.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(index)
        for members in groups.values():
            shared = self._shared_span(members)
            if shared is None:
                for index in members:
                    records[index] = self._own_blob(index)
                continue
            start, nbytes = shared
            storage = self.tensors[members[0]][0].untyped_storage()
            self.blobs.append(Blob(nbytes, "t", tensor=storage_span(storage, start, nbytes)))
            for index in members:
                t, requires_grad, is_param = self.tensors[index]
                offset = (t.storage_offset() * t.element_size() - start) // t.element_size()
                records[index] = [DTYPE_NAMES[t.dtype], list(t.shape), list(t.stride()), len(self.blobs) - 1,
                                  offset, requires_grad, is_param]
        return [r for r in records if r is not None]

    def _shared_span(self, members: list[int]) -> tuple[int, int] | None:
        """(start, nbytes) of the storage bytes the group uses, or None when sending it is wasteful."""
        lo, hi, useful = None, 0, 0
        for index in members:
            t = self.tensors[index][0]
            size = t.element_size()
            begin = t.storage_offset() * size
            end = begin + size * (1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride())))
            lo = begin if lo is None else min(lo, begin)
            hi = max(hi, end)
            useful += t.numel() * size
        assert lo is not None
        for index in members:
            t = self.tensors[index][0]
            if (t.storage_offset() * t.element_size() - lo) % t.element_size():
                return None  # views at byte offsets their dtype cannot express
        if hi - lo > 2 * useful + (64 << 10):
            return None  # sparse views of a big storage (e.g. a column): send compact copies instead
        return lo, hi - lo

    def _own_blob(self, index: int) -> list[Any]:
        t, requires_grad, is_param = self.tensors[index]
        dense = t.contiguous()
        self.keepalive.append(dense)
        nbytes = dense.numel() * dense.element_size()
        start = dense.storage_offset() * dense.element_size()
        self.blobs.append(Blob(nbytes, "t", tensor=storage_span(dense.untyped_storage(), start, nbytes)))
        return [DTYPE_NAMES[t.dtype], list(t.shape), list(dense.stride()), len(self.blobs) - 1, 0,
                requires_grad, is_param]


def encode(obj: Any, *, step: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           checksum: str | None = None) -> Encoded:
    """Flatten `obj` without copying tensor data (non-contiguous sparse views excepted)."""
    if chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    checksum = checksum or DEFAULT_CHECKSUM
    new_digest(checksum)
    enc = _Encoder()
    tree = enc.node(obj, (), 0)
    tensors = enc.tensor_records()
    header = {"format": FORMAT, "version": VERSION, "step": step, "chunk_bytes": chunk_bytes, "checksum": checksum,
              "blobs": [[b.nbytes, b.kind] for b in enc.blobs], "tensors": tensors, "arrays": enc.arrays,
              "tree": tree}
    return Encoded(header, enc.blobs, chunk_bytes, enc.keepalive)


def dumps(obj: Any, *, step: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
          checksum: str | None = None) -> bytes:
    """The whole encoded checkpoint as bytes (device tensors are copied to the host)."""
    encoded = encode(obj, step=step, chunk_bytes=chunk_bytes, checksum=checksum)
    for blob in encoded.blobs:
        if blob.tensor is not None and blob.tensor.device.type != "cpu":
            blob.tensor = blob.tensor.cpu()
    parts = [encoded.header_frame()]
    for index in range(encoded.num_chunks):
        views = encoded.chunk_views(index)
        parts.extend(bytes(v) for v in views)
        parts.append(DIGEST.pack(digest_views(encoded.checksum, views)))
    return b"".join(parts)


