"""`python -m benchmarks run [--quick] [--only NAME ...]`: every benchmark side by side with its baseline.

Writes benchmarks/results/{results.json, results.md, *.png} and refreshes the results section of
benchmarks/README.md with the machine the numbers came from.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import threading
import time
import traceback

from benchmarks import report

# name -> (module, what it measures)
BENCHMARKS = {
    "overhead": ("benchmarks.overhead", "healthy-path step time vs plain DDP (core API, Lightning, Accelerate)"),
    "quorum_latency": ("benchmarks.quorum_latency", "quorum round trip p50/p99 vs number of groups"),
    "failure": ("benchmarks.heal", "survivors' commit gap after SIGKILL; restart to first commit"),
    "transfer": ("benchmarks.transport_throughput", "heal transfer throughput, HTTP and process-group transports"),
    "capacity": ("benchmarks.capacity", "lighthouse capacity: groups at 10 Hz before quorum p99 > 100 ms"),
}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    import importlib.metadata

    import torch

    try:
        torchft = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        try:
            torchft = importlib.metadata.version("torchft-nightly")
        except importlib.metadata.PackageNotFoundError:
            torchft = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "torchft": torchft,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine()}


def _call(name: str, quick: bool, smoke: bool = False) -> dict:
    module = importlib.import_module(BENCHMARKS[name][0])
    if smoke:  # tiny settings: checks the plumbing end to end, the numbers mean nothing
        return {"overhead": lambda: module.run(quick=True, models=("mlp3.7m",), smoke=True),
                "quorum_latency": lambda: module.run(groups=(2, 4), rounds=5, warmup=2),
                "failure": lambda: module.run(quick=True),
                "transfer": lambda: module.run(quick=True, sizes=[10 << 20], reps=1),
                "capacity": lambda: module.run(quick=True, groups=(4, 8))}[name]()
    if name == "quorum_latency":
        return module.run(groups=(2, 8, 64) if quick else (2, 8, 32, 64), rounds=30 if quick else 100)
    return module.run(quick=quick)


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat), None off Linux."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (every benchmark waits for its own)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """The machine's CPU use by processes outside this benchmark run while one benchmark runs: busy CPU of
    the whole machine minus this process tree's, in cores on average, plus the 1-minute load average seen."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._loads: list[float] = []
        self._thread = threading.Thread(target=self._sample, name="bench-load", daemon=True)

    def _sample(self) -> None:
        while True:
            self._loads.append(os.getloadavg()[0])
            if self._stop.wait(2.0):
                return

    def __enter__(self) -> "ForeignLoad":
        self._wall, self._busy, self._own = time.monotonic(), _busy_cpu_seconds(), _own_cpu_seconds()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.wall = time.monotonic() - self._wall
        busy = _busy_cpu_seconds()
        own = _own_cpu_seconds() - self._own
        self.foreign_cores = (None if busy is None or self._busy is None
                              else max(busy - self._busy - own, 0.0) / max(self.wall, 1e-9))

    def summary(self) -> dict:
        return {"foreign_cpu_cores": None if self.foreign_cores is None else round(self.foreign_cores, 2),
                "load_avg_1min": {"min": min(self._loads, default=0.0), "max": max(self._loads, default=0.0)}}


def compile_sources() -> None:
    """Byte-compile this checkout's packages once, as installing a wheel does (pip compiles what it installs).
    An editable install writes the .pyc files on first import, unless PYTHONDONTWRITEBYTECODE is set (as on
    our benchmark VM): every process a benchmark starts would then compile our sources again (~60 ms of CPU
    each, counted in restart to first commit), while torch and torchft come compiled from their wheels."""
    import compileall

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("ft_core", "ft_lightning", "benchmarks", "tests"):
        compileall.compile_dir(os.path.join(root, package), quiet=1, workers=1)


def run_one(name: str, quick: bool, smoke: bool = False) -> dict:
    load = ForeignLoad()
    try:
        with load:
            result = _call(name, quick, smoke)
        return {"ok": True, "seconds": round(load.wall, 1), "result": result, "machine_load": load.summary()}
    except Exception as exc:  # a failed benchmark is reported, the others still run
        return {"ok": False, "seconds": round(load.wall, 1), "machine_load": load.summary(),
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="run benchmarks and write benchmarks/results/")
    run_p.add_argument("--quick", action="store_true", help="fewer rounds and sizes (< 10 minutes on 2 cores)")
    run_p.add_argument("--only", action="append", choices=sorted(BENCHMARKS), help="run just these (repeatable)")
    run_p.add_argument("--no-readme", action="store_true", help="do not rewrite benchmarks/README.md")
    run_p.add_argument("--smoke", action="store_true",
                       help="tiny settings to check the plumbing (implies --quick and --no-readme; numbers mean nothing)")
    run_p.add_argument("--out", default=RESULTS_DIR, help="results directory (default benchmarks/results)")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.quick = opts.no_readme = True
    names = opts.only or list(BENCHMARKS)
    out_dir = opts.out
    compile_sources()
    os.makedirs(out_dir, exist_ok=True)
    results = {"machine": machine(), "quick": opts.quick, "smoke": opts.smoke, "benchmarks": {}}
    started = time.monotonic()
    for name in names:
        print(f"[benchmarks] {name}: {BENCHMARKS[name][1]} ...", flush=True)
        results["benchmarks"][name] = outcome = run_one(name, opts.quick, opts.smoke)
        status = "ok" if outcome["ok"] else f"FAILED: {outcome['error']}\n{outcome['traceback']}"
        print(f"[benchmarks] {name}: {status} ({outcome['seconds']} s)", flush=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    markdown = report.markdown(results)
    with open(os.path.join(out_dir, "results.md"), "w") as fh:
        fh.write(markdown)
    report.plots(results, out_dir)
    if not opts.no_readme:
        report.update_readme(markdown, os.path.join(os.path.dirname(RESULTS_DIR), "README.md"))
    print(markdown)
    return 0 if all(o["ok"] for o in results["benchmarks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
