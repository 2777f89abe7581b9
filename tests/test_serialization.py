"""The checkpoint wire format: faithful round trips, clear refusals, and damage always caught."""

from __future__ import annotations

import json
import math
import struct
import warnings
import zlib
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft_core.checkpointing import serialization as ser
from ft_core.checkpointing.serialization import chunk_segments, dumps, loads
from ft_core.errors import CheckpointError


def nasty_state() -> dict:
    """Every dtype, views sharing a storage, non-contiguous and odd-shaped tensors, and plain values."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen)
    state: dict = {f"dtype/{name}": (torch.randn(3, 5, generator=gen) * 4).to(dtype)
                   for name, dtype in ser.DTYPES.items() if name != "complex32"}
    with warnings.catch_warnings():  # "ComplexHalf support is experimental"
        warnings.simplefilter("ignore", UserWarning)
        state["dtype/complex32"] = torch.randn(4, dtype=torch.complex64, generator=gen).to(torch.complex32)
    state.update({
        "base": base,
        "row_view": base[2],
        "strided_view": base[1:5, ::3],
        "transposed": base.t(),
        "expanded": torch.arange(3.0).expand(4, 3),
        "column_of_big": torch.randn(400, 400, generator=gen)[:, 7],
        "conj": torch.randn(3, dtype=torch.complex64, generator=gen).conj(),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "numpy": np.arange(12, dtype=">f8").reshape(3, 4),
        "numpy_bool": np.array([True, False]),
        "numpy_scalar": np.float32(2.5),
        "numpy_fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "nested": ((1, [2.5, "three", None]), {"deep": (True, False, b"raw\x00bytes", bytearray(b"ba"))}),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "foreach": None}]},
        "floats": [float("inf"), -0.0, 1e-310, 2 ** 70],
        "module": torch.nn.BatchNorm1d(3).state_dict(),
        "keys": {1: "int", 2.5: "float", False: "bool", None: "none", "s": "str"},
    })
    state["alias"] = state["base"]
    return state


def assert_same(a, b, path="state") -> None:
    assert type(a) is type(b) or (isinstance(a, np.generic) and isinstance(b, np.generic)), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):  # bitwise, so NaN, -0.0 and float8 compare exactly
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        as_bytes = lambda t: t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(as_bytes(a), as_bytes(b)), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{index}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and repr(a) == repr(b), path


@pytest.mark.parametrize("checksum", sorted(ser.CHECKSUMS))
@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096, ser.DEFAULT_CHUNK_BYTES])
def test_round_trip_keeps_values_types_and_structure(chunk_bytes: int, checksum: str) -> None:
    state = nasty_state()
    out = loads(dumps(state, step=5, chunk_bytes=chunk_bytes, checksum=checksum), expected_step=5)
    assert_same(state, out)


def test_round_trip_keeps_views_strides_identity_and_metadata() -> None:
    state = nasty_state()
    out = loads(dumps(state))
    base_ptr = out["base"].untyped_storage().data_ptr()
    for key in ("row_view", "strided_view", "transposed"):
        assert out[key].untyped_storage().data_ptr() == base_ptr, key  # views stay views of one storage
        assert out[key].stride() == state[key].stride() and out[key].storage_offset() == state[key].storage_offset()
    out["base"][2, 0] = 1234.0
    assert out["row_view"][0] == 1234.0
    assert out["alias"] is out["base"]
    assert out["expanded"].stride() == (0, 1)
    assert out["column_of_big"].is_contiguous()  # a sparse view of a big storage is sent compactly
    assert out["scalar"].dim() == 0 and out["empty"].shape == (0, 4)
    assert isinstance(out["param"], torch.nn.Parameter) and out["param"].requires_grad
    assert isinstance(out["numpy_scalar"], np.float32)
    assert type(out["module"]) is OrderedDict and out["module"]._metadata == state["module"]._metadata
    assert type(out["nested"]) is tuple and type(out["nested"][0][1]) is list
    torch.nn.BatchNorm1d(3).load_state_dict(out["module"])


def test_sparse_column_view_does_not_send_the_whole_storage() -> None:
    big = torch.randn(1000, 1000)
    assert len(dumps({"col": big[:, 0]})) < 20_000


def test_encoding_does_not_copy_contiguous_cpu_tensors() -> None:
    weight = torch.randn(64, 64)
    encoded = ser.encode({"w": weight})
    (blob,) = encoded.blobs
    assert blob.tensor.data_ptr() == weight.data_ptr()


class Opaque:
    pass


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, but users still have them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize("make, path, type_name", [
    (lambda: {"a": {"b": [1, Opaque()]}}, "state['a']['b'][1]", "Opaque"),
    (lambda: {"fn": lambda x: x}, "state['fn']", "function"),
    (lambda: {"s": {1, 2}}, "state['s']", "set"),
    (lambda: {"k": {(1, 2): 3}}, "state['k'][(1, 2)]", "tuple"),
    (lambda: {"obj": np.array([object()], dtype=object)}, "state['obj']", "object"),
    (lambda: {"sparse": torch.eye(3).to_sparse()}, "state['sparse']", "sparse"),
    (lambda: {"meta": torch.empty(2, device="meta")}, "state['meta']", "meta"),
    (lambda: {"q": quantized()}, "state['q']", "qint8"),
    (lambda: [1, (2, OrderedDict(x=slice(1)))], "state[1][1]['x']", "slice"),
], ids=["object", "function", "set", "tuple-key", "numpy-object", "sparse", "meta", "quantized", "slice"])
def test_unsupported_values_are_refused_naming_path_and_type(make, path, type_name) -> None:
    with pytest.raises(CheckpointError) as info:
        dumps(make())
    assert path in str(info.value) and type_name in str(info.value)


def test_reference_cycle_is_refused() -> None:
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(CheckpointError, match="nested deeper"):
        dumps({"c": cycle})


def test_wrong_step_is_a_clear_error() -> None:
    with pytest.raises(CheckpointError, match="step 3 but step 4 was requested"):
        loads(dumps({"x": torch.ones(2)}, step=3), expected_step=4)


def test_every_flipped_bit_region_and_truncation_is_caught() -> None:
    data = dumps({"w": torch.arange(300, dtype=torch.float32), "s": "text", "b": b"xyz"}, chunk_bytes=256)
    for pos in range(0, len(data), max(1, len(data) // 97)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        with pytest.raises(CheckpointError):
            loads(bytes(damaged))
    for cut in list(range(64)) + list(range(64, len(data), 37)) + [len(data) - 1]:
        with pytest.raises(CheckpointError):
            loads(data[:cut])
    with pytest.raises(CheckpointError, match="bytes but its header describes"):
        loads(data + b"\x00")


def forged(header: dict, payload: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return ser.MAGIC + struct.pack("<Q", len(body)) + body + struct.pack("<I", zlib.crc32(body)) + payload


GOOD = {"format": "ftl-ckpt", "version": 1, "step": 1, "chunk_bytes": 16, "checksum": "crc32", "blobs": [[8, "t"]],
        "tensors": [["float32", [2], [1], 0, 0, False, False]], "arrays": [], "tree": {"$": "tensor", "i": 0}}


@pytest.mark.parametrize("change, message", [
    ({"blobs": [[1 << 60, "t"]]}, "payload bytes"),
    ({"tensors": [["float32", [3], [1], 0, 0, False, False]]}, "needs 12 bytes"),
    ({"tensors": [["float32", [2], [1], 0, 1, False, False]]}, "needs 12 bytes"),
    ({"tensors": [["object", [2], [1], 0, 0, False, False]]}, "not an allowed dtype"),
    ({"tensors": [["float32", [-2], [1], 0, 0, False, False]]}, "dimension"),
    ({"tensors": [["float32", [2], [1], 5, 0, False, False]]}, "blob index"),
    ({"tensors": [["float32", [2], [1, 1], 0, 0, False, False]]}, "do not match"),
    ({"tensors": [["int64", [1], [1], 0, 0, True, False]]}, "cannot be rebuilt"),
    ({"tree": {"$": "tensor", "i": 9}}, "tensor index"),
    ({"tree": {"$": "pickle", "v": "cos\nsystem"}}, "unknown node tag"),
    ({"tree": {"$": "dict", "k": [[1]], "v": [1]}}, "keys"),
    ({"chunk_bytes": 0}, "chunk_bytes"),
    ({"blobs": [[8, "x"]]}, "blob kind"),
    ({"version": 99}, "version 99"),
    ({"format": "pickle"}, "not an ft-lightning"),
    ({"arrays": [["|O8", [1], 0]]}, "numpy dtype"),
    ({"checksum": "md5"}, "checksum 'md5' is not available"),
], ids=lambda v: str(v)[:40])
def test_forged_headers_are_rejected_before_allocating(change, message) -> None:
    header = {**GOOD, **change}
    payload = b"\x00" * 8 + struct.pack("<Q", zlib.crc32(b"\x00" * 8))
    with pytest.raises(CheckpointError, match=message):
        loads(forged(header, payload))


def test_forged_header_is_valid_when_unchanged() -> None:
    payload = b"\x00" * 8 + struct.pack("<Q", zlib.crc32(b"\x00" * 8))
    assert torch.equal(loads(forged(GOOD, payload)), torch.zeros(2))


def test_huge_declared_payload_is_refused_by_the_streaming_parser() -> None:
    frame = forged({**GOOD, "blobs": [[1 << 40, "t"]]})
    with pytest.raises(CheckpointError, match="more than the 1000 this process accepts"):
        ser.parse_header_frame(frame, max_payload_nbytes=1000)


@pytest.mark.parametrize("sizes, chunk, index, expected", [
    ([10], 4, 0, [(0, 0, 4)]),
    ([10], 4, 2, [(0, 8, 10)]),
    ([3, 0, 5], 4, 0, [(0, 0, 3), (2, 0, 1)]),
    ([3, 0, 5], 4, 1, [(2, 1, 5)]),
    ([2, 2, 2], 100, 0, [(0, 0, 2), (1, 0, 2), (2, 0, 2)]),
    ([0, 0, 4], 2, 1, [(2, 2, 4)]),
])
def test_chunk_segments_cover_the_payload_in_order(sizes, chunk, index, expected) -> None:
    assert chunk_segments(sizes, chunk, index) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_never_decode_to_anything_but_checkpoint_error(data: bytes) -> None:
    for candidate in (data, ser.MAGIC + data):
        with pytest.raises(CheckpointError):
            loads(candidate)


VALID = dumps({"a": torch.arange(6, dtype=torch.int32).reshape(2, 3)[:, 1:], "b": [1.5, "x", (None, b"q")],
               "n": np.ones(3, dtype=np.float16)}, step=2, chunk_bytes=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4),
       st.integers(0, len(VALID)))
def test_mutated_valid_checkpoints_fail_only_with_checkpoint_error(flips, cut) -> None:
    damaged = bytearray(VALID)
    for pos, mask in flips:
        damaged[pos] ^= mask
    for candidate in (bytes(damaged), bytes(damaged[:cut])):
        try:
            loads(candidate)
        except CheckpointError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.tuples(children, children)
    | st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), children, max_size=3),
    max_leaves=12))
def test_plain_values_round_trip(value) -> None:
    assert_same(value, loads(dumps(value, chunk_bytes=3)))
