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


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from (Python, numpy, torch CPU and CUDA when initialized), as
    the libraries return them: cheap enough for every step start; `rng_state` converts it for sending."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # False without CUDA too
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def rng_state(captured: dict[str, Any] | None = None) -> dict[str, Any]:
    """`captured` (default: the RNGs now, `capture_rng`) as a healing peer receives it: tensors and numbers."""
    raw = capture_rng() if captured is None else captured
    version, internal, gauss = raw["python"]
    numpy_state = raw["numpy"]
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch": raw["torch"],
    }
    if "cuda" in raw:
        state["cuda"] = raw["cuda"]
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


class DelegatingLoader:
    """A wrapper of a prepared loader (`_ft_inner`): every attribute it does not define is the loader's."""

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_ft_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class EpochAlignedLoader(DelegatingLoader):
    """A prepared training DataLoader that keeps a plain `for epoch in range(N): for batch in loader:`
    loop on the job's position after a heal.

    It counts its passes (epochs) and the batches yielded in the current pass. A healing group
    receives the source's counts (`state_dict`, taken at the start of the step) and, once it has
    loaded them, its loop lands where the source is: the current pass ends at once, the passes the
    source already finished are empty, and the source's pass resumes after its batch. While the loop
    is being brought there (`aligning`), the accelerator's schedulers do not step, so epoch-level
    `scheduler.step()` calls of the skipped epochs do not advance the healed schedule. Every other
    attribute is the prepared loader's.
    """

    def __init__(self, inner: Any) -> None:
        self._ft_inner = inner
        self.passes = 0  # passes (epochs) ended
        self.batch = 0  # batches yielded in the current pass
        self.training = False  # a training step ran while this loader was being iterated
        self._iterating = False
        self._window: tuple[int, int] = (0, 0)  # (passes, batch) at the start of the current step
        self._target: tuple[int, int] | None = None
        self._cut = False  # the current pass was ended early to reach the source's pass

    def __len__(self) -> int:
        return len(self._ft_inner)

    @property
    def aligning(self) -> bool:
        """Between the end of the healed step's pass, cut short, and the start of the source's pass."""
        return self._cut

    def on_step_start(self) -> None:
        if self._iterating:
            self.training = True
        self._window = (self.passes, self.batch)

    def state_dict(self) -> dict[str, int]:
        passes, batch = self._window
        return {"passes": passes, "batch": batch, "training": int(self.training)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The source's position at the start of this step, shifted by the batches this group drew since."""
        if not int(state.get("training", 0)) or not self.training:
            return
        passes, batch = self._window
        target = (int(state["passes"]), int(state["batch"]) + (self.batch - batch if self.passes == passes else 0))
        if target != (self.passes, self.batch):
            self._target = target

    def checkpoint_state(self) -> dict[str, Any]:
        """For `accelerator.save_state`: the pass and batch the next step starts at."""
        return {"kind": "epoch_aligned", "passes": self.passes, "batch": self.batch}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Resume at the saved pass and batch (from `accelerator.load_state`, before the loop): the passes
        before it are empty and schedulers do not step for them (the loaded schedule holds their steps)."""
        if state.get("kind") != "epoch_aligned":
            raise ConfigError(f"the checkpoint holds a {state.get('kind')} loader position where this script "
                              f"prepared a static-shard loader; use the same exactly_once setting as when saving")
        target = (int(state["passes"]), int(state["batch"]))
        if target != (self.passes, self.batch):
            self._target = target
            self._cut = target[0] > self.passes

    def __iter__(self) -> Any:
        inner = self._ft_inner
        target = self._target
        skip = 0
        if target is not None:
            if self.passes < target[0]:  # a pass the source already finished: empty
                self.passes += 1
                return
            self._target = None
            self._cut = False
            if self.passes == target[0]:
                skip = target[1]
                if hasattr(inner, "iteration"):
                    inner.iteration = target[0]  # the same shuffle as the source's pass
        self._iterating = True
        self.batch = 0
        it = iter(inner)
        finished = False
        try:
            for batch in it:
                if self.batch < skip:
                    self.batch += 1
                    continue
                self.batch += 1
                yield batch
                if self._target is not None:  # healed during that step: bring the loop to the source
                    if self._target[0] == self.passes:
                        self._catch_up(it)
                        if self._target is None:
                            continue
                    self._cut = True
                    break
            else:
                finished = True
        finally:
            self._iterating = False
            self.passes += 1
            self.batch = 0
            if not finished:  # a pass cut short: leave Accelerate's gradient state as a finished pass does
                close = getattr(it, "close", None)
                if callable(close):
                    close()
                end = getattr(inner, "end", None)
                if callable(end):  # Accelerate's DataLoaderShard: drop it from the gradient state (idempotent)
                    end()

    def _catch_up(self, it: Any) -> None:
        """Healed into the same pass: drop batches up to the source's next one."""
        assert self._target is not None
        while self.batch < self._target[1]:
            try:
                next(it)
            except StopIteration:
                break
            self.batch += 1
        self._target = None
