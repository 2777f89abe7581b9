"""`FaultTolerantDiLoCoAccelerator` with two Accelerate processes: Streaming DiLoCo (two fragments,
delay 1, alpha 0.5); one group is SIGKILLed between syncs and restarted from scratch, heals at a
sync, and both end with identical global parameters and outer optimizer state; the cross-group
process group carries exactly one allreduce per sync (bucketized pseudo-gradients)."""

from __future__ import annotations

import os

import pytest
from test_lightning_diloco import kill_restart

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_accelerate_diloco_worker.py")


@pytest.mark.timeout(110)
def test_diloco_accelerator_kill_restart_heals_identical_and_one_allreduce_per_sync(processes, tmp_path):
    s0, s1 = kill_restart(processes, tmp_path, WORKER, 7)
    assert s0["manager_step"] == s1["manager_step"] == 8
