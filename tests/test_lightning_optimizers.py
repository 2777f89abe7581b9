"""Issue 13: with two optimizers per batch (manual optimization, a GAN's discriminator and generator),
every optimizer step is a step of its own, with its own reductions and its own vote, so a failure
in the second optimizer's reduction can never let groups apply different updates."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import child_env
from ft_core.control.lighthouse import LighthouseServer

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_gan_worker.py")


@pytest.mark.timeout(120)
def test_each_optimizer_step_of_a_two_optimizer_loop_is_voted_on_and_groups_end_identical(processes, tmp_path):
    out = str(tmp_path / "result.jsonl")
    batches = 4
    with LighthouseServer(min_replicas=2, join_timeout_ms=10000) as lighthouse:
        procs = []
        for group in range(2):
            env = child_env(FT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS="2")
            log = open(tmp_path / f"g{group}.log", "w")
            procs.append(processes.spawn([sys.executable, WORKER, out, str(group), str(batches)], env=env,
                                         stdout=log, stderr=subprocess.STDOUT))
        for group, proc in enumerate(procs):
            assert proc.wait(timeout=100) == 0, (tmp_path / f"g{group}.log").read_text()[-4000:]
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 2
    assert rows[0]["digest"] == rows[1]["digest"]
    for row in rows:  # one Manager step (quorum, reductions, vote) per optimizer step
        assert row["ft_step"] == row["global_step"] == 2 * batches, row
