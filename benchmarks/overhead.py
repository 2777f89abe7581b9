"""Healthy-path overhead: step time of 2 replica groups x 1 process through ft_core's core API (its
`model.backward(loss)`, and as `ft_plain` a plain `loss.backward()`), our
Lightning strategy and our Accelerate plugin (and torchft where installed), each against its plain
baseline with 2 processes on Gloo (torch DDP, Lightning `strategy="ddp"`, Accelerate multi-CPU DDP).
Modes alternate within one run; medians and ratios are reported.

    python -m benchmarks.overhead [--quick] [--rounds N] [--model mlp3.7m] [--mode ddp --mode ft ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks import _harness, _models, targets

# ours (or torchft's) mode -> the plain baseline it is compared with
BASELINE = {"ft": "ddp", "ft_plain": "ddp", "torchft": "ddp", "lightning_ft": "lightning_ddp",
            "accelerate_ft": "accelerate_ddp"}
LABELS = {"ddp": "torch DDP", "ft": "ours, core API", "ft_plain": "ours, core API, loss.backward()",
          "torchft": "torchft", "lightning_ddp": "Lightning DDP", "lightning_ft": "ours, Lightning",
          "accelerate_ddp": "Accelerate DDP", "accelerate_ft": "ours, Accelerate"}
ALL_MODES = ("ddp", "ft", "ft_plain", "torchft", "lightning_ddp", "lightning_ft", "accelerate_ddp", "accelerate_ft")
REFERENCE = "torchft 1.45x plain DDP (107.8 vs 74.1 ms, 3.68M-param MLP, batch 32), as measured for the issue"


def _run_mode(mode: str, model: str, steps: int, warmup: int, tmp: str) -> tuple[float, dict[str, float], dict]:
    """One 2-process job: the median step time (s) over both ranks, the median of each phase (s;
    core API, torch DDP and torchft only: zero_grad, forward, backward, step and the CPU time per step),
    and extras: per-thread CPU ms per timed step (mean of the ranks), the lighthouse's CPU ms per step
    of the job (ours and torchft's run in this process; start-up steps included) and bucket copies."""
    outs = [os.path.join(tmp, f"{mode}_{rank}.json") for rank in range(2)]
    common = ["-m", "benchmarks._step_worker", "--mode", mode, "--model", model, "--steps", str(steps),
              "--warmup", str(warmup)]
    lighthouse = None
    try:
        if mode in ("ddp", "lightning_ddp", "accelerate_ddp"):
            port = _harness.free_port()
            extra = [["--master-port", str(port)]] * 2
        elif mode in ("ft", "ft_plain", "lightning_ft", "accelerate_ft"):
            from ft_core.control.lighthouse import LighthouseServer

            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
            extra = [["--lighthouse", lighthouse.address()]] * 2
        else:
            from torchft._torchft import LighthouseServer as TorchftLighthouse

            lighthouse = TorchftLighthouse(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
            # torchft reports its address by host name; name lookups can stall here, so use the IP.
            port = lighthouse.address().rsplit(":", 1)[1]
            extra = [["--lighthouse", f"http://127.0.0.1:{port}"]] * 2
        workdir = os.path.join(tmp, f"{mode}_root")
        cpu_before = time.process_time()  # this process runs the lighthouse and otherwise only waits
        _harness.run_workers([[*common, "--rank", str(r), "--out", outs[r], "--workdir", workdir, *extra[r]]
                              for r in range(2)], timeout_s=300)
        lighthouse_ms = (time.process_time() - cpu_before) * 1000 / (steps + warmup) if lighthouse else None
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    times: list[float] = []
    phases: dict[str, list[float]] = {}
    threads: dict[str, float] = {}
    extra: dict = {"lighthouse_cpu_ms": lighthouse_ms}
    for path in outs:
        with open(path) as fh:
            data = json.load(fh)
        times += data["step_times_s"]
        for name, values in (data.get("phases_s") or {}).items():
            phases.setdefault(name, []).extend(values)
        for kind, ms in (data.get("thread_cpu_ms") or {}).items():
            threads[kind] = threads.get(kind, 0.0) + ms / len(outs)
        if "bucket_copies" in data:
            extra["bucket_copies"] = max(extra.get("bucket_copies", 0), data["bucket_copies"])
    if threads:
        extra["thread_cpu_ms"] = threads
    return _harness.median(times), {name: _harness.median(values) for name, values in phases.items()}, extra


def _cpu_ratios(per_thread: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Each mode's CPU per step (all threads, median over rounds) over its baseline's."""
    rounds = {m: [sum(v[i] for v in kinds.values()) for i in range(min(len(v) for v in kinds.values()))]
              for m, kinds in per_thread.items() if kinds}
    cpu = {m: _harness.median(v) for m, v in rounds.items() if v}
    return {m: round(cpu[m] / cpu[BASELINE[m]], 3) for m in cpu if BASELINE.get(m) in cpu and cpu[BASELINE[m]]}


def run(quick: bool = False, models: tuple[str, ...] | None = None, modes: tuple[str, ...] | None = None,
        smoke: bool = False, rounds: int | None = None) -> dict:
    """Alternate every mode `rounds` times per model; report median step times and ratios to the baselines."""
    models = models or ("mlp3.7m", "mlp25m")
    # (rounds, measured steps, warm-up steps) per model; a job's start-up (imports, rendezvous) dominates --quick
    plan = {"mlp3.7m": (2, 15, 4), "mlp25m": (1, 6, 2)} if quick else {"mlp3.7m": (5, 50, 10), "mlp25m": (5, 20, 5)}
    if smoke:
        plan = {"mlp3.7m": (1, 3, 1), "mlp25m": (1, 2, 1)}
    torchft = _harness.torchft_available()
    modes = tuple(m for m in (modes or ALL_MODES) if m != "torchft" or torchft)
    for mode in modes:
        if mode in BASELINE and BASELINE[mode] not in modes:
            raise ValueError(f"mode {mode} needs its baseline {BASELINE[mode]} in the same run")
    results: dict = {"torchft_installed": torchft, "modes": list(modes), "labels": LABELS, "baseline": BASELINE,
                     "target_ratio": targets.STEP_RATIO, "reference": REFERENCE, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            planned, steps, warmup = plan.get(model, plan["mlp3.7m"])
            rounds_here = rounds or planned
            per_mode: dict[str, list[float]] = {m: [] for m in modes}
            per_phase: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
            per_thread: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
            lighthouse_ms: dict[str, list[float]] = {m: [] for m in modes}
            copies: dict[str, int] = {}
            load = []
            for _ in range(rounds_here):  # alternate, so drift in machine load hits every mode alike
                for mode in modes:
                    step_s, phases, extra = _run_mode(mode, model, steps, warmup, tmp)
                    per_mode[mode].append(step_s)
                    for name, value in phases.items():
                        per_phase[mode].setdefault(name, []).append(value)
                    for kind, ms in (extra.get("thread_cpu_ms") or {}).items():
                        per_thread[mode].setdefault(kind, []).append(ms)
                    if extra.get("lighthouse_cpu_ms") is not None:
                        lighthouse_ms[mode].append(extra["lighthouse_cpu_ms"])
                    if "bucket_copies" in extra:
                        copies[mode] = max(copies.get(mode, 0), extra["bucket_copies"])
                    load.append(os.getloadavg()[0])
            med = {m: _harness.median(v) for m, v in per_mode.items()}
            entry = {"params": _models.param_count(_models.build(model)), "rounds": rounds_here, "steps": steps,
                     "step_ms": {m: round(v * 1000, 2) for m, v in med.items()},
                     "ratio_vs_baseline": {m: round(med[m] / med[BASELINE[m]], 3) for m in med if m in BASELINE},
                     # each round's ratio (the two jobs ran minutes apart at most): how far the machine moved them
                     "ratio_per_round": {m: [round(a / b, 3) for a, b in zip(per_mode[m], per_mode[BASELINE[m]])]
                                         for m in modes if m in BASELINE},
                     # CPU per step of every thread of a rank (mean of the ranks): on a 2-core box where both
                     # ranks are CPU-bound, the steadier figure of what a mode adds
                     "cpu_ratio_vs_baseline": _cpu_ratios(per_thread),
                     "phases_ms": {m: {name: round(_harness.median(v) * 1000, 2) for name, v in ph.items()}
                                   for m, ph in per_phase.items() if ph},
                     "thread_cpu_ms": {m: {k: round(_harness.median(v), 2) for k, v in th.items()}
                                       for m, th in per_thread.items() if th},
                     "lighthouse_cpu_ms": {m: round(_harness.median(v), 2) for m, v in lighthouse_ms.items() if v},
                     "bucket_copies": copies,
                     "load_avg_1min": {"min": round(min(load), 2), "max": round(max(load), 2)} if load else None}
            if "torchft" in med and "ft" in med:
                entry["ours_vs_torchft"] = round(med["ft"] / med["torchft"], 3)
            results["models"][model] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", action="append", help="mlp3.7m or mlp25m (repeatable)")
    parser.add_argument("--mode", action="append", choices=ALL_MODES, help="modes to run (repeatable; default all)")
    parser.add_argument("--rounds", type=int, help="alternations per model (default: 5, --quick 2 / 1)")
    opts = parser.parse_args(argv)
    res = run(opts.quick, tuple(opts.model) if opts.model else None, tuple(opts.mode) if opts.mode else None,
              rounds=opts.rounds)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
