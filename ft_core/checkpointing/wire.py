"""Shared pieces of the checkpoint wire format: constants, the dtype allow-list, digests, chunk layout."""

from __future__ import annotations

import bisect
import json
import re
import struct
import zlib
from collections.abc import Callable
from typing import Any

import torch

try:  # optional: a much faster chunk digest than zlib.crc32
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

from ft_core.errors import CheckpointError

MAGIC = b"FTLCKPT\x01"
FORMAT = "ftl-ckpt"
VERSION = 1
LEN = struct.Struct("<Q")
CRC = struct.Struct("<I")  # the header's crc32
DIGEST = struct.Struct("<Q")  # each chunk's digest
HEADER_PREFIX_BYTES = len(MAGIC) + LEN.size
MAX_HEADER_BYTES = 256 << 20
MAX_DEPTH = 128
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_CHUNKS = 1 << 20
DEFAULT_CHUNK_BYTES = 16 << 20
# the HTTP transport's server and client
SOCKET_BUFFER_BYTES = 4 << 20
PIECE_BYTES = 1 << 20  # hashing granularity: small enough to hash while the piece is in cache
MAX_ERROR_BODY = 4096

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
NP_DTYPE_RE = re.compile(r"^[<>|]?[biufc](1|2|4|8|16)$")

_SUPPORTED = ("tensors, numpy arrays and scalars, dict/OrderedDict/list/tuple, str, int, float, bool, "
              "None, bytes")


class _Crc32:
    """zlib.crc32 behind the streaming-hash interface of xxhash (update / intdigest)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


CHECKSUMS: dict[str, Callable[[], Any]] = {"crc32": _Crc32}
if xxhash is not None:
    CHECKSUMS["xxh3_64"] = xxhash.xxh3_64
DEFAULT_CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


def new_digest(name: str) -> Any:
    """A streaming digest (update(bytes), intdigest()) for a checksum name from a header."""
    factory = CHECKSUMS.get(name)
    if factory is None:
        raise CheckpointError(f"checkpoint chunk checksum {name!r:.40} is not available here (have: "
                              f"{', '.join(CHECKSUMS)}); install xxhash on every replica or use checksum='crc32'")
    return factory()


def digest_views(name: str, views: list[memoryview]) -> int:
    digest = new_digest(name)
    for view in views:
        digest.update(view)
    return digest.intdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor of any dtype (bf16 and float8 included)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * t.element_size(),
                                                 (t.numel() * t.element_size(),), (1,))
    return memoryview(raw.numpy()).cast("B")


def storage_span(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor over bytes [start, start + nbytes) of `storage` (same device, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,), (1,))



def encode_header_frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return MAGIC + LEN.pack(len(body)) + body + CRC.pack(zlib.crc32(body))


def num_chunks(payload_nbytes: int, chunk_bytes: int) -> int:
    return -(-payload_nbytes // chunk_bytes) if payload_nbytes else 0


def chunk_segments(blob_sizes: list[int], chunk_bytes: int, index: int,
                   offsets: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Chunk `index` of the payload as (blob index, start, end) byte ranges of the blobs it covers."""
    if offsets is None:
        offsets = prefix_offsets(blob_sizes)
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


def prefix_offsets(sizes: list[int]) -> list[int]:
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets

