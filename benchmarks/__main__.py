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


def run_one(name: str, quick: bool, smoke: bool = False) -> dict:
    start = time.monotonic()
    try:
        result = _call(name, quick, smoke)
        return {"ok": True, "seconds": round(time.monotonic() - start, 1), "result": result}
    except Exception as exc:  # a failed benchmark is reported, the others still run
        return {"ok": False, "seconds": round(time.monotonic() - start, 1),
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
