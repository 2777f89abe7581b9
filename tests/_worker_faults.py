"""Test-worker helpers shared by the integrations' workers: die inside a step's cross-group reduction, and
hold before a step until the test says go."""

from __future__ import annotations

import os
import time
from typing import Any, Callable


def kill_in_reduction(step: int, groups: int) -> None:
    """SIGKILL this process instead of issuing its cross-group reduction of the first Manager step from `step` on
    that `groups` groups take part in, while the peers' reductions of it are in flight."""
    die_in_reduction(lambda m: m.current_step() >= step and m.num_participants() == groups,
                     lambda m: f"SIGKILL self in the reduction of step {m.current_step()}")


def die_in_reduction(when: Callable[[Any], bool], say: Callable[[Any], str]) -> None:
    """SIGKILL this process instead of issuing a cross-group reduction for which `when(manager)` holds (printing
    `say(manager)` first), while the peers' reductions of it are in flight."""
    from ft_core.manager import Manager

    issue = Manager._allreduce_future

    def or_die(self, tensor, *a, **kw):  # type: ignore[no-untyped-def]
        if when(self):
            time.sleep(0.05)  # the peers' reductions of this step are in flight, waiting for ours: it never comes
            print(say(self), flush=True)
            os.kill(os.getpid(), 9)
        return issue(self, tensor, *a, **kw)

    Manager._allreduce_future = or_die


def hold(holds: list[str], step: int) -> None:
    """For each "STEP:FILE" of `holds` at this step: wait (at most 90 s) until FILE exists."""
    for spec in holds:
        at, _, path = spec.partition(":")
        if step == int(at):
            deadline = time.monotonic() + 90
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.02)
