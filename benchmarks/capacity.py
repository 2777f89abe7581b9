"""Lighthouse capacity: how many replica groups can each run a quorum at 10 Hz before the quorum
round trip's p99 passes 100 ms. Same process layout as benchmarks/quorum_latency.py (lighthouse in its
own process, groups spread over worker processes), with rounds paced at the given rate.

`python -m benchmarks.capacity [--quick] [--groups 16,32,64,128] [--hz 10] [--limit-ms 100] [--sim] [--all]
[--no-baseline]`

Members: each library's own manager server and client per group (torchft's in Rust), many per worker
process, no torch import on our side. --sim adds simulated members of ours: one lighthouse client whose
heartbeat stream carries its quorum requests, without a manager server. --all measures every group
count (default: stop at the first one over the limit). Every row reports the lighthouse's CPU time per
round and as a share of one core. Once a count's groups are added, every process runs one full garbage
collection before the paced rounds start (quorum_latency._Job.settle), for both libraries alike.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import _harness
from benchmarks.quorum_latency import _Job


def paced(impl: str, n_groups: int, hz: float, seconds: float, procs: int) -> dict[str, float]:
    """Quorum latencies of `n_groups` groups starting a round every 1/hz seconds for `seconds`."""
    job = _Job(impl, min(procs, n_groups))
    members = [f"group_{i:04d}" for i in range(n_groups)]
    latencies: list[float] = []
    late_rounds = 0
    cpu_start = wall_start = members_start = 0.0
    try:
        for replica_id in members:
            job.add(replica_id)
        job.settle()
        period = 1.0 / hz
        rounds = max(int(seconds * hz), 5)
        for rnd in range(rounds + 3):
            if rnd == 3:
                cpu_start, members_start, wall_start = job.lighthouse_cpu_s(), job.members_cpu_s(), time.monotonic()
            started = time.monotonic()
            job.dispatch(rnd, members)
            got = job.collect()
            errors = [err for _, _, _, err in got if err]
            if errors:
                raise RuntimeError(f"{impl}: quorum failed with {n_groups} groups: {errors[:2]}")
            if rnd >= 3:  # warm-up rounds
                latencies += [lat * 1000 for _, lat, _, _ in got]
            spare = period - (time.monotonic() - started)
            if spare > 0:
                time.sleep(spare)
            else:
                late_rounds += 1
        cpu_s, wall_s = job.lighthouse_cpu_s() - cpu_start, time.monotonic() - wall_start
        members_s = job.members_cpu_s() - members_start
    finally:
        job.close()
    return {"p50_ms": _harness.percentile(latencies, 50), "p99_ms": _harness.percentile(latencies, 99),
            "rounds_over_period": late_rounds, "lighthouse_cpu_ms_per_round": 1000 * cpu_s / rounds,
            "lighthouse_cpu_percent": 100 * cpu_s / wall_s if wall_s > 0 else 0.0,
            "member_cpu_ms_per_group_round": 1000 * members_s / (rounds * n_groups),
            "load_average": os.getloadavg()[0]}


def run(quick: bool = False, groups: Sequence[int] | None = None, hz: float = 10.0, limit_ms: float = 100.0,
        procs: int = 8, sim: bool = False, every: bool = False, baseline: bool = True,
        seconds: float | None = None) -> dict[str, Any]:
    """Grow the group count until p99 passes `limit_ms` (`every`: measure all counts anyway); report the
    largest count that stayed under it."""
    groups = groups or ((16, 64, 128) if quick else (16, 32, 64, 128, 192, 256, 320, 384, 448, 512))
    seconds = seconds or (2.0 if quick else 5.0)
    impls = ["ft_core"] + (["ft_core_sim"] if sim else []) + \
        (["torchft"] if baseline and _harness.torchft_available() else [])
    out: dict[str, Any] = {"hz": hz, "limit_ms": limit_ms, "groups": list(groups)}
    for impl in impls:
        series: dict[int, dict[str, float]] = {}
        capacity, over = 0, False
        for n in groups:
            series[n] = stats = paced(impl, n, hz, seconds, procs)
            over = over or stats["p99_ms"] > limit_ms
            if not over:
                capacity = n  # every count up to n stayed under the limit
            elif not every:
                break
        out[impl] = {"series": series, "max_groups_under_limit": capacity,
                     "note": "" if capacity < groups[-1] else f"limit not reached at {groups[-1]} groups"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--groups", default="", help="comma-separated group counts, ascending")
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--limit-ms", type=float, default=100.0)
    parser.add_argument("--sim", action="store_true", help="also simulated members of ours (see above)")
    parser.add_argument("--all", action="store_true", help="measure every group count (no early stop)")
    parser.add_argument("--no-baseline", action="store_true", help="skip torchft even when installed")
    parser.add_argument("--procs", type=int, default=8, help="worker processes (default 8)")
    parser.add_argument("--seconds", type=float, default=None, help="paced seconds per group count")
    opts = parser.parse_args(argv)
    groups = [int(g) for g in opts.groups.split(",") if g] or None
    result = run(opts.quick, groups, opts.hz, opts.limit_ms, opts.procs, opts.sim, opts.all, not opts.no_baseline,
                 opts.seconds)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
