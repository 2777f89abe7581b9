"""What the ledger workers of tests/test_data_ledger.py share: the dataset whose samples carry their own
index, the data-position fingerprint that links a step to the one before it, and the ledger file.

Imports only torch: spawned DataLoader workers import this module to unpickle the dataset.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


class Indexed(torch.utils.data.Dataset):
    """Sample i is (features derived from i, i): the ledger reads the index back from the batch."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i % 17) / 17.0), i


def fingerprint(sampler: Any) -> str:
    """The data position the sampler's next assignment is drawn from (the committed one, or a healed one
    loaded at a synchronous quorum: `training_position`), as a short digest."""
    return hashlib.sha1(json.dumps(sampler.training_position()).encode()).hexdigest()[:16]


class Ledger:
    """One process's ledger: a JSON line per row, line-buffered so a SIGKILL loses at most the last one."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (open until exit)

    def write(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"kind": kind, **fields}) + "\n")

    def attempt(self, rec: Any, indices: list[int], before: str, **fields: Any) -> None:
        """The step attempt the exactly-once sampler checked (`rec`: its last batch); a batch that counts
        must be the one it assigned."""
        if rec.valid:
            assert sorted(indices) == sorted(rec.indices), (indices, rec.indices)
        self.write("attempt", step=rec.step, epoch=rec.epoch, **fields, indices=list(rec.indices),
                   rank=rec.participating_rank, n=rec.num_participants, valid=rec.valid, held=list(rec.held),
                   consumed=list(rec.consumed), batch=len(indices), before=before)
