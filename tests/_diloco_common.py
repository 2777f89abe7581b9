"""What the DiLoCo workers of tests/test_lightning_diloco.py and tests/test_accelerate_diloco.py share:
counting the step protocol's commit and heal events, dying by SIGKILL, and the summary they end with."""

from __future__ import annotations

import json
import logging
import os
from typing import Any


class Votes(logging.Handler):
    """Counts the "commit" (one per vote) and "heal" events of "ft_core.events"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)  # a committed step's event is DEBUG (routine)
        self.commits = 0
        self.heals = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if isinstance(event, dict):
            self.commits += event.get("type") == "commit"
            self.heals += event.get("type") == "heal"


def count_votes() -> Votes:
    """A `Votes` attached to "ft_core.events" (at DEBUG, so routine commits reach it)."""
    votes = Votes()
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.DEBUG)
    events.addHandler(votes)
    return votes


def kill_self(step: int) -> None:
    print(f"SIGKILL at inner step {step}", flush=True)
    os.kill(os.getpid(), 9)


def write_summary(out: str, group: int, incarnation: int, manager: Any, votes: Votes, **fields: Any) -> None:
    """summary_g<group>_i<incarnation>.json: the Manager's step, the votes and heals, and every DiLoCo
    fragment's global parameters and outer optimizer state (equal in groups that are in sync)."""
    state = manager.healing_state()["user"]
    fragments = {key: {"original_parameters": {n: t.tolist() for n, t in value["original_parameters"].items()},
                       "outer_optimizer": {str(i): {k: v.tolist() for k, v in s.items()}
                                           for i, s in value["outer_optimizer"]["state"].items()}}
                 for key, value in state.items() if key.startswith("StreamingDiLoCoFragment_")}
    summary = {"group": group, **fields, "manager_step": manager.current_step(), "votes": votes.commits,
               "heals": votes.heals, "fragments": fragments}
    with open(os.path.join(out, f"summary_g{group}_i{incarnation}.json"), "w") as f:
        json.dump(summary, f)
