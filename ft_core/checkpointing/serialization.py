"""The safe checkpoint wire format: a JSON header plus raw tensor bytes, checksummed per chunk.

Nothing here unpickles: the header is JSON whose every field is validated (dtype names from an
allow-list, shapes and strides against the declared byte sizes, indices in range), so corrupt or
truncated input gives a CheckpointError, never a crash or an allocation larger than declared sizes
that were checked first.

Layout of an encoded checkpoint (what `dumps` returns; the transports move the same frames piecewise):

    header frame:  MAGIC (8 bytes) | u64 header length | header JSON (utf-8) | u32 crc32(header JSON)
    chunk frames:  for each chunk i: payload[i*chunk_bytes : (i+1)*chunk_bytes] | u32 crc32(those bytes)

The payload is the concatenation of the blobs (raw bytes of tensor storages, numpy arrays, bytes).
Tensors that share a storage share one blob, so views come back as views of one storage.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ft_core.errors import CheckpointError

MAGIC = b"FTLCKPT\x01"
FORMAT = "ftl-ckpt"
VERSION = 1
LEN = struct.Struct("<Q")
CRC = struct.Struct("<I")
HEADER_PREFIX_BYTES = len(MAGIC) + LEN.size
MAX_HEADER_BYTES = 256 << 20
MAX_DEPTH = 128
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_CHUNKS = 1 << 20
DEFAULT_CHUNK_BYTES = 16 << 20

# Allow-list of tensor dtypes by wire name; names missing from this torch build are skipped.
_TORCH_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _TORCH_DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_NP_DTYPE_RE = re.compile(r"^[<>|]?[biufc](1|2|4|8|16)$")

_SUPPORTED = ("tensors, numpy arrays and scalars, dict/OrderedDict/list/tuple, str, int, float, bool, "
              "None, bytes")


def crc32(views: list[memoryview] | memoryview, value: int = 0) -> int:
    """Running crc32 over one view or a list of views (zlib releases the GIL on large buffers)."""
    for view in ([views] if isinstance(views, memoryview) else views):
        value = zlib.crc32(view, value)
    return value


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor of any dtype (bf16 and float8 included)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                 (t.numel() * t.element_size(),), (1,))
    return memoryview(raw.numpy()).cast("B")


def storage_span(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over bytes [start, start + nbytes) of `storage` (same device, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,), (1,))


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
    def num_chunks(self) -> int:
        return num_chunks(self.payload_nbytes, self.chunk_bytes)

    def header_frame(self) -> bytes:
        if self._header_frame is None:
            self._header_frame = encode_header_frame(self.header)
        return self._header_frame

    def chunk_views(self, index: int) -> list[memoryview]:
        """Host byte views making up chunk `index` (blobs must be on the host)."""
        sizes = [blob.nbytes for blob in self.blobs]
        return [self.blobs[b].host_view()[lo:hi] for b, lo, hi in chunk_segments(sizes, self.chunk_bytes, index)]


def encode_header_frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return MAGIC + LEN.pack(len(body)) + body + CRC.pack(zlib.crc32(body))


def num_chunks(payload_nbytes: int, chunk_bytes: int) -> int:
    return -(-payload_nbytes // chunk_bytes) if payload_nbytes else 0


def chunk_segments(blob_sizes: list[int], chunk_bytes: int, index: int,
                   offsets: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Chunk `index` of the payload as (blob index, start, end) byte ranges of the blobs it covers."""
    if offsets is None:
        offsets = _prefix_offsets(blob_sizes)
    total = offsets[-1]
    lo, hi = index * chunk_bytes, min((index + 1) * chunk_bytes, total)
    segments: list[tuple[int, int, int]] = []
    blob = bisect.bisect_right(offsets, lo) - 1
    while lo < hi:
        while blob_sizes[blob] == 0 or offsets[blob + 1] <= lo:
            blob += 1
        end = min(hi, offsets[blob + 1])
        segments.append((blob, lo - offsets[blob], end - offsets[blob]))
        lo = end
    return segments


def _prefix_offsets(sizes: list[int]) -> list[int]:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


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
            raise _refuse(path, f"tensor subclass {type(t).__qualname__} is not supported (for a DTensor, send "
                                "full_tensor() or to_local())")
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

    def array(self, obj: np.ndarray | np.generic, path: tuple[Any, ...]) -> dict[str, Any]:
        arr = np.asarray(obj)
        dtype = arr.dtype.str
        if arr.dtype.kind == "b":
            dtype = "|b1"
        if not _NP_DTYPE_RE.match(dtype):
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


def encode(obj: Any, *, step: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Encoded:
    """Flatten `obj` without copying tensor data (non-contiguous sparse views excepted)."""
    if chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    enc = _Encoder()
    tree = enc.node(obj, (), 0)
    tensors = enc.tensor_records()
    header = {"format": FORMAT, "version": VERSION, "step": step, "chunk_bytes": chunk_bytes,
              "blobs": [[b.nbytes, b.kind] for b in enc.blobs], "tensors": tensors, "arrays": enc.arrays,
              "tree": tree}
    return Encoded(header, enc.blobs, chunk_bytes, enc.keepalive)


def dumps(obj: Any, *, step: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> bytes:
    """The whole encoded checkpoint as bytes (device tensors are copied to the host)."""
    encoded = encode(obj, step=step, chunk_bytes=chunk_bytes)
    for blob in encoded.blobs:
        if blob.tensor is not None and blob.tensor.device.type != "cpu":
            blob.tensor = blob.tensor.cpu()
    parts = [encoded.header_frame()]
    for index in range(encoded.num_chunks):
        views = encoded.chunk_views(index)
        parts.extend(bytes(v) for v in views)
        parts.append(CRC.pack(crc32(views)))
    return b"".join(parts)


# ---------------------------------------------------------------- decoding


def _bad(what: str) -> CheckpointError:
    return CheckpointError(f"corrupt checkpoint: {what}; the source or the network damaged the bytes, "
                           "fetch it again")


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(f"{what} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _list(value: Any, what: str, length: int | None = None) -> list:
    if type(value) is not list or (length is not None and len(value) != length):
        raise _bad(f"{what} must be a list" + (f" of {length} items" if length is not None else ""))
    return value


@dataclass
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    blob: int
    offset: int
    requires_grad: bool
    is_param: bool


@dataclass
class ArraySpec:
    dtype: np.dtype
    shape: tuple[int, ...]
    blob: int


@dataclass
class Plan:
    """A validated header: what to allocate, where each chunk's bytes go, and how to rebuild the state."""

    step: int | None
    chunk_bytes: int
    blob_sizes: list[int]
    blob_kinds: list[str]
    tensors: list[TensorSpec]
    arrays: list[ArraySpec]
    tree: Any
    offsets: list[int] = field(default_factory=list)

    @property
    def payload_nbytes(self) -> int:
        return self.offsets[-1]

    @property
    def num_chunks(self) -> int:
        return num_chunks(self.payload_nbytes, self.chunk_bytes)

    def chunk_nbytes(self, index: int) -> int:
        return min(self.chunk_bytes, self.payload_nbytes - index * self.chunk_bytes)

    def allocate(self, preset: dict[int, Any] | None = None) -> list[Any]:
        """One receive buffer per blob (uint8 tensor, numpy array or bytearray); `preset` supplies some."""
        out: list[Any] = []
        for index, (size, kind) in enumerate(zip(self.blob_sizes, self.blob_kinds)):
            if preset and index in preset:
                out.append(preset[index])
            elif kind == "t":
                out.append(torch.empty(size, dtype=torch.uint8))
            elif kind == "a":
                out.append(np.empty(size, dtype=np.uint8))
            else:
                out.append(bytearray(size))
        return out

    def chunk_targets(self, buffers: list[Any], index: int) -> list[memoryview]:
        """Writable views, in order, that chunk `index` fills."""
        return [_writable_view(buffers[b])[lo:hi]
                for b, lo, hi in chunk_segments(self.blob_sizes, self.chunk_bytes, index, self.offsets)]

    def tensor_paths(self) -> dict[int, tuple[Any, ...]]:
        """The first key path of each tensor in the tree (in-place receive matches local tensors by path)."""
        found: dict[int, tuple[Any, ...]] = {}

        def visit(node: Any, path: tuple[Any, ...], depth: int) -> None:
            if depth > MAX_DEPTH:
                return
            if type(node) is list:
                for index, value in enumerate(node):
                    visit(value, path + (index,), depth + 1)
            elif type(node) is dict:
                tag = node.get("$")
                if tag == "tensor" and type(node.get("i")) is int:
                    found.setdefault(node["i"], path)
                elif tag == "tuple" and type(node.get("v")) is list:
                    for index, value in enumerate(node["v"]):
                        visit(value, path + (index,), depth + 1)
                elif tag in ("dict", "odict") and type(node.get("k")) is list and type(node.get("v")) is list:
                    for key, value in zip(node["k"], node["v"]):
                        visit(value, path + (key,), depth + 1)

        visit(self.tree, (), 0)
        return found

    def build(self, buffers: list[Any], overrides: dict[int, torch.Tensor] | None = None) -> Any:
        """Rebuild the state from filled buffers (tensors are views of the blob buffers, no copy).

        `overrides` maps tensor indices to tensors to use instead (in-place receive already filled them).
        """
        tensors = [overrides[i] if overrides and i in overrides else make_tensor(spec, buffers)
                   for i, spec in enumerate(self.tensors)]
        arrays = [_make_array(spec, buffers) for spec in self.arrays]
        return _build_node(self.tree, tensors, arrays, buffers, 0)


def _writable_view(buffer: Any) -> memoryview:
    if isinstance(buffer, torch.Tensor):
        return memoryview(buffer.numpy()).cast("B") if buffer.numel() else memoryview(bytearray())
    return memoryview(buffer).cast("B") if len(buffer) else memoryview(bytearray())


def make_tensor(spec: TensorSpec, buffers: list[Any]) -> torch.Tensor:
    try:
        if spec.blob < 0:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
        else:
            storage = buffers[spec.blob].untyped_storage()
            t = torch.empty(0, dtype=spec.dtype).set_(storage, spec.offset, spec.shape, spec.stride)
        if spec.is_param:
            return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
        return t.requires_grad_(True) if spec.requires_grad else t
    except RuntimeError as exc:  # e.g. requires_grad on an integer dtype in a forged header
        raise _bad(f"tensor {spec.dtype} {list(spec.shape)} cannot be rebuilt: {exc}") from exc


def _make_array(spec: ArraySpec, buffers: list[Any]) -> np.ndarray:
    raw = buffers[spec.blob]
    flat = raw.numpy() if isinstance(raw, torch.Tensor) else np.frombuffer(raw, dtype=np.uint8)
    return flat.view(spec.dtype).reshape(spec.shape)


def _build_node(node: Any, tensors: list, arrays: list, buffers: list, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(f"the tree is nested deeper than {MAX_DEPTH} levels")
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is list:
        return [_build_node(v, tensors, arrays, buffers, depth + 1) for v in node]
    if type(node) is not dict:
        raise _bad(f"unexpected node {type(node).__name__}")
    tag = node.get("$")
    if tag == "tuple":
        return tuple(_build_node(v, tensors, arrays, buffers, depth + 1) for v in _list(node.get("v"), "tuple"))
    if tag in ("dict", "odict"):
        keys, values = _list(node.get("k"), "dict keys"), _list(node.get("v"), "dict values")
        if len(keys) != len(values) or any(k is not None and type(k) not in (str, int, float, bool) for k in keys):
            raise _bad("dict keys and values do not match")
        out = (dict if tag == "dict" else OrderedDict)(
            zip(keys, (_build_node(v, tensors, arrays, buffers, depth + 1) for v in values)))
        if tag == "odict" and "m" in node:
            out._metadata = _build_node(node["m"], tensors, arrays, buffers, depth + 1)  # type: ignore[attr-defined]
        return out
    if tag == "tensor":
        return tensors[_int(node.get("i"), "tensor index", 0, len(tensors) - 1)]
    if tag in ("ndarray", "npscalar"):
        arr = arrays[_int(node.get("i"), "array index", 0, len(arrays) - 1)]
        return arr if tag == "ndarray" else arr[()]
    if tag in ("bytes", "bytearray"):
        raw = buffers[_int(node.get("b"), "bytes blob", 0, len(buffers) - 1)]
        if not isinstance(raw, bytearray):
            raise _bad("a bytes node refers to a non-bytes blob")
        return bytes(raw) if tag == "bytes" else raw
    raise _bad(f"unknown node tag {tag!r:.40}")


def _validate_tensor(rec: Any, blob_sizes: list[int], blob_kinds: list[str]) -> TensorSpec:
    rec = _list(rec, "a tensor record", 7)
    dtype = DTYPES.get(rec[0]) if type(rec[0]) is str else None
    if dtype is None:
        raise _bad(f"tensor dtype {rec[0]!r:.40} is not an allowed dtype")
    shape = tuple(_int(d, "a tensor dimension", 0, MAX_DIM) for d in _list(rec[1], "shape"))
    stride = tuple(_int(s, "a tensor stride", 0, MAX_DIM) for s in _list(rec[2], "stride"))
    if len(shape) > MAX_NDIM or len(stride) != len(shape):
        raise _bad(f"tensor shape {list(shape)[:8]} and stride {list(stride)[:8]} do not match")
    blob = _int(rec[3], "tensor blob index", -1, len(blob_sizes) - 1)
    offset = _int(rec[4], "tensor storage offset", 0, MAX_DIM)
    if type(rec[5]) is not bool or type(rec[6]) is not bool:
        raise _bad("tensor flags must be booleans")
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        if blob != -1 and blob_kinds[blob] != "t":
            raise _bad("an empty tensor refers to a non-tensor blob")
        return TensorSpec(dtype, shape, stride, -1, 0, rec[5], rec[6])
    if blob < 0 or blob_kinds[blob] != "t":
        raise _bad("a tensor refers to a missing or non-tensor blob")
    extent = offset + 1 + sum((d - 1) * s for d, s in zip(shape, stride))
    if extent * dtype.itemsize > blob_sizes[blob]:
        raise _bad(f"tensor {rec[0]} {list(shape)} needs {extent * dtype.itemsize} bytes but its blob has "
                   f"{blob_sizes[blob]}")
    return TensorSpec(dtype, shape, stride, blob, offset, rec[5], rec[6])


def _validate_array(rec: Any, blob_sizes: list[int], blob_kinds: list[str]) -> ArraySpec:
    rec = _list(rec, "an array record", 3)
    if type(rec[0]) is not str or not _NP_DTYPE_RE.match(rec[0]):
        raise _bad(f"numpy dtype {rec[0]!r:.40} is not allowed")
    dtype = np.dtype(rec[0])
    shape = tuple(_int(d, "an array dimension", 0, MAX_DIM) for d in _list(rec[1], "array shape"))
    blob = _int(rec[2], "array blob index", 0, len(blob_sizes) - 1)
    numel = 1
    for d in shape:
        numel *= d
    if len(shape) > MAX_NDIM or blob_kinds[blob] != "a" or numel * dtype.itemsize != blob_sizes[blob]:
        raise _bad(f"array {rec[0]} {list(shape)[:8]} does not match its blob of {blob_sizes[blob]} bytes")
    return ArraySpec(dtype, shape, blob)


def parse_header(body: bytes | memoryview, *, max_payload_nbytes: int | None = None) -> Plan:
    """Validate a header JSON body and return its Plan. `max_payload_nbytes` caps what we will allocate."""
    try:
        header = json.loads(bytes(body).decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise _bad(f"the header is not valid JSON ({exc.__class__.__name__}: {str(exc)[:100]})") from exc
    if type(header) is not dict or header.get("format") != FORMAT:
        raise _bad("the header is not an ft-lightning checkpoint header")
    if header.get("version") != VERSION:
        raise CheckpointError(f"checkpoint format version {header.get('version')!r:.20} is not supported (this "
                              f"build reads version {VERSION}); run the same ft-lightning version on both sides")
    step = header.get("step")
    if step is not None:
        _int(step, "step", -1)
    blobs = _list(header.get("blobs"), "blobs")
    blob_sizes, blob_kinds = [], []
    for rec in blobs:
        rec = _list(rec, "a blob record", 2)
        blob_sizes.append(_int(rec[0], "a blob size"))
        if rec[1] not in ("t", "a", "b"):
            raise _bad(f"blob kind {rec[1]!r:.20} is unknown")
        blob_kinds.append(rec[1])
    offsets = _prefix_offsets(blob_sizes)
    limit = physical_memory_bytes() if max_payload_nbytes is None else max_payload_nbytes
    if offsets[-1] > limit:
        raise CheckpointError(f"checkpoint declares {offsets[-1]} payload bytes, more than the {limit} this "
                              "process accepts (physical memory); the header is corrupt or the state too big")
    chunk_bytes = _int(header.get("chunk_bytes"), "chunk_bytes", 1)
    if num_chunks(offsets[-1], chunk_bytes) > MAX_CHUNKS:
        raise _bad(f"{num_chunks(offsets[-1], chunk_bytes)} chunks is more than the {MAX_CHUNKS} allowed")
    tensors = [_validate_tensor(r, blob_sizes, blob_kinds) for r in _list(header.get("tensors"), "tensors")]
    arrays = [_validate_array(r, blob_sizes, blob_kinds) for r in _list(header.get("arrays"), "arrays")]
    if "tree" not in header:
        raise _bad("the header has no tree")
    return Plan(step, chunk_bytes, blob_sizes, blob_kinds, tensors, arrays, header["tree"], offsets)


def split_header_prefix(prefix: bytes | memoryview) -> int:
    """Check the magic and return the header JSON length that follows the 16-byte prefix."""
    if len(prefix) < HEADER_PREFIX_BYTES or bytes(prefix[:len(MAGIC)]) != MAGIC:
        raise _bad("it does not start with the ft-lightning checkpoint magic")
    (length,) = LEN.unpack_from(prefix, len(MAGIC))
    if length > MAX_HEADER_BYTES:
        raise _bad(f"the header claims {length} bytes (more than {MAX_HEADER_BYTES})")
    return length


def parse_header_frame(frame: bytes | memoryview, *, max_payload_nbytes: int | None = None) -> Plan:
    """Validate a full header frame (magic, length, JSON, crc) and return its Plan."""
    view = memoryview(frame).cast("B")
    length = split_header_prefix(view[:HEADER_PREFIX_BYTES])
    if len(view) != HEADER_PREFIX_BYTES + length + CRC.size:
        raise _bad(f"the header frame has {len(view)} bytes, expected {HEADER_PREFIX_BYTES + length + CRC.size}")
    body = view[HEADER_PREFIX_BYTES:HEADER_PREFIX_BYTES + length]
    check_crc(zlib.crc32(body), view[HEADER_PREFIX_BYTES + length:], "the header")
    return parse_header(body, max_payload_nbytes=max_payload_nbytes)


def check_crc(actual: int, trailer: bytes | memoryview, what: str) -> None:
    if len(trailer) != CRC.size:
        raise _bad(f"{what} is truncated (no checksum)")
    (expected,) = CRC.unpack(bytes(trailer))
    if actual != expected:
        raise _bad(f"{what} fails its checksum (crc32 {actual:#010x} != {expected:#010x})")


def loads(data: bytes | bytearray | memoryview, *, expected_step: int | None = None) -> Any:
    """Decode what `dumps` produced; any damage gives a CheckpointError."""
    view = memoryview(data).cast("B")
    length = split_header_prefix(view[:HEADER_PREFIX_BYTES])
    header_end = HEADER_PREFIX_BYTES + length + CRC.size
    if len(view) < header_end:
        raise _bad(f"it is truncated inside the header ({len(view)} of {header_end} bytes)")
    plan = parse_header_frame(view[:header_end], max_payload_nbytes=len(view))
    expected = header_end + plan.payload_nbytes + CRC.size * plan.num_chunks
    if len(view) != expected:
        raise _bad(f"it has {len(view)} bytes but its header describes {expected}")
    check_step(plan, expected_step)
    buffers = plan.allocate()
    pos = header_end
    for index in range(plan.num_chunks):
        targets = plan.chunk_targets(buffers, index)
        value = 0
        for target in targets:
            target[:] = view[pos:pos + len(target)]
            value = zlib.crc32(target, value)
            pos += len(target)
        check_crc(value, view[pos:pos + CRC.size], f"chunk {index}")
        pos += CRC.size
    return plan.build(buffers)


def check_step(plan: Plan, expected_step: int | None) -> None:
    if expected_step is not None and plan.step != expected_step:
        raise CheckpointError(f"checkpoint is for step {plan.step} but step {expected_step} was requested; "
                              "the source moved on, retry at the next quorum")


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def walk_tensors(obj: Any, visit: Callable[[tuple[Any, ...], torch.Tensor], None],
                 path: tuple[Any, ...] = ()) -> None:
    """Call `visit(path, tensor)` for every tensor in a nested dict/list/tuple state."""
    if isinstance(obj, torch.Tensor):
        visit(path, obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            walk_tensors(value, visit, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            walk_tensors(value, visit, path + (index,))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def in_place_targets(plan: Plan, local_state: Any, host_only: bool = False
                     ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Match incoming tensors to `local_state`'s tensors by key path, dtype and shape.

    Returns (tensors whose bytes can be received straight into local memory, blob -> uint8 view of that
    memory, tensors to copy into local ones after receiving). `host_only` keeps device tensors out of the
    direct path (a receiver that reads into host memory copies into them instead).
    """
    if local_state is None:
        return {}, {}, {}
    local: dict[tuple[Any, ...], torch.Tensor] = {}
    walk_tensors(local_state, lambda path, t: local.setdefault(path, t))
    users: dict[int, int] = {}
    for spec in plan.tensors:
        users[spec.blob] = users.get(spec.blob, 0) + 1
    direct_tensors: dict[int, torch.Tensor] = {}
    preset: dict[int, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for index, path in plan.tensor_paths().items():
        spec, t = plan.tensors[index], local.get(path)
        if t is None or t.dtype != spec.dtype or tuple(t.shape) != spec.shape or t.layout != torch.strided:
            continue
        nbytes = t.numel() * t.element_size()
        direct = (spec.blob >= 0 and users[spec.blob] == 1 and t.is_contiguous() and spec.offset == 0
                  and spec.stride == _contiguous_strides(spec.shape) and plan.blob_sizes[spec.blob] == nbytes
                  and not (host_only and t.device.type != "cpu"))
        if direct:
            preset[spec.blob] = storage_span(t.untyped_storage(), t.storage_offset() * t.element_size(), nbytes)
            direct_tensors[index] = t
        else:
            copies[index] = t
    return direct_tensors, preset, copies


def fill_copies(plan: Plan, buffers: list[Any], direct: dict[int, torch.Tensor],
                copies: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Copy received tensors into their local counterparts; returns the overrides for Plan.build."""
    overrides = dict(direct)
    with torch.no_grad():
        for index, t in copies.items():
            t.copy_(make_tensor(plan.tensors[index], buffers))
            overrides[index] = t
    return overrides
