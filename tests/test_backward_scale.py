"""The average's division done by the loss (ft_core.ddp.backward_scale): every integration's backward
multiplies the loss by 1 / (groups x group ranks) instead of dividing every reduced gradient, one pass
less per step. Checked with real replica groups (processes, a real lighthouse, Gloo): after each
integration's backward, every rank holds the mean of every taking-part rank's own gradient, as with a plain
`loss.backward()` (tests/_average_worker.py records both as projections). The redo that rescales for a
lost group is checked in tests/test_redo_step.py."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
import torch
from conftest import child_env
from torch.distributed import ReduceOp

from ft_core.control.lighthouse import LighthouseServer
from ft_core.errors import ConfigError
from ft_core.step_rules import check_reduce_op

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_average_worker.py")


def run_groups(processes: Any, tmp_path: Any, groups: int, api: str, *extra: str, nproc: int = 1,
               timeout: float = 150) -> list[dict[str, Any]]:
    out = tmp_path / "rows.jsonl"
    with LighthouseServer(min_replicas=groups, join_timeout_ms=10000) as lighthouse:
        procs = []
        for g in range(groups):
            script = [WORKER, "--api", api, "--out", str(out), *extra]
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    "--max-restarts=0", *script] if nproc > 1 else [sys.executable, *script]
            log = open(tmp_path / f"g{g}.log", "w")  # noqa: SIM115 (the child keeps it)
            env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(g),
                            NUM_REPLICA_GROUPS=str(groups), FT_MIN_REPLICA_SIZE=str(groups))
            procs.append(processes.spawn(argv, env=env, stdout=log, stderr=log))
        for g, proc in enumerate(procs):
            code = proc.wait(timeout=timeout)
            assert code == 0, f"group {g} exited with {code}:\n{(tmp_path / f'g{g}.log').read_text()[-4000:]}"
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def assert_reduced_is_the_mean(rows: list[dict[str, Any]], groups: int, ranks: int, min_steps: int) -> None:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    assert len(by_step) >= min_steps, sorted(by_step)
    for step, at in sorted(by_step.items()):
        assert len(at) == groups * ranks, (step, at)
        taking_part = [r for r in at if r["participating"]]  # not a group healing at step 0 (init_sync)
        assert taking_part and len(taking_part) == at[0]["participants"] * ranks, (step, at)
        mean = [sum(r["local"][k] for r in taking_part) / len(taking_part) for k in range(4)]
        for r in at:
            assert r["reduced"] == pytest.approx(mean, rel=1e-4, abs=1e-7), (step, r, mean)
    assert any(len([r for r in at if r["participating"]]) == groups * ranks for at in by_step.values())


@pytest.mark.timeout(180)
# 2 groups of 2 ranks with a plain backward: in the slow tier (~25 s), as the mixed-paths variant below runs
# both backward paths with two ranks in every suite (the suite stays within 15 minutes)
@pytest.mark.parametrize("groups, nproc, extra", [(3, 1, []), (3, 1, ["--plain-backward"]), (2, 2, []),
                                                  pytest.param(2, 2, ["--plain-backward"], marks=pytest.mark.slow),
                                                  (2, 2, ["--torchft-wrapper"]),
                                                  (3, 1, ["--sync-quorum", "--mix-backward"]),
                                                  (2, 2, ["--sync-quorum", "--mix-backward"])],
                         ids=["3-groups", "3-groups-plain-backward", "2-groups-of-2-ranks",
                              "2-groups-of-2-ranks-plain-backward", "2-groups-of-2-ranks-torchft-wrapper",
                              "3-groups-sync-quorum-paths-mixed", "2-groups-of-2-ranks-sync-quorum-paths-mixed"])
def test_the_core_api_s_backward_gives_every_rank_the_mean_gradient(processes, tmp_path, groups, nproc, extra):
    rows = run_groups(processes, tmp_path, groups, "core", *extra, nproc=nproc)
    assert_reduced_is_the_mean(rows, groups, nproc, min_steps=4)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("api, devices", [("fabric", 1), ("accelerate", 1), ("lightning", 1), ("lightning", 2)],
                         ids=["fabric", "accelerate-2-micro-batches", "lightning", "lightning-2-ranks"])
def test_each_integration_s_backward_gives_every_rank_the_mean_gradient(processes, tmp_path, api, devices):
    rows = run_groups(processes, tmp_path, 2, api, "--devices", str(devices))
    assert_reduced_is_the_mean(rows, 2, devices, min_steps=3)


@pytest.mark.parametrize("op, divided_by", [(ReduceOp.SUM, 2), (ReduceOp.AVG, 0), (ReduceOp.AVG, True),
                                            (ReduceOp.AVG, 1.5)])
def test_an_input_said_to_be_divided_already_must_be_an_average_over_a_whole_number_of_groups(op, divided_by):
    with pytest.raises(ConfigError, match="divided_by"):
        check_reduce_op(op, torch.float32, divided_by)
    check_reduce_op(ReduceOp.AVG, torch.float32, 3)
