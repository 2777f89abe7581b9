"""The fault injection of examples/train_ddp.py, which the process tests and benchmarks/heal.py drive: a
point is armed by --kill-at or by the kill file, and the checkpoint source's wrapper costs nothing (no
pause) unless its point is armed. The source's vote waits for its staging, so a pause there on every heal
lengthened the survivors' gap that benchmarks/heal.py reports (every group there runs with a kill file).
"""

from __future__ import annotations

import types
from datetime import timedelta

import pytest
import torch
from ft_harness import repo_module

from ft_core.checkpointing import HTTPTransport


def _example() -> types.ModuleType:
    return repo_module("examples.train_ddp")


class _Step:
    """What KillSwitch reads of the Manager: the current step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def current_step(self) -> int:
        return self.step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("at, written, step, point, armed", [
    (None, None, 5, "forward", False),
    (None, "forward", 5, "forward", True),
    (None, "forward", 5, "send_checkpoint", False),
    (None, "send_checkpoint\n", 0, "send_checkpoint", True),
    ("7:allreduce", None, 6, "allreduce", False),
    ("7:allreduce", None, 7, "allreduce", True),
    ("7:allreduce", None, 9, "forward", False),
    ("7:allreduce", "forward", 1, "forward", True),
])
def test_a_point_is_armed_by_kill_at_from_its_step_or_by_the_kill_file(tmp_path, at, written, step, point, armed):
    path = str(tmp_path / "kill")
    if written is not None:
        with open(path, "w") as f:
            f.write(written)
    switch = _example().KillSwitch(_Step(step), at, path)
    assert switch.armed(point) is armed


@pytest.mark.timeout(60)
def test_a_source_stages_without_a_pause_unless_send_checkpoint_is_armed(tmp_path, monkeypatch):
    example = _example()
    sleeps: list[float] = []
    kills: list[int] = []
    monkeypatch.setattr(example.time, "sleep", sleeps.append)
    monkeypatch.setattr(example.os, "kill", lambda pid, sig: kills.append(sig))
    transport = HTTPTransport(timeout=timedelta(seconds=5))
    manager = types.SimpleNamespace(current_step=lambda: 3, _allreduce_future=None, _vote=None,
                                    checkpoint_transport=transport)
    path = str(tmp_path / "kill")
    state = {"w": torch.arange(4.0)}
    try:
        example.install_kill(example.KillSwitch(manager, None, path), manager, torch.nn.Linear(2, 2))
        transport.send_checkpoint([1], 3, state, timedelta(seconds=5))  # nothing armed
        assert sleeps == [] and kills == []
        with open(path, "w") as f:
            f.write("forward")  # another point armed
        transport.send_checkpoint([1], 4, state, timedelta(seconds=5))
        assert sleeps == [] and kills == []
        with open(path, "w") as f:
            f.write("send_checkpoint")
        transport.send_checkpoint([1], 5, state, timedelta(seconds=5))
        assert sleeps == [0.05] and len(kills) == 1  # staged, a pause for the healer to start, then SIGKILL
    finally:
        transport.shutdown()
