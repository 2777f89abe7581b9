"""The state a healing replica group receives: what may travel, and the RNG states.

A healing peer is sent plain data only (nothing received from the network is unpickled): tensors,
numpy arrays, numbers, str, bool, None, nested in dicts, lists and tuples. Objects registered with
`accelerator.register_for_checkpointing` are checked against that rule when registered.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ft_core.errors import ConfigError

# What ft_core.checkpointing.serialization accepts (exact types, as it checks them).
_SCALARS = (bool, int, float, str, bytes, bytearray, type(None))
_KEYS = (str, int, float, bool, type(None))


def transport_problem(value: Any, path: str = "state") -> str | None:
    """Where `value` holds something a healing transfer cannot carry, or None if it is all plain data."""
    kind = type(value)
    if kind in _SCALARS or isinstance(value, (torch.Tensor, np.generic)) or kind is np.ndarray:
        return None
    if kind is dict or kind is OrderedDict:
        for key, item in value.items():
            if type(key) not in _KEYS:
                return f"{path} has a key {key!r} of type {type(key).__name__} (keys must be str, int, float, bool)"
            problem = transport_problem(item, f"{path}[{key!r}]")
            if problem:
                return problem
        return None
    if kind is list or kind is tuple:
        for index, item in enumerate(value):
            problem = transport_problem(item, f"{path}[{index}]")
            if problem:
                return problem
        return None
    return f"{path} is a {kind.__module__}.{kind.__qualname__}"


def check_transport_safe(value: Any, what: str) -> None:
    """Raise ConfigError naming the offending entry if `value` cannot be sent to a healing peer."""
    problem = transport_problem(value, what)
    if problem:
        raise ConfigError(f"{problem}, which cannot be sent to a healing replica group; make its state_dict() "
                          f"return only tensors, numpy arrays, numbers, str, bool, None and dicts/lists/tuples "
                          f"of those")


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: Python, numpy, torch CPU and CUDA (when initialized)."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def load_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured (lists may arrive where tuples were sent)."""
    py = state["python"]
    internal = py["internal"]
    internal = tuple(int(x) for x in (internal.tolist() if isinstance(internal, torch.Tensor) else internal))
    random.setstate((int(py["version"]), internal, py["gauss"]))
    npy = state["numpy"]
    np.random.set_state({"bit_generator": npy["bit_generator"],
                         "state": {"key": _numpy_key(npy["key"]), "pos": int(npy["pos"])},
                         "has_gauss": int(npy["has_gauss"]), "gauss": float(npy["gauss"])})
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def _numpy_key(value: Any) -> np.ndarray:
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.astype(np.uint32)


def _byte_tensor(value: Any) -> torch.Tensor:
    return value.to(device="cpu", dtype=torch.uint8) if isinstance(value, torch.Tensor) else \
        torch.tensor(value, dtype=torch.uint8)
