"""Lighthouse capacity: how many replica groups can each run a quorum at 10 Hz before the quorum
round trip's p99 passes 100 ms. Same process layout as benchmarks/quorum_latency.py (lighthouse in its
own process, groups spread over worker processes), with rounds paced at the given rate.

`python -m benchmarks.capacity [--quick] [--groups 16,32,64,128] [--hz 10] [--limit-ms 100] [--sim]`

--sim: simulated members as cheap as torchft's benchmark members (no torch import, many per process):
each is one lighthouse client whose heartbeat stream carries its quorum requests, without a manager
server, spread over --procs worker processes. Every row reports the lighthouse's CPU time per round.
"""

from __future__ import annotations

import argparse
import json
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
    cpu_start = wall_start = 0.0
    try:
        for replica_id in members:
            job.add(replica_id)
        period = 1.0 / hz
        rounds = max(int(seconds * hz), 5)
        for rnd in range(rounds + 3):
            if rnd == 3:
                cpu_start, wall_start = job.lighthouse_cpu_s(), time.monotonic()
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
    finally:
        job.close()
    return {"p50_ms": _harness.percentile(latencies, 50), "p99_ms": _harness.percentile(latencies, 99),
            "rounds_over_period": late_rounds, "lighthouse_cpu_ms_per_round": 1000 * cpu_s / rounds,
            "lighthouse_cpu_percent": 100 * cpu_s / wall_s if wall_s > 0 else 0.0}


def run(quick: bool = False, groups: Sequence[int] | None = None, hz: float = 10.0, limit_ms: float = 100.0,
        procs: int = 8, sim: bool = False) -> dict[str, Any]:
    """Grow the group count until p99 passes `limit_ms`; report the largest count that stayed under it."""
    groups = groups or ((16, 64) if quick else (16, 32, 64, 128, 192, 256))
    seconds = 2.0 if quick else 5.0
    impls = ["ft_core_sim" if sim else "ft_core"] + (["torchft"] if _harness.torchft_available() and not sim
                                                     else [])
    out: dict[str, Any] = {"hz": hz, "limit_ms": limit_ms}
    for impl in impls:
        series: dict[int, dict[str, float]] = {}
        capacity = 0
        for n in groups:
            series[n] = stats = paced(impl, n, hz, seconds, procs)
            if stats["p99_ms"] > limit_ms:
                break
            capacity = n
        out[impl] = {"series": series, "max_groups_under_limit": capacity,
                     "note": "" if capacity < groups[-1] else f"limit not reached at {groups[-1]} groups"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--groups", default="", help="comma-separated group counts, ascending")
    parser.add_argument("--hz", type=float, default=10.0)
    parser.add_argument("--limit-ms", type=float, default=100.0)
    parser.add_argument("--sim", action="store_true", help="simulated members (see above)")
    parser.add_argument("--procs", type=int, default=None, help="worker processes (default 8; 2 with --sim)")
    parser.add_argument("--seconds", type=float, default=None, help="paced seconds per group count")
    opts = parser.parse_args(argv)
    groups = [int(g) for g in opts.groups.split(",") if g] or None
    procs = opts.procs or (2 if opts.sim else 8)
    result = run(opts.quick, groups, opts.hz, opts.limit_ms, procs, opts.sim) if opts.seconds is None else \
        _run_for(opts, groups, procs)
    print(json.dumps(result, indent=2))
    return 0


def _run_for(opts: argparse.Namespace, groups: Sequence[int] | None, procs: int) -> dict[str, Any]:
    """Every given group count for --seconds each (no early stop)."""
    impl = "ft_core_sim" if opts.sim else "ft_core"
    return {"hz": opts.hz, impl: {n: paced(impl, n, opts.hz, opts.seconds, procs) for n in groups or (16, 64)}}


if __name__ == "__main__":
    raise SystemExit(main())
