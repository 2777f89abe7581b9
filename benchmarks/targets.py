"""Issue 15's targets in one place: each benchmark reports against them and benchmarks.report marks them
(benchmarks only, never timed assertions in tests)."""

from __future__ import annotations

STEP_RATIO = {"mlp3.7m": 1.05, "mlp25m": 1.02}  # healthy step / its own plain baseline, per model
QUORUM_2 = {"p50_ms": 0.5, "p99_ms": 2.0}  # steady quorum with 2 groups, raw client calls
CAPACITY_FACTOR = 2.0  # lighthouse capacity >= 2x torchft's in the same run
SURVIVOR_GAP_S = 0.2  # survivors' longest commit gap after a peer's SIGKILL
RESTART_S = 2.5  # killed group: restart to first commit
HEAL_GBPS = 4.0  # 1 GB heal transfer over HTTP into fresh tensors
LOST_STEPS_KILLS = 10  # survivors' steps lost per SIGKILL: 0 in at least this many kills
