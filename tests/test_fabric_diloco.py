"""`FaultTolerantFabricDiLoCoStrategy` ("fault_tolerant_diloco" for Fabric) with two real Fabric processes:
Streaming DiLoCo (two fragments, delay 1, alpha 0.5) in a plain Fabric loop; one group is SIGKILLed between
syncs and restarted, heals at its first sync (model, inner optimizer, loop position, global copies, outer
optimizer state), and both end identical; exactly one cross-group allreduce per sync, none per inner step."""

from __future__ import annotations

import pytest
from test_lightning_diloco import run_kill_restart

from ft_core.errors import ConfigError


@pytest.mark.timeout(110)
def test_fabric_diloco_kill_restart_heals_identical_and_one_allreduce_per_sync(processes, tmp_path):
    s0, s1 = run_kill_restart(processes, tmp_path, "fabric")
    assert s0["framework"] == s1["framework"] == "fabric"


def test_fabric_diloco_is_registered_and_rejects_bad_arguments():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from ft_lightning.fabric import FaultTolerantFabricDiLoCoStrategy

    assert STRATEGY_REGISTRY["fault_tolerant_diloco"]["strategy"] is FaultTolerantFabricDiLoCoStrategy
    with pytest.raises(ConfigError, match="synchronous quorum"):
        FaultTolerantFabricDiLoCoStrategy(lighthouse_addr="127.0.0.1:1", use_async_quorum=True)
    with pytest.raises(ConfigError, match="fragments"):
        FaultTolerantFabricDiLoCoStrategy(lighthouse_addr="127.0.0.1:1", fragments=0)
