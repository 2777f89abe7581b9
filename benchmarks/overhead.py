"""Healthy-path overhead: step time of 2 replica groups x 1 process through ft_core (and torchft where
installed) against plain torch DDP with 2 processes on Gloo. Modes alternate within one run; medians and
ratios are reported. `python -m benchmarks.overhead [--quick] [--model mlp3.7m]`."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import timedelta

from benchmarks import _harness


def _run_mode(mode: str, model: str, steps: int, warmup: int, tmp: str) -> float:
    """One 2-process job; returns the median step time (s) over both ranks."""
    outs = [os.path.join(tmp, f"{mode}_{rank}.json") for rank in range(2)]
    common = ["-m", "benchmarks._step_worker", "--mode", mode, "--model", model, "--steps", str(steps),
              "--warmup", str(warmup)]
    lighthouse = None
    try:
        if mode == "ddp":
            port = _harness.free_port()
            extra = [["--master-port", str(port)]] * 2
        elif mode == "ft":
            from ft_core.lighthouse import LighthouseServer

            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
            extra = [["--lighthouse", lighthouse.address()]] * 2
        else:
            from torchft._torchft import LighthouseServer as TorchftLighthouse

            lighthouse = TorchftLighthouse(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10_000)
            # torchft reports its address by host name; name lookups can stall here, so use the IP.
            port = lighthouse.address().rsplit(":", 1)[1]
            extra = [["--lighthouse", f"http://127.0.0.1:{port}"]] * 2
        _harness.run_workers([[*common, "--rank", str(r), "--out", outs[r], *extra[r]] for r in range(2)],
                             timeout_s=600)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    times: list[float] = []
    for path in outs:
        with open(path) as fh:
            times += json.load(fh)["step_times_s"]
    return _harness.median(times)


def run(quick: bool = False, models: tuple[str, ...] | None = None) -> dict:
    """Alternate baseline and ours (and torchft) `rounds` times per model; report medians and ratios."""
    models = models or (("mlp3.7m",) if quick else ("mlp3.7m", "mlp25m"))
    rounds, steps, warmup = (2, 20, 5) if quick else (3, 50, 10)
    modes = ["ddp", "ft"] + (["torchft"] if _harness.torchft_available() else [])
    results: dict = {"torchft_installed": _harness.torchft_available(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            per_mode: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(rounds):
                for mode in modes:
                    per_mode[mode].append(_run_mode(mode, model, steps, warmup, tmp))
            med = {m: _harness.median(v) for m, v in per_mode.items()}
            entry = {"step_ms": {m: round(v * 1000, 2) for m, v in med.items()},
                     "ratio_vs_ddp": {m: round(v / med["ddp"], 3) for m, v in med.items() if m != "ddp"}}
            if "torchft" in med:
                entry["ours_vs_torchft"] = round(med["ft"] / med["torchft"], 3)
            results["models"][model] = entry
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", action="append", help="mlp3.7m or mlp25m (repeatable)")
    opts = parser.parse_args(argv)
    res = run(opts.quick, tuple(opts.model) if opts.model else None)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
