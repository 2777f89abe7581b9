"""Decoding the checkpoint wire format: every header field validated before anything is allocated.

Nothing here unpickles. Corrupt or truncated input gives a CheckpointError, never a crash, and
allocations are bounded by sizes checked against the input length (or physical memory when streaming).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ft_core.checkpointing.dtensor_wire import MeshCache, build_dtensor, is_dtensor
from ft_core.checkpointing.wire import (
    CRC,
    DIGEST,
    DTYPES,
    FORMAT,
    HEADER_PREFIX_BYTES,
    LEN,
    MAGIC,
    MAX_CHUNKS,
    MAX_DEPTH,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    NP_DTYPE_RE,
    VERSION,
    chunk_segments,
    new_digest,
    num_chunks,
    prefix_offsets,
    storage_span,
)
from ft_core.errors import CheckpointError


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
    checksum: str
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
                if tag in ("tensor", "dtensor") and type(node.get("i")) is int:
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
        return _build_node(self.tree, tensors, arrays, buffers, 0, MeshCache())


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


def _build_node(node: Any, tensors: list, arrays: list, buffers: list, depth: int,
                meshes: MeshCache | None = None) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(f"the tree is nested deeper than {MAX_DEPTH} levels")
    if node is None or type(node) in (bool, int, float, str):
        return node
    if type(node) is list:
        return [_build_node(v, tensors, arrays, buffers, depth + 1, meshes) for v in node]
    if type(node) is not dict:
        raise _bad(f"unexpected node {type(node).__name__}")
    tag = node.get("$")
    if tag == "tuple":
        return tuple(_build_node(v, tensors, arrays, buffers, depth + 1, meshes) for v in _list(node.get("v"), "tuple"))
    if tag in ("dict", "odict"):
        keys, values = _list(node.get("k"), "dict keys"), _list(node.get("v"), "dict values")
        if len(keys) != len(values) or any(k is not None and type(k) not in (str, int, float, bool) for k in keys):
            raise _bad("dict keys and values do not match")
        out = (dict if tag == "dict" else OrderedDict)(
            zip(keys, (_build_node(v, tensors, arrays, buffers, depth + 1, meshes) for v in values)))
        if tag == "odict" and "m" in node:
            meta = _build_node(node["m"], tensors, arrays, buffers, depth + 1, meshes)
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if tag == "tensor":
        return tensors[_int(node.get("i"), "tensor index", 0, len(tensors) - 1)]
    if tag == "dtensor":
        local = tensors[_int(node.get("i"), "tensor index", 0, len(tensors) - 1)]
        return build_dtensor(node, local, meshes if meshes is not None else MeshCache())
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
    if type(rec[0]) is not str or not NP_DTYPE_RE.match(rec[0]):
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
    offsets = prefix_offsets(blob_sizes)
    limit = physical_memory_bytes() if max_payload_nbytes is None else max_payload_nbytes
    if offsets[-1] > limit:
        raise CheckpointError(f"checkpoint declares {offsets[-1]} payload bytes, more than the {limit} this "
                              "process accepts (physical memory); the header is corrupt or the state too big")
    chunk_bytes = _int(header.get("chunk_bytes"), "chunk_bytes", 1)
    checksum = header.get("checksum")
    if type(checksum) is not str:
        raise _bad("the header names no chunk checksum")
    new_digest(checksum)
    if num_chunks(offsets[-1], chunk_bytes) > MAX_CHUNKS:
        raise _bad(f"{num_chunks(offsets[-1], chunk_bytes)} chunks is more than the {MAX_CHUNKS} allowed")
    tensors = [_validate_tensor(r, blob_sizes, blob_kinds) for r in _list(header.get("tensors"), "tensors")]
    arrays = [_validate_array(r, blob_sizes, blob_kinds) for r in _list(header.get("arrays"), "arrays")]
    if "tree" not in header:
        raise _bad("the header has no tree")
    return Plan(step, chunk_bytes, checksum, blob_sizes, blob_kinds, tensors, arrays, header["tree"], offsets)


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


def check_crc(actual: int, trailer: bytes | memoryview, what: str, layout: struct.Struct = CRC) -> None:
    """Compare a computed checksum with the trailer that came with the bytes."""
    if len(trailer) != layout.size:
        raise _bad(f"{what} is truncated (no checksum)")
    (expected,) = layout.unpack(bytes(trailer))
    if actual != expected:
        raise _bad(f"{what} fails its checksum ({actual:#x} != {expected:#x})")


def loads(data: bytes | bytearray | memoryview, *, expected_step: int | None = None) -> Any:
    """Decode what `dumps` produced; any damage gives a CheckpointError."""
    view = memoryview(data).cast("B")
    length = split_header_prefix(view[:HEADER_PREFIX_BYTES])
    header_end = HEADER_PREFIX_BYTES + length + CRC.size
    if len(view) < header_end:
        raise _bad(f"it is truncated inside the header ({len(view)} of {header_end} bytes)")
    plan = parse_header_frame(view[:header_end], max_payload_nbytes=len(view))
    expected = header_end + plan.payload_nbytes + DIGEST.size * plan.num_chunks
    if len(view) != expected:
        raise _bad(f"it has {len(view)} bytes but its header describes {expected}")
    check_step(plan, expected_step)
    buffers = plan.allocate()
    pos = header_end
    for index in range(plan.num_chunks):
        digest = new_digest(plan.checksum)
        for target in plan.chunk_targets(buffers, index):
            target[:] = view[pos:pos + len(target)]
            digest.update(target)
            pos += len(target)
        check_crc(digest.intdigest(), view[pos:pos + DIGEST.size], f"chunk {index}", DIGEST)
        pos += DIGEST.size
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
    """Call `visit(path, tensor)` for every tensor in a nested dict/list/tuple state (a DTensor's local
    shard stands for the DTensor: that is what travels)."""
    if is_dtensor(obj):
        with torch.no_grad():
            visit(path, obj.to_local())
    elif isinstance(obj, torch.Tensor):
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

